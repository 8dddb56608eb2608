"""Which completions and groups reach the loss (pure torch, no process groups).

Dynamic sampling (DAPO): a group whose rewards all agree has zero advantage and teaches
nothing; the trainer finds those groups (zero_std_groups / zero_std_prompt_ids), resamples
their prompts up to --max_resample_times, keeps whole groups with select_groups, and falls back
to keeping the rest with a warning. Overlong filtering: truncated completions leave the loss
(overlong_mask).
"""
import torch
from torch import Tensor

from swift_megatron.rlhf.grpo.advantages import group_stats


def zero_std_groups(rewards: Tensor, prompt_ids: Tensor, tol: float = 1e-6) -> Tensor:
    """[N] bool: True for completions whose group (same prompt id) has reward std < tol, i.e.
    all its rewards (near) equal. Std as in group_advantages: unbiased, 0 for a singleton.
    rewards: [N] float; prompt_ids: [N] int64."""
    if not rewards.is_floating_point():
        rewards = rewards.float()
    _, std, _ = group_stats(rewards, prompt_ids)
    return std < tol


def zero_std_prompt_ids(rewards: Tensor, prompt_ids: Tensor, tol: float = 1e-6) -> Tensor:
    """Sorted distinct prompt ids [G'] whose groups have zero reward std (to resample)."""
    return torch.unique(prompt_ids[zero_std_groups(rewards, prompt_ids, tol)])


def select_groups(prompt_ids: Tensor, keep_ids: Tensor) -> Tensor:
    """[N] bool row mask keeping every completion whose prompt id is in keep_ids [K], so
    groups are kept or dropped whole."""
    return torch.isin(prompt_ids, keep_ids.to(prompt_ids.device))


def overlong_mask(truncated: Tensor, completion_mask: Tensor) -> Tensor:
    """completion_mask [N, T] with the rows of truncated completions (truncated: [N] bool)
    zeroed; a new tensor of the same dtype (the input is left as is)."""
    if truncated.shape != completion_mask.shape[:1]:
        raise ValueError(f"truncated must be [N] = {tuple(completion_mask.shape[:1])}, "
                         f"got {tuple(truncated.shape)}")
    return completion_mask.masked_fill(truncated.bool().unsqueeze(-1), 0)
