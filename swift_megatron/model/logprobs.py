"""Log-probabilities (and, from the same pass, entropy) of the output layer applied to the
final hidden states, vocab-parallel (each TP rank holds V/TP rows of the output weight), without
ever materialising the [tokens, vocab] logits: `head_logprobs` computes the logits of one chunk
at a time and keeps none of them.

The forward goes over chunks of tokens: a chunk's logits (hidden @ W^T, in the model's dtype)
are reduced to per-token numbers and dropped. The backward recomputes the logits, by blocks of
vocabulary rows for all tokens at once, so a block's weight gradient is one product over every
token, rounded once (megatron's output layer computes it the same way); the hidden states'
gradient adds up over blocks in float32. Under megatron's DDP the weight gradient goes straight
into the parameter's float32 `main_grad` (not with --overlap_grad_reduce, whose backward hook
must see it: `grad_to_ddp_hook`). The saved tensors are the hidden states, the
per-token log-sum-exp and the targets, so a micro-batch's head costs about 2 x hidden bytes
per token of activation memory, not 2 x 2 x vocab (the logits and their gradient).

The autograd function's backward is written out, so the TP all-reduces never sit on the
gradient path (a log-softmax through a plain all_reduce gets TP > 1 gradients wrong):
log p(t) = l_t - logsumexp(l), d/dl = onehot(t) - p. With `with_entropy` it also returns
H = logsumexp(l) - E_p[l] (no gradient: a metric and the entropy mask's input).

The math on one chunk is three pure functions (`_chunk_stats`, `_logprob_grad` and the
scaling they share). On CUDA they run compiled by torch.compile (model/compiled.py): Inductor
fuses each into one pass that reads the bf16 logits and writes only per-token numbers (or the
bf16 gradient), where eager PyTorch writes and reads a float32 copy of the chunk for every
elementwise step. Elsewhere
they run eagerly, a chunk's float32 working set about `CHUNK_BYTES`.
Each TP rank reduces its own columns to a log-sum-exp (and an entropy term); the ranks combine
those per-token numbers once, after all chunks.
Logits are scaled by 1/temperature (the logprobs vLLM reports are of the processed, scaled
distribution) and the columns past the real vocab (padding for TP) are masked out.
"""
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from swift_megatron.model.compiled import Compiled

_MASKED = -1e30  # finite, so 0 * _MASKED stays 0 (no NaN) in the entropy terms
CHUNK_BYTES = 256 << 20  # float32 bytes of one chunk of scaled logits
# vocabulary columns per backward block: a multiple of this, so the [tokens, block] logits and
# gradient keep 16-byte-aligned rows (at 8,190 columns the block's three GEMMs ran on cuBLAS's
# slow unaligned path: 47 ms more per 8k-token micro-batch on an H200)
_ALIGN = 128


