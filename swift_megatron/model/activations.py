"""Leaner saved activations and fewer kernels: RMSNorm and SwiGLU as autograd nodes that keep
their inputs alone and whose backward recomputes what it needs from them (written out, as
`*_grad` functions), instead of autograd graphs of several ops that keep large intermediates.

Measured per token and decoder layer of a Qwen2.5-1.5B shape in bfloat16 (docs/gpu.md,
"Activation memory per token"; tests/unit/test_activation_memory.py):
- RMSNorm in float32 (`F.rms_norm(x.float())`, cast back, times the weight) kept a float32
  copy of its input and the cast-back normalised tensor (4.5 values of 2 bytes per hidden
  feature); `RMSNormFn` keeps its bfloat16 input (1 value).
- megatron-core's unfused SwiGLU (`MLP.forward`'s `glu`: silu(gate) * (up + 0.0)) kept the fc1
  output, silu(gate) and the (up + 0.0) copy; `SwiGLUFn` keeps the fc1 output alone
  (3 * ffn values -> 2 * ffn). megatron's fused `bias_swiglu_impl` would keep only the fc1
  output too, but its jit fuser is torch.compile.
The forward math is the plain ops' (same values); the gradients are the same formulas computed
in float32 and rounded once, so bfloat16 gradients may differ from autograd's in the last bit.

The forward and backward functions (and packed RoPE's, model/rope.py) run compiled on CUDA
(model/compiled.py, `SWIFT_MEGATRON_COMPILE_LAYERS`): one fused kernel per function instead of
one per op. A node with compiled functions costs the host two compiled calls, where a
checkpointed graph of plain ops cost a dozen ops and a checkpoint (on the CPU, with tiny tensors:
a norm's forward and backward 429 against 754 us, SwiGLU's 413 against 418).
"""
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules

from swift_megatron.model.compiled import LAYERS_ENV, Compiled


def wide(t: torch.Tensor) -> torch.Tensor:
    """t in float32 at least (float64 stays: the gradient tests run in it)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _input_grad(dnormed: torch.Tensor, normed: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """d/dx of normed = x * rstd(x), given the gradient of normed (both norms share it)."""
    return rstd * (dnormed - normed * (dnormed * normed).mean(-1, keepdim=True))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * RMSNorm(x) computed in float32 and cast back before the weight (Hugging Face's
    Qwen2 / Llama order)."""
    return weight * F.rms_norm(wide(x), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm_grad(grad, x, weight, eps: float, weight_grad: bool):
    """d/dx and (with `weight_grad`, else None) d/dweight of `rms_norm`, x [tokens, features]."""
    xf = wide(x)
    rstd = _rstd(xf, eps)
    normed = xf * rstd
    dnormed = wide(grad * weight)
    dx = _input_grad(dnormed, normed, rstd)
    if not weight_grad:
        return dx.to(x.dtype), None
    return dx.to(x.dtype), (wide(grad) * wide(normed.to(x.dtype))).sum(0).to(weight.dtype)


def zero_centered_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * (1 + weight) in float32, cast back (Qwen3.5's norm, weight stored around 0)."""
    return (F.rms_norm(wide(x), (x.shape[-1],), eps=eps) * (1.0 + wide(weight))).to(x.dtype)


def zero_centered_rms_norm_grad(grad, x, weight, eps: float, weight_grad: bool):
    """d/dx and (with `weight_grad`, else None) d/dweight of `zero_centered_rms_norm`."""
    xf, gf = wide(x), wide(grad)
    rstd = _rstd(xf, eps)
    normed = xf * rstd
    dnormed = gf * (1.0 + wide(weight))
    dx = _input_grad(dnormed, normed, rstd)
    return dx.to(x.dtype), (gf * normed).sum(0).to(weight.dtype) if weight_grad else None


def swiglu(fc1_output: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fc1 output's two halves: megatron's glu without its
    `glu_linear_offset` add (0.0 here, which only copied `up`)."""
    gate, up = torch.chunk(fc1_output, 2, dim=-1)
    return F.silu(gate) * up


def swiglu_grad(grad, fc1_output):
    """d/d(fc1 output) of `swiglu`: [gate, up] halves as in the fc1 output."""
    gate, up = (wide(t) for t in torch.chunk(fc1_output, 2, dim=-1))
    gf, sig = wide(grad), torch.sigmoid(gate)
    dgate = gf * up * sig * (1.0 + gate * (1.0 - sig))
    return torch.cat((dgate, gf * gate * sig), dim=-1).to(fc1_output.dtype)


MATH = Compiled("RMSNorm and SwiGLU kernels", LAYERS_ENV,
                dict(rms_norm=1, rms_norm_grad=2, zero_centered_rms_norm=1,
                     zero_centered_rms_norm_grad=2, swiglu=1, swiglu_grad=2),
                rms_norm=rms_norm, rms_norm_grad=rms_norm_grad,
                zero_centered_rms_norm=zero_centered_rms_norm,
                zero_centered_rms_norm_grad=zero_centered_rms_norm_grad,
                swiglu=swiglu, swiglu_grad=swiglu_grad)


class RMSNormFn(torch.autograd.Function):
    """MATH[kind](x, weight, eps) for x [tokens, features] (kind: rms_norm or
    zero_centered_rms_norm), keeping x and the weight alone."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, kind: str):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.kind = eps, kind
        return MATH.run(kind, x.device, x, weight, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        dx, dweight = MATH.run(ctx.kind + "_grad", grad.device, grad, x, weight, ctx.eps,
                               ctx.needs_input_grad[1])   # no weight gradient for LoRA
        return dx, dweight, None, None


class SwiGLUFn(torch.autograd.Function):
    """MATH's swiglu of the fc1 output [tokens, 2 * ffn], keeping the fc1 output alone."""

    @staticmethod
    def forward(ctx, fc1_output):
        ctx.save_for_backward(fc1_output)
        return MATH.run("swiglu", fc1_output.device, fc1_output)

    @staticmethod
    def backward(ctx, grad):
        fc1_output, = ctx.saved_tensors
        return MATH.run("swiglu_grad", grad.device, grad, fc1_output)


def tokens_first(fn, x: torch.Tensor, *args) -> torch.Tensor:
    """fn(x as [tokens, features], *args) reshaped back: one layout for the kernels."""
    return fn(x.reshape(-1, x.shape[-1]), *args).view(*x.shape[:-1], -1)


class SwiGLUMLP(MLP):
    """megatron's dense MLP with `SwiGLUFn` (module docstring).
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
        return self.linear_fc2(tokens_first(SwiGLUFn.apply, intermediate))
