"""The adapter branch of a LoRA linear as one autograd node, for linears that communicate nothing
(tensor-parallel group of one); with a frozen base weight the base product joins it
(`FrozenLinearWithAdapter`), so the whole LoRA linear is one node.

    output += scale * (x A^T) P^T,   A = [A_1; ...; A_k]  [k r, in],
    P [rows, k r]: projection i's B_i at its rows of the fused output, in columns i r .. (i+1) r.

The GPU work of the branch is six small matrix products, but written as separate torch ops
(concatenation, block placement of the B's, dropout, views, transposes, one autograd node each)
it cost 168 profiled operators per adapted linear and micro-batch more than a full-parameter
linear; as one node 109 (benchmarks/lora_step.py on the CPU). A LoRA step at one GPU is bound by
those host costs, not by the GPU (docs/gpu.md). Here the forward is a concatenation, a placement,
two products (the second adding into the output), the backward four products (the scale folded
in) and a gather. At one rank megatron's frozen linear around it is two more autograd nodes
(`copy_to_tensor_model_parallel_region` or `reduce_from_...`, both identities there, and
`LinearWithFrozenWeight`) and a Python wrapper: `FrozenLinearWithAdapter` does its product
(and bias) itself and adds the base and adapter input gradients with one `addmm_`. With LoRA
dropout it also draws the adapter input's mask itself (torch's `native_dropout`, the kernel
`F.dropout` runs on CUDA, with the same draws), so the dropout is no autograd node of its own
and the two input gradients need no separate accumulation.

Under megatron's DDP every adapter parameter has a `main_grad` buffer, and DDP's hook would only
add the returned gradient into it: the backward adds it there itself and returns none, so the 2
or 3 adapter matrices of a fused linear skip autograd's gradient accumulation and DDP's Python
hook at every micro-batch (the same additions, fewer host operations). Outside DDP (no
`main_grad`), and with --overlap_grad_reduce (DDP's hook must count every gradient to start a
bucket's reduction), the gradients are returned.
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


def _add_adapter(out2: torch.Tensor, x2: torch.Tensor, layout: AdapterLayout, scale: float,
                 in_place: bool, params: Sequence[torch.Tensor]):
    """out2 + scale * (x2 A^T) P^T (into out2 when `in_place`); returns it with A, z = x2 A^T and
    P for the backward."""
    k = len(params) // 2
    a = params[0] if k == 1 else torch.cat(params[:k])
    placed = layout.place(params[k:], a.shape[0] // k)
    z = torch.mm(x2, a.t())
    if in_place:
        out2.addmm_(z, placed.t(), alpha=scale)
    else:
        out2 = torch.addmm(out2, z, placed.t(), alpha=scale)
    return out2, a, z, placed


def _adapter_grads(g2: torch.Tensor, x2: torch.Tensor, a: torch.Tensor, z: torch.Tensor,
                   placed: torch.Tensor, bs: Sequence[torch.Tensor], layout: AdapterLayout,
                   scale: float, params: Sequence[torch.Tensor]):
    """(dL/dz, the gradients to return for `params`) from the output gradient g2 [tokens, rows]."""
    r = a.shape[0] // len(bs)
    dz = _scaled_mm(g2, placed, scale)
    grad_as = torch.mm(dz.t(), x2).split(r)
    grad_bs = layout.unplace(_scaled_mm(g2.t(), z, scale), bs, r)
    return dz, _into_main_grads(params, grad_as + grad_bs)


class AdapterBranch(torch.autograd.Function):
    """output + scale * (x A^T) P^T; x: the (dropped-out) input of the linear, `params`: A_1..A_k
    then B_1..B_k. `in_place`: add into `output` (whose value nothing saved for its backward)."""

    @staticmethod
    def forward(ctx, output, x, layout: AdapterLayout, scale: float, in_place: bool, *params):
        out2, a, z, placed = _add_adapter(output.view(-1, output.shape[-1]),
                                          x.reshape(-1, x.shape[-1]), layout, scale, in_place,
                                          params)
        if in_place:
            ctx.mark_dirty(output)
        else:
            output = out2.view_as(output)
        ctx.save_for_backward(x, a, z, placed, *params[len(params) // 2:])
        ctx.layout, ctx.scale, ctx.params = layout, scale, params
        return output

    @staticmethod
    def backward(ctx, grad):
        x, a, z, placed, *bs = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        dz, param_grads = _adapter_grads(g2, x.reshape(-1, x.shape[-1]), a, z, placed, bs,
                                         ctx.layout, ctx.scale, ctx.params)
        grad_x = torch.mm(dz, a).view_as(x) if ctx.needs_input_grad[1] else None
        return (grad, grad_x, None, None, None, *param_grads)


class FrozenLinearWithAdapter(torch.autograd.Function):
    """x W^T (+ bias) + scale * (x' A^T) P^T for a frozen W (and bias): a whole LoRA linear of a
    tensor-parallel group of one as one autograd node. x' = dropout(x) with probability
    `dropout` (torch's dropout kernel, `native_dropout`, drawn here: no dropout node of its own),
    or x itself at 0; the two input gradients are added into one buffer (by an addmm_ at 0).
    The base product and bias are megatron's `LinearWithFrozenWeight` (a product, then the bias
    added to its rounded output)."""

    @staticmethod
    def forward(ctx, x, dropout: float, weight, bias, layout: AdapterLayout, scale: float,
                *params):
        x2 = x.reshape(-1, x.shape[-1])
        out2 = torch.mm(x2, weight.t())
        if bias is not None:
            out2.add_(bias)
        adapter_in, mask = torch.native_dropout(x2, dropout, True) if dropout else (x2, None)
        out2, a, z, placed = _add_adapter(out2, adapter_in, layout, scale, True, params)
        ctx.save_for_backward(weight, adapter_in, mask, a, z, placed, *params[len(params) // 2:])
        ctx.layout, ctx.scale, ctx.params, ctx.dropout = layout, scale, params, dropout
        return out2.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        weight, adapter_in, mask, a, z, placed, *bs = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        dz, param_grads = _adapter_grads(g2, adapter_in, a, z, placed, bs, ctx.layout, ctx.scale,
                                         ctx.params)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g2, weight)
            if mask is None:
                grad_x.addmm_(dz, a)
            else:
                grad_x.add_(torch.ops.aten.native_dropout_backward(
                    torch.mm(dz, a), mask, 1.0 / (1.0 - ctx.dropout)))
            grad_x = grad_x.view(*grad.shape[:-1], weight.shape[1])
        return (grad_x, None, None, None, None, None, *param_grads)


def _into_main_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple:
    """The gradients to return for `params`: none once added into megatron DDP's `main_grad`
    buffers (module docstring), else the gradients themselves. With --overlap_grad_reduce DDP
    must see them in its hook (`grad_to_ddp_hook`, training/optim.py): returned too."""
    if not all(hasattr(p, "main_grad") and not getattr(p, "grad_to_ddp_hook", False)
               for p in params):
        return tuple(grads)
    for param, grad in zip(params, grads):
        param.main_grad.add_(grad)
    return (None,) * len(params)
