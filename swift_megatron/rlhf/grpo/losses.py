"""The GRPO policy loss per token and its aggregation into one micro-batch's share of the step
loss (pure torch, no process groups).

Shapes: B completions, T completion tokens. `completion_mask` [B, T] is 1 (or True) on tokens
that count; positions outside it may hold anything (even NaN): they are selected away with
torch.where, never multiplied by 0. `advantages` is [B], one value per completion.
"""
from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
ROLLOUT_CORRECTIONS = ("token_truncate", "sequence_truncate")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")


def masked_sum(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of values where mask is set ([B, T] each); over all elements or along dim."""
    selected = torch.where(mask.bool(), values, torch.zeros_like(values))
    return selected.sum() if dim is None else selected.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of values where mask is set; the count is clamped to 1 (an empty mask gives 0)."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1).to(values.dtype)


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 estimator of KL(policy || reference) per token, [B, T] -> [B, T], clamped as verl does:
    the log ratio to [-20, 20] and the estimate to [-10, 10]. Exactly 0 where the two agree."""
    log_ratio = (ref_logprobs - logprobs).clamp(-20, 20)
    kl = torch.exp(log_ratio) - log_ratio - 1
    return kl.clamp(-10, 10)


def log_importance_weights(logprobs: Tensor, old_logprobs: Tensor, completion_mask: Tensor,
                           level: str = "token") -> Tensor:
    """Log importance ratio policy / old policy, [B, T].

    token: per token, logprobs - old_logprobs.
    sequence (GSPO): the mean of that over the valid tokens of each completion, broadcast to
      every position of the row.
    sequence_token (GSPO-token): the sequence value, with the per-token gradient of logprobs
      (logprobs - logprobs.detach() + sequence value.detach()).
    """
    if level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                         f"got {level!r}")
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    seq_value = masked_mean(log_ratio, completion_mask, dim=-1).unsqueeze(-1)  # [B, 1]
    if level == "sequence":
        return seq_value.expand_as(logprobs)
    return logprobs - logprobs.detach() + seq_value.detach()


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                completion_mask: Tensor, *, epsilon_low: float, epsilon_high: float,
                delta: Optional[float] = None, importance_sampling_level: str = "token",
                ref_logprobs: Optional[Tensor] = None,
                beta: float = 0.0) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Clipped surrogate loss per token, [B, T] (unmasked; aggregate with aggregate_loss).

    ratio = exp(log_importance_weights); loss = -min(ratio * A, clip(ratio, 1 - epsilon_low,
    1 + epsilon_high) * A), with ratio first capped at `delta` in the unclipped branch when delta
    is set (two-sided clipping, INTELLECT-2, as TRL). beta > 0 adds beta * kl_k3(logprobs,
    ref_logprobs). Also returns per-token [B, T] indicators (not masked): `low_clip` (bool,
    ratio < 1 - epsilon_low and A < 0), `high_clip` (bool, ratio > 1 + epsilon_high and A > 0)
    and, when beta > 0, `kl` (detached values).
    With old_logprobs = logprobs.detach() the ratio is 1 and the gradient is -A * grad(logprobs).
    """
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logprobs.shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)              # [B, 1]
    ratio = torch.exp(log_importance_weights(logprobs, old_logprobs, completion_mask,
                                             importance_sampling_level))
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    info = {"low_clip": (ratio < 1 - epsilon_low) & (adv < 0),
            "high_clip": (ratio > 1 + epsilon_high) & (adv > 0)}
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    per_token_loss = -torch.min(ratio * adv, clipped * adv)
    if beta > 0:
        kl = kl_k3(logprobs, ref_logprobs)
        per_token_loss = per_token_loss + beta * kl
        info["kl"] = kl.detach()
    return per_token_loss, info


def aggregate_loss(per_token_loss: Tensor, completion_mask: Tensor, loss_type: str, *,
                   num_sequences: int, num_tokens: Union[int, float, Tensor],
                   max_completion_length: int, num_micro_batches: int) -> Tensor:
    """This micro-batch's contribution to the loss of the whole optimizer step (a scalar).

    per_token_loss, completion_mask: [B, T]. The step constants cover every micro-batch on every
    data-parallel rank (the trainer all-reduces them): num_sequences (completions), num_tokens
    (valid completion tokens), num_micro_batches. Summing the contributions of all micro-batches
    of all ranks gives the step loss, whatever the split, for grpo, dr_grpo and dapo:
      grpo:    sum over sequences of their token mean / num_sequences (an empty sequence adds 0)
      dr_grpo: token sum / (num_sequences * max_completion_length)
      dapo:    token sum / max(num_tokens, 1)
      bnpo:    token mean of THIS micro-batch / num_micro_batches (TRL's local definition: it
               depends on how the step is split into micro-batches).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if num_sequences < 1 or num_micro_batches < 1:
        raise ValueError(f"num_sequences and num_micro_batches must be >= 1, got "
                         f"{num_sequences} and {num_micro_batches}")
    if loss_type == "grpo":
        return masked_mean(per_token_loss, completion_mask, dim=-1).sum() / num_sequences
    if loss_type == "bnpo":
        return masked_mean(per_token_loss, completion_mask) / num_micro_batches
    token_sum = masked_sum(per_token_loss, completion_mask)
    if loss_type == "dr_grpo":
        return token_sum / (num_sequences * max_completion_length)
    if isinstance(num_tokens, Tensor):
        return token_sum / num_tokens.to(token_sum.dtype).clamp(min=1)
    return token_sum / max(num_tokens, 1)


def rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, completion_mask: Tensor,
                       mode: str, threshold: float) -> Tensor:
    """Truncated importance weights [B, T] for the train/inference mismatch (detached).

    The engine sampled with its own numerics (rollout_logprobs); the loss is computed for the
    trainer's old policy (old_logprobs). token_truncate: min(exp(old - rollout), threshold) per
    token; sequence_truncate: min(exp(sum over the completion of (old - rollout)), threshold)
    per completion, broadcast to its tokens. Positions outside the mask get weight 1.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    if mode == "sequence_truncate":
        log_ratio = masked_sum(log_ratio, completion_mask, dim=-1).unsqueeze(-1).expand_as(log_ratio)
    weights = torch.exp(log_ratio.clamp(max=20.0)).clamp(max=threshold)
    return torch.where(completion_mask.bool(), weights, torch.ones_like(weights))


def logprob_mismatch(trainer_logprobs: Tensor, engine_logprobs: Tensor,
                     completion_mask: Tensor) -> Dict[str, float]:
    """Mean and max |trainer - engine| logprob over the masked tokens [B, T] (weight-sync check)."""
    diff = torch.where(completion_mask.bool(), (trainer_logprobs - engine_logprobs).abs(),
                       torch.zeros_like(trainer_logprobs))
    count = completion_mask.bool().sum().clamp(min=1)
    return {"mean": float(diff.sum() / count), "max": float(diff.max())}
