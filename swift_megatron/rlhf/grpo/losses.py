"""The GRPO policy loss per token and its aggregation into one micro-batch's share of the step
loss (pure torch, no process groups).

Shapes: B completions, T completion tokens. `completion_mask` [B, T] is 1 (or True) on tokens
that count; positions outside it may hold anything (even NaN): they are selected away with
torch.where, never multiplied by 0. `advantages` is [B], one value per completion, or [B, T]
per token (on-policy distillation adds a per-token teacher term, token_advantages).

Per-token objectives (`--loss_type`), with r the importance ratio and A the advantage:
  grpo, bnpo, dr_grpo, dapo: -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
  cispo: -sg(min(r, epsilon_high)) A logprobs                     (MiniMax-M1)
  sapo:  -g(r) A, g = sigmoid(tau (r - 1)) 4 / tau, tau_pos for A > 0, tau_neg otherwise
  fipo:  the clipped surrogate times a future-KL influence weight (fipo_weights)
  real:  a per-group classification loss over sequence log ratios (real_group_loss)
"""
import dataclasses
import math
from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "real", "fipo")
# How each per-token loss type aggregates its tokens (real has its own group loss).
AGGREGATION = {"grpo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo", "dapo": "dapo",
               "sapo": "grpo", "cispo": "dapo", "fipo": "dapo"}
ROLLOUT_CORRECTIONS = ("token_truncate", "sequence_truncate", "token_mask", "sequence_mask")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
SAFETY_BOUND = 20.0  # log ratios are clamped to +-20 before exp


@dataclasses.dataclass(frozen=True)
class FipoSettings:
    """FIPO's flags: gamma = 2 ** (-1 / decay_rate); clip_range None or 0 disables clipping."""

    decay_rate: float = 32.0
    clip_range: Optional[float] = 0.2
    clip_high_only: bool = True
    safety_threshold: Optional[float] = 4.0


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
    log_ratio = (ref_logprobs - logprobs).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    kl = torch.exp(log_ratio) - log_ratio - 1
    return kl.clamp(-10, 10)


def sequence_kl(old_logprobs: Tensor, ref_logprobs: Tensor, completion_mask: Tensor) -> Tensor:
    """KL of each completion for --kl_in_reward, [B, T] -> [B]: the sum over its tokens of
    old_logprobs - ref_logprobs (the k1 estimator of KL(old policy || reference))."""
    return masked_sum(old_logprobs - ref_logprobs, completion_mask, dim=-1)


def token_advantages(advantages: Tensor, completion_mask: Tensor, teacher_logprobs: Tensor,
                     old_logprobs: Tensor, teacher_kl_coef: float) -> Tensor:
    """On-policy distillation (OPD-RL): [B] -> [B, T] advantages
    A + teacher_kl_coef * (teacher_logprobs - old_logprobs), the teacher term 0 outside the mask.
    It is the negative k1 estimate of KL(student || teacher) on the sampled token."""
    gap = torch.where(completion_mask.bool(), teacher_logprobs - old_logprobs,
                      torch.zeros_like(old_logprobs))
    return advantages.to(old_logprobs.dtype).unsqueeze(-1) + teacher_kl_coef * gap.detach()


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


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    """[B] or [B, T] advantages as a tensor broadcastable to [B, T]."""
    if advantages.shape == like.shape:
        return advantages.to(like.dtype)
    if advantages.shape != like.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(like.shape[:1])} or [B, T] = "
                         f"{tuple(like.shape)}, got {tuple(advantages.shape)}")
    return advantages.to(like.dtype).unsqueeze(-1)


