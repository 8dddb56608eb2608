"""Leaner saved activations: ops whose autograd graph would keep large intermediates for the
backward run under torch's (reentrant) checkpoint instead, which keeps only their inputs and
reruns the same ops in the backward, so outputs and gradients are bit-identical.

Measured per token and decoder layer of a Qwen2.5-1.5B shape in bfloat16 (docs/gpu.md,
"Activation memory per token"; tests/unit/test_activation_memory.py):
- RMSNorm in float32 (`F.rms_norm(x.float())`, cast back, times the weight) kept a float32
  copy of its input and the cast-back normalised tensor (4.5 values of 2 bytes per hidden
  feature); recomputed it keeps its bfloat16 input (1 value).
- megatron-core's unfused SwiGLU (`MLP.forward`'s `glu`: silu(gate) * (up + 0.0)) kept the fc1
  output, silu(gate) and the (up + 0.0) copy; `SwiGLUMLP` keeps the fc1 output alone
  (3 * ffn values -> 2 * ffn). megatron's fused `bias_swiglu_impl` would keep only the fc1
  output too, but its backward is a different formula (bfloat16 gradients change) and its
  jit fuser is torch.compile.
The recomputation costs a few elementwise kernels per layer in the backward.

The norms' and SwiGLU's math (and packed RoPE's, model/rope.py) runs compiled on CUDA
(model/compiled.py, `SWIFT_MEGATRON_COMPILE_LAYERS`): one fused kernel per function and pass
instead of one per op, the checkpoint around them unchanged (the same tensors saved).
"""
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from torch.utils.checkpoint import checkpoint

from swift_megatron.model.compiled import LAYERS_ENV, Compiled


def recomputed(fn, *inputs: torch.Tensor) -> torch.Tensor:
    """fn(*inputs), saving only `inputs` for the backward (which reruns fn) when a gradient
    will be taken; a plain call otherwise (no grad mode, or nothing requires grad)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return fn(*inputs)
    return checkpoint(fn, *inputs, use_reentrant=True, preserve_rng_state=False)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) computed in float32 and cast back before the weight (Hugging Face's
    Qwen2 / Llama order)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * (1 + weight) in float32, cast back (Qwen3.5's norm, weight stored around 0)."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


def swiglu(fc1_output: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fc1 output's two halves: megatron's glu without its
    `glu_linear_offset` add (0.0 here, which only copied `up`)."""
    gate, up = torch.chunk(fc1_output, 2, dim=-1)
    return F.silu(gate) * up


MATH = Compiled("RMSNorm and SwiGLU kernels", LAYERS_ENV,
                dict(rms_norm=1, zero_centered_rms_norm=1, swiglu=1), rms_norm=rms_norm,
                zero_centered_rms_norm=zero_centered_rms_norm, swiglu=swiglu)


def fused_swiglu(fc1_output: torch.Tensor) -> torch.Tensor:
    """`swiglu`, compiled where MATH is active."""
    flat = fc1_output.reshape(-1, fc1_output.shape[-1])
    return MATH.run("swiglu", flat.device, flat).view(*fc1_output.shape[:-1], -1)


class SwiGLUMLP(MLP):
    """megatron's dense MLP with the SwiGLU recomputed in the backward (module docstring).
    Configurations outside ours (fc1 bias, fused or TE activations, clamping, a linear offset,
    per-token scales) take megatron's own forward. Built from the class alone (model/spec.py):
    parallel linears, the config's ffn_hidden_size and megatron's TP group by default (what
    TransformerLayer passes megatron's MLP)."""

    def __init__(self, config, submodules: MLPSubmodules = None, **kwargs):
        kwargs.setdefault("ffn_hidden_size", config.ffn_hidden_size)
        kwargs.setdefault("tp_group", parallel_state.get_tensor_model_parallel_group())
        super().__init__(config, submodules or MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear), **kwargs)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        config = self.config
        if (per_token_scale is not None or not config.gated_linear_unit
                or self.activation_func is not F.silu or config.add_bias_linear
                or config.bias_activation_fusion or config.use_te_activation_func
                or config.activation_func_clamp_value is not None or config.glu_linear_offset):
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, _ = self.linear_fc1(hidden_states)
        return self.linear_fc2(recomputed(fused_swiglu, intermediate))