def chunk_tokens(local_vocab: int, override: Optional[int] = None) -> int:
    """Tokens per chunk: `override`, else as many as fit CHUNK_BYTES of float32 logits."""
    return override or max(1, CHUNK_BYTES // (4 * local_vocab))


def _scaled(logits: torch.Tensor, temperature: float, real: int) -> torch.Tensor:
    """logits / temperature in float32, the columns from `real` on masked."""
    scaled = logits.float() / temperature
    column = torch.arange(scaled.shape[-1], device=scaled.device)
    return torch.where(column < real, scaled, _MASKED)


def _chunk_stats(logits, column, mine, temperature: float, real: int, entropy: bool):
    """Per token of this shard: log-sum-exp, the target's scaled logit (0 where the target is in
    another shard) and, with `entropy`, E_p[l] under this shard's own softmax."""
    scaled = _scaled(logits, temperature, real)
    lse = torch.logsumexp(scaled, dim=-1)
    picked = torch.where(mine, scaled.gather(-1, column.unsqueeze(-1)).squeeze(-1), 0.0)
    if not entropy:
        return lse, picked, None
    return lse, picked, (torch.exp(scaled - lse.unsqueeze(-1)) * scaled).sum(dim=-1)


def _logprob_grad(logits, column, mine, lse, grad, temperature: float, real: int):
    """d(grad . log p(target)) / d logits = grad (onehot(target) - p) / temperature, in the
    logits' dtype."""
    probs = torch.exp(_scaled(logits, temperature, real) - lse.unsqueeze(-1))
    onehot = (torch.arange(logits.shape[-1], device=logits.device) == column.unsqueeze(-1)) \
        & mine.unsqueeze(-1)
    return ((onehot.float() - probs) * (grad / temperature).unsqueeze(-1)).to(logits.dtype)


# compiled on CUDA (model/compiled.py); SWIFT_MEGATRON_COMPILE_LOGPROBS=0 keeps them eager
KERNELS = Compiled("logprob kernels", "SWIFT_MEGATRON_COMPILE_LOGPROBS",
                   chunk_stats=_chunk_stats, logprob_grad=_logprob_grad)


class _Shard:
    """This TP rank's slice of the vocabulary and how to scale and mask its logits."""

    def __init__(self, local_vocab: int, temperature: float, vocab_size: Optional[int]):
        self.group = mpu.get_tensor_model_parallel_group()
        self.size = mpu.get_tensor_model_parallel_world_size()
        self.start = mpu.get_tensor_model_parallel_rank() * local_vocab
        self.width = local_vocab
        self.real = local_vocab if vocab_size is None else min(max(vocab_size - self.start, 0),
                                                               local_vocab)
        self.temperature = temperature

    def columns(self, targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """(each target's local column, clamped into the shard; whether it is in this shard)."""
        column, mine, _ = self.block(targets, 0, self.width)
        return column, mine

    def block(self, targets: torch.Tensor, start: int, stop: int):
        """Of the shard's columns start..stop: each target's column in the block (clamped),
        whether it is in the block, and how many of the block's columns are real."""
        local = targets - self.start - start
        width = stop - start
        return (local.clamp(0, width - 1), (local >= 0) & (local < width),
                min(max(self.real - start, 0), width))

    def combine(self, lse, picked, mean):
        """The shards' per-token numbers -> the full vocabulary's (lse, target logit, E_p[l])."""
        if self.size == 1:
            return lse, picked, mean
        top = lse.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        weight = torch.exp(lse - top)   # this shard's share of the probability mass, x total
        total = weight.clone()
        dist.all_reduce(total, group=self.group)
        dist.all_reduce(picked, group=self.group)
        if mean is not None:
            mean = weight / total * mean
            dist.all_reduce(mean, group=self.group)
        return top + torch.log(total), picked, mean


def _chunks(total: int, size: int):
    return [(i, min(i + size, total)) for i in range(0, total, size)]


class _HeadLogprobs(torch.autograd.Function):
    """log p(targets) (and the entropy) of hidden states [T, h] under this TP rank's output
    weight [V/TP, h], chunk by chunk (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, shard: _Shard, chunk: int, entropy: bool):
        column, mine = shard.columns(targets)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        picked, mean = torch.empty_like(lse), torch.empty_like(lse) if entropy else None
        for a, b in _chunks(hidden.shape[0], chunk):
            stats = KERNELS.run("chunk_stats", hidden.device, torch.mm(hidden[a:b], weight.t()),
                                column[a:b], mine[a:b], shard.temperature, shard.real, entropy)
            lse[a:b], picked[a:b] = stats[0], stats[1]
            if entropy:
                mean[a:b] = stats[2]
        lse, picked, mean = shard.combine(lse, picked, mean)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.shard, ctx.chunk = shard, chunk
        if not entropy:
            return picked - lse
        entropy = lse - mean
        ctx.mark_non_differentiable(entropy)
        return picked - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, *_):
        hidden, weight, targets, lse = ctx.saved_tensors
        shard, flat_grad = ctx.shard, grad_logprobs.float()
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device) \
            if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1] and (not hasattr(weight, "main_grad")
                                        or getattr(weight, "grad_to_ddp_hook", False)):
            grad_weight = torch.empty_like(weight)
        # by blocks of vocabulary rows, each of all tokens: a block's weight gradient is one
        # product over every token, rounded once, as megatron's output layer computes it
        columns = max(1, ctx.chunk * shard.width // max(hidden.shape[0], 1))
        if columns > _ALIGN:   # a multiple of 128: a block's rows stay aligned for the GEMMs
            columns -= columns % _ALIGN
        for a, b in _chunks(shard.width, columns):
            rows = weight[a:b]
            column, mine, real = shard.block(targets, a, b)
            grad = KERNELS.run("logprob_grad", hidden.device, torch.mm(hidden, rows.t()), column,
                               mine, lse, flat_grad, shard.temperature, real)
            if grad_hidden is not None:
                grad_hidden.add_(torch.mm(grad, rows))
            if ctx.needs_input_grad[1]:
                block = torch.mm(grad.t(), hidden)
                if grad_weight is None:   # megatron DDP: DDP's hook would only add it there
                    weight.main_grad[a:b].add_(block)
                else:
                    grad_weight[a:b] = block
        if grad_hidden is not None:
            grad_hidden = grad_hidden.to(hidden.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                  temperature: float = 1.0, vocab_size: Optional[int] = None,
                  chunk: Optional[int] = None, with_entropy: bool = False
                  ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """log p(targets) under softmax(hidden W^T / temperature), float32 [T]: hidden [T, h] (the
    same on every TP rank; the caller sums its gradient over TP, model/head.py), W this rank's
    vocabulary rows [V/TP, h], targets [T]. `with_entropy`: (logprobs, entropy per token), the
    entropy without gradient. `chunk`: tokens per chunk (default: CHUNK_BYTES worth)."""
    shard = _Shard(weight.shape[0], temperature, vocab_size)
    return _HeadLogprobs.apply(hidden, weight, targets, shard,
                               chunk_tokens(weight.shape[0], chunk), with_entropy)
