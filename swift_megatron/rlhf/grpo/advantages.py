"""Group-relative advantages for GRPO (pure torch, no process groups).

A group is every completion of one prompt, keyed by prompt id: completions of a prompt may sit
anywhere in the batch, in any order, and results do not depend on that order. Rewards are
reduced per group in a canonical order (sorted by prompt id, then reward), so permuting the
batch permutes the advantages bit for bit.

Estimators (`--advantage_estimator`), R the reward, mean/std over the completion's group:
  grpo:                R - mean, divided per --scale_rewards by the std of R
  rloo:                K / (K - 1) * (R - mean) (leave-one-out baseline, K = group size)
  reinforce_plus_plus: R - mean, divided by the std of those differences
`--scale_rewards gdpo` normalises each reward function within its groups first (gdpo_advantages).
"""
import math
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
SCALE_REWARDS = ("group", "batch", "none", "gdpo")


def _unbiased_std(values: Tensor) -> Tensor:
    """Bessel-corrected std of a 1-D tensor; 0 for fewer than two values (instead of NaN)."""
    if values.numel() < 2:
        return values.new_zeros(())
    return torch.sort(values).values.std()


def group_stats(values: Tensor, prompt_ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-completion group mean and unbiased group std, plus the std of each group; NaN values
    (a reward function that did not apply) are left out of both.

    values: [N] float; prompt_ids: [N] int64. Returns (mean [N], std [N], group_std [G]) where
    G is the number of distinct prompt ids (ascending id order). A group with fewer than two
    values has std 0 (and with none, mean 0).
    """
    if values.dim() != 1 or values.shape != prompt_ids.shape:
        raise ValueError(f"values and prompt_ids must both be [N], got {tuple(values.shape)} "
                         f"and {tuple(prompt_ids.shape)}")
    # Canonical order: by value (NaN last), then (stable) by prompt id -> groups contiguous.
    by_value = torch.sort(values, stable=True).indices
    order = by_value[torch.sort(prompt_ids[by_value], stable=True).indices]
    _, counts = torch.unique_consecutive(prompt_ids[order], return_counts=True)
    num_groups, size = counts.numel(), int(counts.max()) if counts.numel() else 0
    group = torch.repeat_interleave(torch.arange(num_groups, device=values.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(values.numel(), device=values.device) - starts[group]
    sorted_values = values[order]
    present = ~torch.isnan(sorted_values)
    padded = values.new_zeros(num_groups, size).index_put_(
        (group, slot), torch.where(present, sorted_values, 0.0))
    valid = torch.zeros(num_groups, size, dtype=torch.bool, device=values.device).index_put_(
        (group, slot), present)
    n = valid.sum(1).to(values.dtype)
    mean = padded.sum(1) / n.clamp(min=1)                                    # [G]
    sq = torch.where(valid, padded - mean[:, None], 0.0).square().sum(1)
    std = torch.where(n > 1, (sq / (n - 1).clamp(min=1)).sqrt(), 0.0)       # [G]
    out_mean, out_std = torch.empty_like(values), torch.empty_like(values)
    out_mean[order], out_std[order] = mean[group], std[group]
    return out_mean, out_std, std


def group_sizes(prompt_ids: Tensor) -> Tensor:
    """[N] int: how many completions share each completion's prompt id (its group size K)."""
    _, inverse, counts = torch.unique(prompt_ids, return_inverse=True, return_counts=True)
    return counts[inverse]


def reward_metrics(rewards: Tensor, prompt_ids: Tensor) -> Dict[str, float]:
    """reward_mean, reward_std (batch, unbiased, 0 when N < 2) and frac_reward_zero_std
    (fraction of GROUPS whose std < 1e-6) of the weighted rewards [N]."""
    _, _, group_std = group_stats(rewards, prompt_ids)
    return {
        "reward_mean": float(torch.sort(rewards).values.mean()) if rewards.numel() else 0.0,
        "reward_std": float(_unbiased_std(rewards)),
        "frac_reward_zero_std":
            float((group_std < 1e-6).float().mean()) if group_std.numel() else 0.0,
    }


def group_advantages(rewards: Tensor, prompt_ids: Tensor, scale_rewards: str = "group",
                     eps: float = 1e-4, estimator: str = "grpo") -> Tuple[Tensor, Dict[str, float]]:
    """Advantages of one estimator (module docstring), scaled per `scale_rewards`.

    rewards: [N]; prompt_ids: [N] int64 (one id per prompt; its completions form a group).
    scale_rewards: "group" divides by (group std + eps), "batch" by (batch std + eps), "none"
    does not divide (Dr. GRPO); the std is of R for grpo and rloo, of R - mean for
    reinforce_plus_plus. Stds are unbiased; a singleton group has std 0 and advantage 0.
    Returns (advantages [N], reward_metrics(rewards, prompt_ids)).
    """
    if scale_rewards not in SCALE_REWARDS[:3]:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS[:3]} (gdpo: "
                         f"gdpo_advantages), got {scale_rewards!r}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    mean, std, _ = group_stats(rewards, prompt_ids)
    advantages = rewards - mean
    if estimator == "rloo":
        k = group_sizes(prompt_ids).to(rewards.dtype)
        advantages = torch.where(k > 1, advantages * k / (k - 1).clamp(min=1), advantages)
    if estimator == "reinforce_plus_plus":
        std = group_stats(advantages, prompt_ids)[1]
        batch_std = _unbiased_std(advantages)
    else:
        batch_std = _unbiased_std(rewards)
    if scale_rewards == "group":
        advantages = advantages / (std + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (batch_std + eps)
    return advantages, reward_metrics(rewards, prompt_ids)


def gdpo_advantages(per_func: Tensor, weights: Tensor, prompt_ids: Tensor,
                    eps: float = 1e-8) -> Tensor:
    """GDPO (--scale_rewards gdpo): each reward function's column of per_func [N, F] normalised
    within its groups, (r - group mean) / (group std + eps) (NaN -> 0), summed with weights [F],
    then normalised over the batch: (s - mean(s)) / (std(s) + eps). Returns [N]."""
    if per_func.dim() != 2 or weights.shape != per_func.shape[1:]:
        raise ValueError(f"per_func must be [N, F] and weights [F], got {tuple(per_func.shape)} "
                         f"and {tuple(weights.shape)}")
    summed = per_func.new_zeros(per_func.shape[0])
    for column, weight in zip(per_func.unbind(1), weights.tolist()):
        mean, std, _ = group_stats(column, prompt_ids)
        normalised = (column - mean) / (std + eps)
        summed = summed + weight * torch.where(torch.isnan(normalised), 0.0, normalised)
    centre = torch.sort(summed).values.mean() if summed.numel() else summed.new_zeros(())
    return (summed - centre) / (_unbiased_std(summed) + eps)


def compute_advantages(per_func: Tensor, weights: Tensor, prompt_ids: Tensor, *,
                       estimator: str = "grpo", scale_rewards: str = "group",
                       kl: Optional[Tensor] = None, beta: float = 0.0
                       ) -> Tuple[Tensor, Dict[str, float]]:
    """Advantages [N] of the rollout batch from the rewards per function per_func [N, F] (NaN
    where a function returned None), their weights [F] and the prompt ids [N].

    --kl_in_reward: with kl [N] (sequence_kl per completion) the estimator sees R - beta * kl.
    The metrics (reward_metrics) are of the weighted rewards before that.
    """
    rewards = weighted_rewards(per_func, weights)
    metrics = reward_metrics(rewards, prompt_ids)
    if scale_rewards == "gdpo":
        if kl is not None:
            raise ValueError("scale_rewards gdpo does not take kl_in_reward")
        return gdpo_advantages(per_func, weights, prompt_ids), metrics
    shaped = rewards if kl is None else rewards - beta * kl.to(rewards.dtype)
    advantages, _ = group_advantages(shaped, prompt_ids, scale_rewards, estimator=estimator)
    return advantages, metrics


def weighted_rewards(per_func: Tensor, weights: Tensor) -> Tensor:
    """Weighted sum of reward functions: per_func [N, F] (NaN where a function returned None),
    weights [F] -> [N]. NaN counts as 0 in the sum (TRL's nansum)."""
    if per_func.dim() != 2 or weights.shape != per_func.shape[1:]:
        raise ValueError(f"per_func must be [N, F] and weights [F], got {tuple(per_func.shape)} "
                         f"and {tuple(weights.shape)}")
    return (per_func * weights.to(per_func.dtype)[None, :]).nansum(dim=1)


def overflow_problem(per_func: Tensor, weights: Tensor, advantages: Tensor,
                     metrics: Dict[str, float], names: Sequence[str]) -> Optional[str]:
    """What went wrong when finite rewards give non-finite statistics or advantages (a function
    returning 1e300, or a --reward_weights value of 1e308: the squares overflow float64, the std
    is inf, every advantage 0 or NaN and nothing trains), naming the column with the largest
    weighted |reward| and blaming its larger factor, the reward or its weight; None when all is
    finite. per_func [N, F], weights [F]."""
    if torch.isfinite(advantages).all() and all(
            math.isfinite(metrics[k]) for k in ("reward_mean", "reward_std")):
        return None
    largest = per_func.abs().nan_to_num(0.0).amax(dim=0)   # [F]
    weight = weights.abs().to(largest.dtype)
    worst = int((largest * weight).nan_to_num(posinf=math.inf).argmax())
    head = (f"the rewards' statistics are not finite (reward/mean {metrics['reward_mean']}, "
            f"reward/std {metrics['reward_std']}): ")
    if weight[worst] > largest[worst]:
        return head + (f"--reward_weights gives reward function {names[worst]!r} the weight "
                       f"{weights[worst].item():.3g} (its |reward| reaches "
                       f"{largest[worst].item():.3g}); keep each weight x reward to a scale "
                       f"whose squares fit a float64 (well below 1e150), e.g. weights within "
                       f"[-1e6, 1e6]")
    return head + (f"reward function {names[worst]!r} returned |reward| up to "
                   f"{largest[worst].item():.3g}; keep rewards to a scale whose squares fit a "
                   f"float64 (well below 1e150), e.g. within [-1e6, 1e6]")
