"""Context parallelism (CP): which positions of a micro-batch each CP rank holds, and gathering a
per-position tensor of the CP group back into sequence order.

megatron-core's load-balanced ("zigzag") layout: a sequence of length L (a multiple of 2 x CP) is
cut into 2 x CP chunks of L / (2 x CP) positions and CP rank r holds chunks r and 2 x CP - 1 - r,
so every rank gets the same share of the causal attention work. Padded micro-batches split the
row that way (what `get_batch_on_this_cp_rank` does); packed (THD) ones split each sequence that
way and keep the sequences back to back (what TE's `thd_get_partitioned_indices` does), which is
the layout megatron's RoPE (`get_pos_emb_on_this_cp_rank`, `_apply_rotary_pos_emb_thd`) expects.

`CPShare` describes that layout for one micro-batch; `gather` is autograd-aware in two flavours:
- `reduce_grads=True` (the attention's keys and values): every rank's queries read every rank's
  keys, so a key's gradient is the sum of all ranks' contributions (a reduce-scatter);
- `reduce_grads=False` (the per-token logprobs): every rank computes the same loss from the
  gathered values, so each rank passes back its own positions' gradient only.
"""
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu


def zigzag_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """The positions of a sequence of `length` (a multiple of 2 x cp) that CP rank `rank` holds."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions does not split into 2 x CP = "
                         f"{2 * cp} chunks")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def padding_multiples(tp_multiple: int, cp: int):
    """(row multiple, sequence multiple) of a micro-batch: every packed sequence splits into
    2 x CP chunks, and a padded row or the packed row splits into those chunks and each rank's
    share into `tp_multiple` sequence-parallel shards."""
    sequence = 2 * cp if cp > 1 else 1
    return sequence * tp_multiple, sequence


class CPShare:
    """The zigzag layout of one micro-batch over the CP group. `cu_seqlens`: [0, length] for a
    padded row, else the packed sequences' boundaries (each length divisible by 2 x CP); the
    position indices live on `device`."""

    def __init__(self, cu_seqlens: Sequence[int], device=None):
        self.group = mpu.get_context_parallel_group()
        self.cp, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.cu_seqlens = [int(x) for x in cu_seqlens]
        self._positions = [self._of_rank(r).to(device) for r in range(self.cp)]

    @classmethod
    def of(cls, micro_batch: dict) -> Optional["CPShare"]:
        """The layout of a micro-batch (module docstring), None without context parallelism."""
        if mpu.get_context_parallel_world_size() == 1:
            return None
        device = micro_batch["tokens"].device
        if "cu_seqlens" in micro_batch:
            return cls(micro_batch["cu_seqlens"].tolist(), device)
        return cls([0, micro_batch["tokens"].shape[1]], device)

    def _of_rank(self, rank: int) -> torch.Tensor:
        return torch.cat([start + zigzag_positions(end - start, self.cp, rank)
                          for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])])

    @property
    def positions(self) -> torch.Tensor:
        """This rank's positions, in the order it holds them."""
        return self._positions[self.rank]

    def local_segments(self) -> List[int]:
        """This rank's number of positions of each sequence."""
        return [(end - start) // self.cp
                for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])]

    def local(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's share of a full-length tensor along `dim`."""
        return tensor.index_select(dim, self.positions.to(tensor.device))

    def gather(self, local: torch.Tensor, dim: int, reduce_grads: bool) -> torch.Tensor:
        """Every rank's share along `dim` -> the full-length tensor in sequence order."""
        return _Gather.apply(local, dim, self, reduce_grads)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, dim: int, share: CPShare, reduce_grads: bool):
        parts = [torch.empty_like(local) for _ in range(share.cp)]
        dist.all_gather(parts, local.contiguous(), group=share.group)
        shape = list(local.shape)
        shape[dim] = share.cu_seqlens[-1]
        full = local.new_empty(shape)
        for rank, part in enumerate(parts):
            full.index_copy_(dim, share._positions[rank].to(local.device), part)
        ctx.dim, ctx.share, ctx.reduce_grads = dim, share, reduce_grads
        return full

    @staticmethod
    def backward(ctx, grad):
        share, dim = ctx.share, ctx.dim
        if ctx.reduce_grads:
            grad = grad.contiguous()
            if dist.get_backend(share.group) == "gloo":  # gloo has no reduce-scatter
                dist.all_reduce(grad, group=share.group)
            else:
                mine = torch.empty_like(share.local(grad, dim))
                parts = [grad.index_select(dim, p.to(grad.device)).contiguous()
                         for p in share._positions]
                dist.reduce_scatter(mine, parts, group=share.group)
                return mine, None, None, None
        return share.local(grad, dim), None, None, None
