"""Log-probabilities and entropy from vocab-parallel logits (each TP rank holds V/TP columns).

Both are autograd functions whose backward is written out, so the TP all-reduces never sit on
the gradient path (a log-softmax through a plain all_reduce gets TP > 1 gradients wrong):
- `vocab_parallel_logprobs`: megatron's vocab-parallel cross entropy, negated;
- `vocab_parallel_entropy`: H = logsumexp(l) - E_p[l], dH/dl = -p (l - E_p[l]).
Logits are scaled by 1/temperature (the logprobs vLLM reports are of the processed, scaled
distribution) and the columns past the real vocab (padding for TP) are masked out.
"""
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel

_MASKED = -1e30  # finite, so 0 * _MASKED stays 0 (no NaN) in the entropy terms


def _scaled(logits: torch.Tensor, temperature: float, vocab_size: Optional[int]) -> torch.Tensor:
    """A fresh float32 copy of logits / temperature with padded vocab columns masked."""
    scaled = logits.float() / temperature
    if vocab_size is not None:
        local = scaled.shape[-1]
        start = mpu.get_tensor_model_parallel_rank() * local
        if start + local > vocab_size:
            scaled[..., max(vocab_size - start, 0):] = _MASKED
    return scaled


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                            vocab_size: Optional[int] = None) -> torch.Tensor:
    """log p(targets) under softmax(logits / temperature): logits [..., V/TP], targets [...]."""
    return -tensor_parallel.vocab_parallel_cross_entropy(_scaled(logits, temperature, vocab_size),
                                                         targets)


class _VocabParallelEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        group = mpu.get_tensor_model_parallel_group()
        top = logits.max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(logits - top.unsqueeze(-1))
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        probs = exp / total.unsqueeze(-1)
        mean_logit = (probs * logits).sum(dim=-1)
        dist.all_reduce(mean_logit, group=group)
        ctx.save_for_backward(probs, logits, mean_logit)
        return top + torch.log(total) - mean_logit

    @staticmethod
    def backward(ctx, grad_entropy: torch.Tensor):
        probs, logits, mean_logit = ctx.saved_tensors
        centred = torch.where(probs > 0, logits - mean_logit.unsqueeze(-1), 0.0)
        return -probs * centred * grad_entropy.unsqueeze(-1)


def vocab_parallel_entropy(logits: torch.Tensor, temperature: float = 1.0,
                           vocab_size: Optional[int] = None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: logits [..., V/TP] -> [...]."""
    return _VocabParallelEntropy.apply(_scaled(logits, temperature, vocab_size))
