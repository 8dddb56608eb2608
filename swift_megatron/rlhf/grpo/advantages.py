"""Group-relative advantages for GRPO (pure torch, no process groups).

A group is every completion of one prompt, keyed by prompt id: completions of a prompt may sit
anywhere in the batch, in any order, and results do not depend on that order. Rewards are
reduced per group in a canonical order (sorted by prompt id, then reward), so permuting the
batch permutes the advantages bit for bit.
"""
from typing import Dict, Tuple

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")


def _unbiased_std(values: Tensor) -> Tensor:
    """Bessel-corrected std of a 1-D tensor; 0 for fewer than two values (instead of NaN)."""
    if values.numel() < 2:
        return values.new_zeros(())
    return torch.sort(values).values.std()


def group_stats(rewards: Tensor, prompt_ids: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Per-completion group mean and unbiased group std, plus the std of each group.

    rewards: [N] float; prompt_ids: [N] int64. Returns (mean [N], std [N], group_std [G]) where
    G is the number of distinct prompt ids (ascending id order). A singleton group has std 0.
    """
    if rewards.dim() != 1 or rewards.shape != prompt_ids.shape:
        raise ValueError(f"rewards and prompt_ids must both be [N], got {tuple(rewards.shape)} "
                         f"and {tuple(prompt_ids.shape)}")
    # Canonical order: by reward, then (stable) by prompt id -> groups contiguous, sorted inside.
    by_reward = torch.sort(rewards, stable=True).indices
    order = by_reward[torch.sort(prompt_ids[by_reward], stable=True).indices]
    _, counts = torch.unique_consecutive(prompt_ids[order], return_counts=True)
    num_groups, size = counts.numel(), int(counts.max()) if counts.numel() else 0
    group = torch.repeat_interleave(torch.arange(num_groups, device=rewards.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(rewards.numel(), device=rewards.device) - starts[group]
    padded = rewards.new_zeros(num_groups, size).index_put_((group, slot), rewards[order])
    valid = torch.zeros(num_groups, size, dtype=torch.bool, device=rewards.device).index_put_(
        (group, slot), torch.ones_like(group, dtype=torch.bool))
    n = counts.to(rewards.dtype)
    mean = padded.sum(1) / n                                      # [G]
    sq = torch.where(valid, padded - mean[:, None], 0.0).square().sum(1)
    std = torch.where(counts > 1, (sq / (n - 1).clamp(min=1)).sqrt(), 0.0)  # [G]
    mean_sorted, std_sorted = mean[group], std[group]
    out_mean, out_std = torch.empty_like(rewards), torch.empty_like(rewards)
    out_mean[order], out_std[order] = mean_sorted, std_sorted
    return out_mean, out_std, std


def group_advantages(rewards: Tensor, prompt_ids: Tensor, scale_rewards: str = "group",
                     eps: float = 1e-4) -> Tuple[Tensor, Dict[str, float]]:
    """GRPO advantages: reward minus its group mean, scaled per `scale_rewards`.

    rewards: [N]; prompt_ids: [N] int64 (one id per prompt; its completions form a group).
    scale_rewards: "group" divides by (group std + eps), "batch" by (std of all N rewards + eps),
    "none" does not divide (Dr. GRPO). Stds are unbiased; a singleton group has std 0, so its
    advantage is 0. Returns (advantages [N], metrics): reward_mean, reward_std (batch, unbiased,
    0 when N < 2) and frac_reward_zero_std (fraction of GROUPS whose std < 1e-6).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    mean, std, group_std = group_stats(rewards, prompt_ids)
    batch_std = _unbiased_std(rewards)
    advantages = rewards - mean
    if scale_rewards == "group":
        advantages = advantages / (std + eps)
    elif scale_rewards == "batch":
        advantages = advantages / (batch_std + eps)
    metrics = {
        "reward_mean": float(torch.sort(rewards).values.mean()) if rewards.numel() else 0.0,
        "reward_std": float(batch_std),
        "frac_reward_zero_std":
            float((group_std < 1e-6).float().mean()) if group_std.numel() else 0.0,
    }
    return advantages, metrics


def weighted_rewards(per_func: Tensor, weights: Tensor) -> Tensor:
    """Weighted sum of reward functions: per_func [N, F] (NaN where a function returned None),
    weights [F] -> [N]. NaN counts as 0 in the sum (TRL's nansum)."""
    if per_func.dim() != 2 or weights.shape != per_func.shape[1:]:
        raise ValueError(f"per_func must be [N, F] and weights [F], got {tuple(per_func.shape)} "
                         f"and {tuple(weights.shape)}")
    return (per_func * weights.to(per_func.dtype)[None, :]).nansum(dim=1)
