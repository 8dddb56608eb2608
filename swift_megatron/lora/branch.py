"""The adapter branch of a LoRA linear as one autograd node, for linears that communicate nothing
(tensor-parallel group of one).

    output += scale * (x A^T) P^T,   A = [A_1; ...; A_k]  [k r, in],
    P [rows, k r]: projection i's B_i at its rows of the fused output, in columns i r .. (i+1) r.

The GPU work of the branch is six small matrix products, but written as separate torch ops
(concatenation, block placement of the B's, dropout, views, transposes, one autograd node each)
it cost 168 profiled operators per adapted linear and micro-batch more than a full-parameter
linear; as one node 109 (benchmarks/lora_step.py on the CPU). A LoRA step at one GPU is bound by
those host costs, not by the GPU (docs/gpu.md). Here the forward is a concatenation, a placement,
two products (the second adding into the output), the backward four products (the scale folded
in) and a gather.

Under megatron's DDP (training/optim.py wraps it with overlap_grad_reduce off) every adapter
parameter has a `main_grad` buffer, and DDP's hook would only add the returned gradient into it:
the backward adds it there itself and returns none, so the 2 or 3 adapter matrices of a fused
linear skip autograd's gradient accumulation and DDP's Python hook at every micro-batch (the same
additions, fewer host operations). Outside DDP (no `main_grad`) the gradients are returned.
"""
from typing import Optional, Sequence

import torch


class AdapterLayout:
    """Where the B rows of a fused linear's adapters go: `rows` output columns; the
    concatenated B's row j goes to output row `positions[j]`, column block `blocks[j]`
    (None: one adapter covering every output row in order)."""

    def __init__(self, rows: int, positions: Optional[torch.Tensor],
                 blocks: Optional[torch.Tensor]):
        self.rows, self.positions, self.blocks = rows, positions, blocks

    def place(self, bs: Sequence[torch.Tensor], r: int) -> torch.Tensor:
        """P [rows, k r] from B_1..B_k."""
        if self.positions is None:
            return bs[0]
        placed = bs[0].new_zeros(self.rows, len(bs), r)
        placed[self.positions, self.blocks] = torch.cat(list(bs))
        return placed.view(self.rows, len(bs) * r)

    def unplace(self, grad: torch.Tensor, bs: Sequence[torch.Tensor], r: int):
        """The gradients of B_1..B_k from P's."""
        if self.positions is None:
            return (grad,)
        taken = grad.view(self.rows, len(bs), r)[self.positions, self.blocks]
        return taken.split([b.shape[0] for b in bs])


def _scaled_mm(m1: torch.Tensor, m2: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * m1 @ m2 as one product (addmm with beta 0 never reads its input)."""
    return torch.addmm(m1.new_empty(()), m1, m2, beta=0, alpha=scale)


class AdapterBranch(torch.autograd.Function):
    """output + scale * (x A^T) P^T; x: the (dropped-out) input of the linear, `params`: A_1..A_k
    then B_1..B_k. `in_place`: add into `output` (whose value nothing saved for its backward)."""

    @staticmethod
    def forward(ctx, output, x, layout: AdapterLayout, scale: float, in_place: bool, *params):
        k = len(params) // 2
        a = params[0] if k == 1 else torch.cat(params[:k])
        placed = layout.place(params[k:], a.shape[0] // k)
        x2 = x.reshape(-1, x.shape[-1])
        z = torch.mm(x2, a.t())
        out2 = output.view(-1, output.shape[-1])
        if in_place:
            out2.addmm_(z, placed.t(), alpha=scale)
            ctx.mark_dirty(output)
        else:
            output = torch.addmm(out2, z, placed.t(), alpha=scale).view_as(output)
        ctx.save_for_backward(x, a, z, placed, *params[k:])
        ctx.layout, ctx.scale, ctx.k, ctx.params = layout, scale, k, params
        return output

    @staticmethod
    def backward(ctx, grad):
        x, a, z, placed, *bs = ctx.saved_tensors
        k, scale = ctx.k, ctx.scale
        g2 = grad.reshape(-1, grad.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dz = _scaled_mm(g2, placed, scale)
        grad_x = torch.mm(dz, a).view_as(x) if ctx.needs_input_grad[1] else None
        grad_as = torch.mm(dz.t(), x2).split(a.shape[0] // k)
        grad_placed = _scaled_mm(g2.t(), z, scale)
        grad_bs = ctx.layout.unplace(grad_placed, bs, a.shape[0] // k)
        return (grad, grad_x, None, None, None, *_into_main_grads(ctx.params, grad_as + grad_bs))


def _into_main_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple:
    """The gradients to return for `params`: none once added into megatron DDP's `main_grad`
    buffers (module docstring), else the gradients themselves."""
    if not all(hasattr(p, "main_grad") for p in params):
        return tuple(grads)
    for param, grad in zip(params, grads):
        param.main_grad.add_(grad)
    return (None,) * len(params)
