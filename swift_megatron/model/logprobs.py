"""Log-probabilities and entropy from vocab-parallel logits (each TP rank holds V/TP columns),
computed chunk by chunk so that no float32 [tokens, vocab] tensor is ever materialised.

Both are autograd functions whose backward is written out, so the TP all-reduces never sit on
the gradient path (a log-softmax through a plain all_reduce gets TP > 1 gradients wrong):
- `vocab_parallel_logprobs`: log p(target) = l_t - logsumexp(l); d/dl = onehot(t) - p;
- `vocab_parallel_entropy`: H = logsumexp(l) - E_p[l], dH/dl = -p (l - E_p[l]).
The forward keeps only the logits (in their own dtype, which the model output holds anyway) and
one or two float32 numbers per token; the backward recomputes softmax one chunk of tokens at a
time. A chunk's float32 working set is about `CHUNK_BYTES`, whatever the vocabulary.
Logits are scaled by 1/temperature (the logprobs vLLM reports are of the processed, scaled
distribution) and the columns past the real vocab (padding for TP) are masked out.
"""
from typing import Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

_MASKED = -1e30  # finite, so 0 * _MASKED stays 0 (no NaN) in the entropy terms
CHUNK_BYTES = 256 << 20  # float32 bytes of one chunk of scaled logits


def chunk_tokens(local_vocab: int, override: Optional[int] = None) -> int:
    """Tokens per chunk: `override`, else as many as fit CHUNK_BYTES of float32 logits."""
    return override or max(1, CHUNK_BYTES // (4 * local_vocab))


class _Shard:
    """This TP rank's slice of the vocabulary and how to scale and mask its logits."""

    def __init__(self, local_vocab: int, temperature: float, vocab_size: Optional[int]):
        self.group = mpu.get_tensor_model_parallel_group()
        self.start = mpu.get_tensor_model_parallel_rank() * local_vocab
        self.real = local_vocab if vocab_size is None else min(max(vocab_size - self.start, 0),
                                                               local_vocab)
        self.temperature = temperature

    def scaled(self, logits: torch.Tensor) -> torch.Tensor:
        """A fresh float32 copy of a chunk of logits / temperature, padded columns masked."""
        scaled = logits.float() / self.temperature
        scaled[..., self.real:] = _MASKED
        return scaled

    def logsumexp(self, scaled: torch.Tensor) -> torch.Tensor:
        top = scaled.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.group)
        total = torch.exp(scaled - top.unsqueeze(-1)).sum(dim=-1)
        dist.all_reduce(total, group=self.group)
        return top + torch.log(total)

    def target_logit(self, scaled: torch.Tensor, targets: torch.Tensor
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scaled logit of each target, summed over TP, whether the target is in this shard,
        its local column)."""
        local = targets - self.start
        mine = (local >= 0) & (local < scaled.shape[-1])
        column = local.clamp(0, scaled.shape[-1] - 1)
        picked = torch.where(mine, scaled.gather(-1, column.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(picked, group=self.group)
        return picked, mine, column


def _chunks(total: int, size: int):
    return [(i, min(i + size, total)) for i in range(0, total, size)]


class _VocabParallelLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, shard: _Shard, chunk: int):
        flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        logprobs = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        for a, b in _chunks(flat.shape[0], chunk):
            scaled = shard.scaled(flat[a:b])
            lse[a:b] = shard.logsumexp(scaled)
            logprobs[a:b] = shard.target_logit(scaled, flat_targets[a:b])[0] - lse[a:b]
        ctx.save_for_backward(logits, targets, lse)
        ctx.shard, ctx.chunk = shard, chunk
        return logprobs.reshape(targets.shape)

    @staticmethod
    def backward(ctx, grad_logprobs):
        logits, targets, lse = ctx.saved_tensors
        shard, flat = ctx.shard, logits.reshape(-1, logits.shape[-1])
        flat_targets, flat_grad = targets.reshape(-1), grad_logprobs.reshape(-1).float()
        grad = torch.empty_like(flat)
        for a, b in _chunks(flat.shape[0], ctx.chunk):
            scaled = shard.scaled(flat[a:b])
            chunk_grad = -torch.exp(scaled - lse[a:b].unsqueeze(-1)) * flat_grad[a:b].unsqueeze(-1)
            local = flat_targets[a:b] - shard.start
            mine = (local >= 0) & (local < flat.shape[-1])
            # + g at each target column of this shard (no host sync: a masked scatter-add)
            chunk_grad.scatter_add_(-1, local.clamp(0, flat.shape[-1] - 1).unsqueeze(-1),
                                    torch.where(mine, flat_grad[a:b], 0.0).unsqueeze(-1))
            grad[a:b] = (chunk_grad / shard.temperature).to(grad.dtype)
        return grad.reshape(logits.shape), None, None, None


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, shard: _Shard, chunk: int):
        flat = logits.reshape(-1, logits.shape[-1])
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        mean_logit = torch.empty_like(lse)
        for a, b in _chunks(flat.shape[0], chunk):
            scaled = shard.scaled(flat[a:b])
            lse[a:b] = shard.logsumexp(scaled)
            mean = (torch.exp(scaled - lse[a:b].unsqueeze(-1)) * scaled).sum(dim=-1)
            dist.all_reduce(mean, group=shard.group)
            mean_logit[a:b] = mean
        ctx.save_for_backward(logits, lse, mean_logit)
        ctx.shard, ctx.chunk = shard, chunk
        return (lse - mean_logit).reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad_entropy):
        logits, lse, mean_logit = ctx.saved_tensors
        shard, flat = ctx.shard, logits.reshape(-1, logits.shape[-1])
        flat_grad = grad_entropy.reshape(-1).float()
        grad = torch.empty_like(flat)
        for a, b in _chunks(flat.shape[0], ctx.chunk):
            scaled = shard.scaled(flat[a:b])
            probs = torch.exp(scaled - lse[a:b].unsqueeze(-1))
            centred = torch.where(probs > 0, scaled - mean_logit[a:b].unsqueeze(-1), 0.0)
            chunk_grad = -probs * centred * flat_grad[a:b].unsqueeze(-1)
            grad[a:b] = (chunk_grad / shard.temperature).to(grad.dtype)
        return grad.reshape(logits.shape), None, None


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                            vocab_size: Optional[int] = None,
                            chunk: Optional[int] = None) -> torch.Tensor:
    """log p(targets) under softmax(logits / temperature): logits [..., V/TP], targets [...];
    float32. `chunk`: tokens per chunk (default: CHUNK_BYTES worth)."""
    shard = _Shard(logits.shape[-1], temperature, vocab_size)
    return _VocabParallelLogprobs.apply(logits, targets, shard, chunk_tokens(logits.shape[-1], chunk))


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float = 1.0,
                           vocab_size: Optional[int] = None,
                           chunk: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: logits [..., V/TP] -> [...]."""
    shard = _Shard(logits.shape[-1], temperature, vocab_size)
    return _VocabParallelEntropy.apply(logits, shard, chunk_tokens(logits.shape[-1], chunk))
