"""Routed experts as one grouped GEMM per projection (`--moe_grouped_gemm true`, the default).

`GroupedExperts` is megatron-core's GroupedMLP (its weights, their expert-TP split, its
sharded state dict, which stores the same keys as SequentialMLP's) with torch's grouped matrix
multiply, `torch._grouped_mm`, in place of the `grouped_gemm` CUDA extension GroupedMLP asks for
(not installable here, like Transformer Engine's TEGroupedMLP). The local experts' tokens,
sorted by expert, go through two grouped GEMMs and one SwiGLU node; the group offsets are the
cumulative token counts on the device, so the host never reads them (no synchronisation).

    weight1 [hidden, E x 2 ffn]  held as [E, hidden, 2 ffn]: expert e's fc1 is weight1[e]
                                 (its columns [gate; up] of this expert-TP rank, as a
                                 SequentialMLP expert's linear_fc1.weight rows)
    weight2 [E x ffn, hidden]    held as [E, ffn, hidden]

torch's kernel: bfloat16 on Hopper (CUTLASS) and a loop inside torch elsewhere (CPU: every
floating dtype); it needs rows whose byte strides are multiples of 16 (hidden and ffn multiples
of 8 in bfloat16) and contiguous gradients (`GroupedMM` makes them so). The group sizes need no
padding: the forward and the input gradient take 2-D tokens against 3-D weights, and the weight
gradient takes the tokens transposed (column-major) against row-major gradients, the layouts
whose offsets torch checks for no alignment (aten/src/ATen/native/cuda/GroupMMCommon.cuh).
Where the kernel does not run (`grouped_mm_runs`), the same weights go through one matmul per
expert.

`expert_weights` gives the bridge every local expert's fc1 / fc2 weight as a view under
SequentialMLP's name (`local_experts.<e>.linear_fc1.weight`), so Hugging Face per-expert tensors
load into and export from the grouped weights unchanged. LoRA adapts SequentialMLP's linears:
`to_sequential` turns grouped experts back into one MLP per expert with the same weights.
"""
import contextlib
import functools
from types import SimpleNamespace
from typing import List, Tuple

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.moe import grouped_gemm_util
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP

from swift_megatron.model.activations import swiglu, swiglu_grad, wide
from swift_megatron.model.compiled import LAYERS_ENV, Compiled

FC1, FC2 = "linear_fc1", "linear_fc2"


@functools.lru_cache(maxsize=None)
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs on this device type and dtype (tried once, on tiny
    tensors)."""
    try:
        x = torch.ones(2, 8, dtype=dtype, device=device_type)
        offs = torch.tensor([1, 2], dtype=torch.int32, device=device_type)
        torch._grouped_mm(x, torch.ones(2, 8, 8, dtype=dtype, device=device_type), offs=offs)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


class GroupedMM(torch.autograd.Function):
    """x [tokens, in] sorted by group times w [groups, in, out]: group g's rows (offsets
    `offs`, int32 cumulative counts ending at `tokens`) times w[g]."""

    @staticmethod
    def forward(ctx, x, w, offs):
        x = x.contiguous()      # (a compiled kernel's output may come with other strides)
        ctx.save_for_backward(x, w, offs)
        return torch._grouped_mm(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        grad = grad.contiguous()
        dx = torch._grouped_mm(grad, w.transpose(1, 2), offs=offs) \
            if ctx.needs_input_grad[0] else None
        dw = torch._grouped_mm(x.t(), grad, offs=offs) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def per_expert_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """GroupedMM's product one expert at a time (where torch's kernel does not run)."""
    parts = torch.split(x, counts.tolist())
    return torch.cat([part @ w[e] for e, part in enumerate(parts)])


def weighted_swiglu(fc1_output: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each routed token's fc1 output times its router probability, in the fc1
    output's dtype (megatron's GroupedMLP `activation_func_with_probs`)."""
    return (swiglu(fc1_output) * probs.unsqueeze(-1)).to(fc1_output.dtype)


def weighted_swiglu_grad(grad: torch.Tensor, fc1_output: torch.Tensor, probs: torch.Tensor):
    """d/d(fc1 output) and d/d(probs) of `weighted_swiglu`."""
    dprobs = (wide(grad) * wide(swiglu(fc1_output))).sum(-1).to(probs.dtype)
    return swiglu_grad(wide(grad) * wide(probs).unsqueeze(-1), fc1_output), dprobs