def clipped_surrogate(ratio: Tensor, adv: Tensor, epsilon_low: float, epsilon_high: float,
                      delta: Optional[float] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """PPO's clipped objective per token, -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A), with r
    first capped at delta in the unclipped branch (two-sided clipping, INTELLECT-2). ratio [B, T],
    adv [B, 1] or [B, T]. Indicators: low_clip (r < 1 - eps_low, A < 0), high_clip
    (r > 1 + eps_high, A > 0)."""
    clipped = ratio.clamp(1 - epsilon_low, 1 + epsilon_high)
    info = {"low_clip": (ratio < 1 - epsilon_low) & (adv < 0),
            "high_clip": (ratio > 1 + epsilon_high) & (adv > 0)}
    if delta is not None:
        ratio = ratio.clamp(max=delta)
    return -torch.min(ratio * adv, clipped * adv), info


def cispo_surrogate(logprobs: Tensor, ratio: Tensor, adv: Tensor,
                    epsilon_high: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """CISPO per token: -sg(min(r, epsilon_high)) A logprobs; the weight is clipped, never the
    gradient (epsilon_high is an absolute bound on r here, e.g. 5). high_clip: r > epsilon_high
    and A > 0 (ms-swift's cispo_clip_ratio)."""
    weight = ratio.clamp(max=epsilon_high).detach()
    info = {"high_clip": (ratio > epsilon_high) & (adv > 0)}
    return -weight * adv * logprobs, info


def sapo_surrogate(ratio: Tensor, adv: Tensor, tau_pos: float,
                   tau_neg: float) -> Tuple[Tensor, Dict[str, Tensor]]:
    """SAPO per token: -g A with the soft gate g = sigmoid(tau (r - 1)) * 4 / tau, tau = tau_pos
    where A > 0 and tau_neg elsewhere. dg/dr = 1 at r = 1: on-policy it is -A grad(logprobs)."""
    gate_pos = torch.sigmoid(tau_pos * (ratio - 1)) * (4.0 / tau_pos)
    gate_neg = torch.sigmoid(tau_neg * (ratio - 1)) * (4.0 / tau_neg)
    return -torch.where(adv > 0, gate_pos, gate_neg) * adv, {}


def future_kl(log_ratio: Tensor, completion_mask: Tensor, gamma: float,
              chunk: int = 256) -> Tensor:
    """FutureKL_t = sum over k >= t of gamma^(k - t) * mask_k * log_ratio_k, [B, T] -> [B, T]
    (0 outside the mask). Computed as a matmul with the decay matrix, `chunk` columns at a time."""
    delta = torch.where(completion_mask.bool(), log_ratio, torch.zeros_like(log_ratio))
    length = delta.shape[-1]
    rows = torch.arange(length, device=delta.device).unsqueeze(1)          # t
    result = torch.zeros_like(delta)
    for start in range(0, length, chunk):
        cols = torch.arange(start, min(length, start + chunk), device=delta.device).unsqueeze(0)
        distance = cols - rows                                               # k - t, [T, C]
        decay = torch.where(distance >= 0, gamma ** distance.clamp(min=0).to(delta.dtype),
                            torch.zeros((), dtype=delta.dtype, device=delta.device))
        result = result + delta[:, start:start + cols.shape[1]] @ decay.t()
    return torch.where(completion_mask.bool(), result, torch.zeros_like(result))


def fipo_weights(log_ratio: Tensor, ratio: Tensor, adv: Tensor, completion_mask: Tensor,
                 fipo: FipoSettings, delta: Optional[float] = None
                 ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """FIPO's influence weight per token [B, T] (detached) and its indicators.

    log_ratio: token log ratio logprobs - old_logprobs; ratio: the importance ratio of the loss.
    Tokens with ratio > delta (when set) leave the future-KL sum. f = exp(FutureKL), clipped to
    [1 - c, 1 + c] ([1, 1 + c] with clip_high_only) when clip_range c is set; tokens with A < 0
    and ratio > safety_threshold keep f within [0.8, 1.0]."""
    if delta is not None:
        log_ratio = torch.where(ratio > delta, torch.zeros_like(log_ratio), log_ratio)
    fkl = future_kl(log_ratio.detach(), completion_mask, 2 ** (-1 / fipo.decay_rate))
    weight = torch.exp(fkl.clamp(max=SAFETY_BOUND))
    if fipo.clip_range:
        low = 1.0 if fipo.clip_high_only else 1 - fipo.clip_range
        weight = weight.clamp(low, 1 + fipo.clip_range)
    safe = torch.ones_like(completion_mask, dtype=torch.bool)
    if fipo.safety_threshold is not None:
        safe = ~((adv < 0) & (ratio > fipo.safety_threshold))
        weight = torch.where(safe, weight, weight.clamp(0.8, 1.0))
    return weight.detach(), {"future_kl": fkl, "influence_weight": weight.detach(),
                             "safety_keep": safe.expand_as(weight)}


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                completion_mask: Tensor, *, epsilon_low: float, epsilon_high: float,
                delta: Optional[float] = None, importance_sampling_level: str = "token",
                ref_logprobs: Optional[Tensor] = None, beta: float = 0.0,
                loss_type: str = "grpo", tau_pos: float = 1.0, tau_neg: float = 1.05,
                fipo: Optional[FipoSettings] = None,
                token_mask: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, Tensor]]:
    """Per-token loss [B, T] of any per-token loss type (unmasked; aggregate with
    aggregate_loss), ratio r = exp(log_importance_weights).

    token_mask (bool [B, T], --top_entropy_quantile) zeroes the policy term of the tokens it
    leaves out; beta > 0 then adds beta * kl_k3(logprobs, ref_logprobs) on every token.
    Returns per-token [B, T] indicators (not masked): low_clip / high_clip where the loss type
    clips, `kl` (detached) when beta > 0, and FIPO's future_kl / influence_weight / safety_keep.
    With old_logprobs = logprobs.detach() the ratio is 1 and the gradient is -A * grad(logprobs)
    for every loss type.
    """
    if beta > 0 and ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs")
    adv = _per_token(advantages, logprobs)
    log_weights = log_importance_weights(logprobs, old_logprobs, completion_mask,
                                         importance_sampling_level)
    ratio = torch.exp(log_weights)
    if loss_type == "cispo":
        per_token_loss, info = cispo_surrogate(logprobs, ratio, adv, epsilon_high)
    elif loss_type == "sapo":
        per_token_loss, info = sapo_surrogate(ratio, adv, tau_pos, tau_neg)
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "fipo"):
        per_token_loss, info = clipped_surrogate(ratio, adv, epsilon_low, epsilon_high, delta)
        if loss_type == "fipo":
            weight, fipo_info = fipo_weights(logprobs - old_logprobs, ratio.detach(), adv,
                                             completion_mask, fipo or FipoSettings(), delta)
            per_token_loss = per_token_loss * weight
            info.update(fipo_info)
    else:
        raise ValueError(f"policy_loss handles {tuple(AGGREGATION)}, got {loss_type!r}")
    if token_mask is not None:
        per_token_loss = torch.where(token_mask, per_token_loss, torch.zeros_like(per_token_loss))
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
    sapo aggregates as grpo, cispo and fipo as dapo (AGGREGATION).
    """
    if loss_type not in AGGREGATION:
        raise ValueError(f"loss_type must be one of {tuple(AGGREGATION)}, got {loss_type!r}")
    if num_sequences < 1 or num_micro_batches < 1:
        raise ValueError(f"num_sequences and num_micro_batches must be >= 1, got "
                         f"{num_sequences} and {num_micro_batches}")
    aggregation = AGGREGATION[loss_type]
    if aggregation == "grpo":
        return masked_mean(per_token_loss, completion_mask, dim=-1).sum() / num_sequences
    if aggregation == "bnpo":
        return masked_mean(per_token_loss, completion_mask) / num_micro_batches
    token_sum = masked_sum(per_token_loss, completion_mask)
    if aggregation == "dr_grpo":
        return token_sum / (num_sequences * max_completion_length)
    if isinstance(num_tokens, Tensor):
        return token_sum / num_tokens.to(token_sum.dtype).clamp(min=1)
    return token_sum / max(num_tokens, 1)


def real_group_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor,
                    completion_mask: Tensor, group_ids: Tensor, tau: float,
                    group_size: int) -> Tuple[Tensor, int]:
    """REAL (rewards as labels): the sum over this micro-batch's groups of
    log(1 + sum_{A_i <= 0} exp(s_i / tau)) + log(1 + sum_{A_j > 0} exp(-s_j / tau)), where
    s = the mean log ratio logprobs - old_logprobs of each completion; groups (same group id,
    every one of exactly group_size completions) without both signs add 0. Returns (that sum,
    the number of valid groups). logprobs [B, T], advantages [B], group_ids [B]."""
    scores = masked_mean(logprobs - old_logprobs, completion_mask, dim=-1) / tau     # [B]
    ids, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if (counts != group_size).any():
        raise ValueError(f"loss_type real needs whole groups of {group_size} completions in a "
                         f"micro-batch, got group sizes {counts.tolist()}")
    order = torch.argsort(inverse, stable=True)
    scores = scores[order].view(len(ids), group_size)
    positive = (advantages[order] > 0).view(len(ids), group_size)
    valid = positive.any(1) & (~positive).any(1)
    zeros = scores.new_zeros(len(ids), 1)
    neg = torch.where(positive, torch.full_like(scores, -math.inf), scores)
    pos = torch.where(positive, -scores, torch.full_like(scores, -math.inf))
    per_group = (torch.logsumexp(torch.cat([neg, zeros], 1), 1)
                 + torch.logsumexp(torch.cat([pos, zeros], 1), 1))
    total = torch.where(valid, per_group, torch.zeros_like(per_group)).sum()
    return total, int(valid.sum())


def real_kl_term(kl: Tensor, completion_mask: Tensor, num_micro_batches: int) -> Tensor:
    """REAL's KL term of this micro-batch, ms-swift's: the mean KL over the micro-batch's
    completion tokens (with --off_policy_sequence_mask_delta, those of the kept completions
    only: a dropped completion's tokens count neither above nor below the line), averaged over
    the step's micro-batches (/ num_micro_batches, all ranks). kl, completion_mask [B, T]."""
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    return masked_mean(kl, completion_mask) / num_micro_batches


def entropy_mask(entropy: Tensor, completion_mask: Tensor, top_quantile: float) -> Tensor:
    """--top_entropy_quantile: bool [B, T], True on the completion tokens whose entropy is at
    least the (1 - top_quantile) quantile of this micro-batch's completion-token entropies
    (the highest-entropy fraction; ties at the threshold are kept)."""
    valid = completion_mask.bool()
    if not valid.any():
        return valid
    threshold = torch.quantile(entropy[valid].float(), 1 - top_quantile)
    return valid & (entropy >= threshold.to(entropy.dtype))


def rollout_correction(old_logprobs: Tensor, rollout_logprobs: Tensor, completion_mask: Tensor,
                       mode: str, threshold: float) -> Tensor:
    """Importance weights [B, T] for the train/inference mismatch (detached).

    The engine sampled with its own numerics (rollout_logprobs); the loss is computed for the
    trainer's old policy (old_logprobs). Per token rho = exp(old - rollout); per completion
    rho_seq = exp(mean over its tokens of (old - rollout)) (geometric mean). Log ratios are
    clamped to +-20.
      token_truncate:    min(rho, threshold)
      token_mask:        rho where rho <= threshold, else 0
      sequence_truncate: min(rho_seq, threshold) on every token of the completion
      sequence_mask:     rho, on completions whose rho_seq <= threshold, else 0
    Positions outside the mask get weight 1.
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"rollout correction must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    log_ratio = (old_logprobs - rollout_logprobs).detach().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rho = torch.exp(log_ratio)
    seq_rho = torch.exp(masked_mean(log_ratio, completion_mask, dim=-1)).unsqueeze(-1)  # [B, 1]
    if mode == "token_truncate":
        weights = rho.clamp(max=threshold)
    elif mode == "token_mask":
        weights = torch.where(rho <= threshold, rho, torch.zeros_like(rho))
    elif mode == "sequence_truncate":
        weights = seq_rho.clamp(max=threshold).expand_as(rho)
    else:
        weights = torch.where(seq_rho <= threshold, rho, torch.zeros_like(rho))
    return torch.where(completion_mask.bool(), weights, torch.ones_like(weights))


def off_policy_keep(logprobs: Tensor, behaviour_logprobs: Tensor, completion_mask: Tensor,
                    advantages: Tensor, delta: float) -> Tensor:
    """--off_policy_sequence_mask_delta (DeepSeek-V3.2): bool [B], False for the completions to
    drop: mean over tokens of (behaviour_logprobs - logprobs) > delta AND advantage < 0.
    behaviour_logprobs: the engine's logprobs of the rollout (else the old policy's)."""
    drift = masked_mean((behaviour_logprobs - logprobs).detach(), completion_mask, dim=-1)
    return ~((drift > delta) & (advantages < 0))


def logprob_mismatch(trainer_logprobs: Tensor, engine_logprobs: Tensor,
                     completion_mask: Tensor) -> Dict[str, float]:
    """Mean and max |trainer - engine| logprob over the masked tokens [B, T] (weight-sync check)."""
    diff = torch.where(completion_mask.bool(), (trainer_logprobs - engine_logprobs).abs(),
                       torch.zeros_like(trainer_logprobs))
    count = completion_mask.bool().sum().clamp(min=1)
    return {"mean": float(diff.sum() / count), "max": float(diff.max())}