MATH = Compiled("grouped experts' SwiGLU", LAYERS_ENV,
                dict(weighted_swiglu=2, weighted_swiglu_grad=3),
                weighted_swiglu=weighted_swiglu, weighted_swiglu_grad=weighted_swiglu_grad)


class WeightedSwiGLUFn(torch.autograd.Function):
    """MATH's weighted_swiglu as one node keeping the fc1 output and the probabilities."""

    @staticmethod
    def forward(ctx, fc1_output, probs):
        ctx.save_for_backward(fc1_output, probs)
        return MATH.run("weighted_swiglu", fc1_output.device, fc1_output, probs)

    @staticmethod
    def backward(ctx, grad):
        fc1_output, probs = ctx.saved_tensors
        return MATH.run("weighted_swiglu_grad", grad.device, grad, fc1_output, probs)


@contextlib.contextmanager
def _without_extension_check():
    """GroupedMLP.__init__ asserts that the grouped_gemm extension imports; ours does not use
    it."""
    check = grouped_gemm_util.assert_grouped_gemm_is_available
    grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    try:
        yield
    finally:
        grouped_gemm_util.assert_grouped_gemm_is_available = check


class GroupedExperts(GroupedMLP):
    """megatron-core's GroupedMLP computing with torch._grouped_mm (module docstring)."""

    def __init__(self, num_local_experts: int, config, pg_collection=None):
        if not config.gated_linear_unit:
            raise ValueError("grouped experts compute SwiGLU experts only")
        with _without_extension_check():
            super().__init__(num_local_experts, config, pg_collection)
        self.grouped_kernel = True   # where torch's kernel runs (False: one matmul per expert)

    def _weights(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """weight1 as [E, hidden, 2 ffn] and weight2 as [E, ffn, hidden] (views)."""
        experts, hidden = self.num_local_experts, self.config.hidden_size
        return self.weight1.view(experts, hidden, -1), self.weight2.view(experts, -1, hidden)

    def _mm(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if not (self.grouped_kernel and grouped_mm_runs(x.device.type, x.dtype)):
            return per_expert_mm(x, w, counts)
        return GroupedMM.apply(x, w, counts.cumsum(0).to(torch.int32))

    def forward(self, permuted_local_hidden_states: torch.Tensor,
                tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor):
        """The local experts on their tokens (sorted by expert, `tokens_per_expert` each; a
        count tensor on the host, as megatron's dispatcher may give, is copied over)."""
        x = permuted_local_hidden_states
        counts = tokens_per_expert.to(x.device, non_blocking=True)
        w1, w2 = self._weights()
        fc1_output = self._mm(x, w1, counts)
        if self.activation_recompute:   # --recompute_modules moe_act
            self.activation_checkpoint = tensor_parallel.CheckpointWithoutOutput()
            hidden = self.activation_checkpoint.checkpoint(WeightedSwiGLUFn.apply, fc1_output,
                                                           permuted_probs)
            output = self._mm(hidden, w2, counts)
            self.activation_checkpoint.discard_output_and_register_recompute(output)
            return output, None
        return self._mm(WeightedSwiGLUFn.apply(fc1_output, permuted_probs), w2, counts), None

    def expert_weights(self, parameter: str) -> List[Tuple[str, torch.Tensor]]:
        """(SequentialMLP's name, view) of every local expert's slice of `parameter`
        ("weight1" or "weight2"): fc1 [2 ffn, hidden] and fc2 [hidden, ffn] per expert, the
        layouts of SequentialMLP's linear weights on this expert-TP rank."""
        w1, w2 = self._weights()
        linear, weight = (FC1, w1) if parameter == "weight1" else (FC2, w2)
        return [(f"local_experts.{e}.{linear}.weight", weight[e].t())
                for e in range(self.num_local_experts)]


@torch.no_grad()
def to_sequential(grouped: GroupedExperts) -> SequentialMLP:
    """A SequentialMLP with the grouped experts' weights (every expert's linears, as LoRA
    adapts them), on the same device and process groups."""
    groups = SimpleNamespace(ep=grouped.ep_group, expt_tp=grouped.tp_group,
                             expt_dp=grouped.dp_group)
    sequential = SequentialMLP(grouped.num_local_experts, grouped.config,
                               MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                             linear_fc2=RowParallelLinear), groups)
    sequential.to(grouped.weight1.device)
    for parameter in ("weight1", "weight2"):
        for name, weight in grouped.expert_weights(parameter):
            sequential.get_parameter(name).copy_(weight)
    return sequential
