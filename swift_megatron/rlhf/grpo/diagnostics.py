"""Per micro-batch diagnostics of the GRPO loss (pure torch, no process groups): the engine vs
trainer mismatch (ms-swift's rollout_correction/ metrics), the importance-weight statistics and
the entropy summaries. Every value is a 0-d tensor; the trainer averages them over micro-batches
and data-parallel ranks, except keys ending in `_max` / `_min`, reduced by max / min.

Shapes: [B, T] logprobs and masks (B completions), as in losses.py.
"""
from typing import Dict

import torch
from torch import Tensor

from swift_megatron.rlhf.grpo.losses import SAFETY_BOUND, masked_mean


def offpolicy_metrics(trainer_logprobs: Tensor, rollout_logprobs: Tensor,
                      completion_mask: Tensor) -> Dict[str, Tensor]:
    """How far the engine's sampling distribution is from the trainer's old policy, with
    log rho = trainer - rollout per token (all masked means over the completion tokens):
    kl = mean(-log rho) and k3_kl = mean(rho - log rho - 1) (both estimate KL(rollout ||
    trainer)); training_ppl / rollout_ppl = mean over completions of exp(-mean logprob) and
    their logs (log_ppl); log_ppl_diff = rollout - trainer mean logprob per completion (mean,
    abs mean, max, min), ppl_ratio = mean exp(log_ppl_diff); chi2_token = mean(rho^2) - 1,
    chi2_seq = mean over completions of exp(mean log rho)^2 - 1."""
    mask = completion_mask.bool()
    log_rho = torch.where(mask, trainer_logprobs - rollout_logprobs,
                          torch.zeros_like(trainer_logprobs)).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    trainer_mean = masked_mean(trainer_logprobs, mask, dim=-1)           # [B]
    rollout_mean = masked_mean(rollout_logprobs, mask, dim=-1)
    diff = rollout_mean - trainer_mean
    return {
        "training_ppl": torch.exp(-trainer_mean).mean(),
        "training_log_ppl": (-trainer_mean).mean(),
        "rollout_ppl": torch.exp(-rollout_mean).mean(),
        "rollout_log_ppl": (-rollout_mean).mean(),
        "kl": masked_mean(-log_rho, mask),
        "k3_kl": masked_mean(torch.exp(log_rho) - log_rho - 1, mask),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": masked_mean(torch.exp(log_rho).square(), mask) - 1,
        "chi2_seq": torch.exp(masked_mean(log_rho, mask, dim=-1)).square().mean() - 1,
    }


def importance_weight_metrics(old_logprobs: Tensor, rollout_logprobs: Tensor, weights: Tensor,
                              completion_mask: Tensor, mode: str,
                              threshold: float) -> Dict[str, Tensor]:
    """is_weight_mean; ess = 1 / mean((w / mean w)^2) with w the weights clamped to
    [1 / threshold, threshold]; clipped_frac: the fraction of tokens (token modes) or of
    completions (sequence modes) whose ratio exceeds the threshold."""
    mask = completion_mask.bool()
    log_rho = (old_logprobs - rollout_logprobs).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    bounded = weights.clamp(1 / threshold, threshold)
    normalised = bounded / (masked_mean(bounded, mask) + 1e-8)
    if mode.startswith("token"):
        clipped = masked_mean((torch.exp(log_rho) > threshold).float(), mask)
    else:
        clipped = (torch.exp(masked_mean(log_rho, mask, dim=-1)) > threshold).float().mean()
    return {"is_weight_mean": masked_mean(weights, mask),
            "ess": 1 / masked_mean(normalised.square(), mask).clamp(min=1e-10),
            "clipped_frac": clipped}


def entropy_summary(entropy: Tensor, completion_mask: Tensor) -> Dict[str, Tensor]:
    """--log_entropy: mean / max / min over the completions with tokens of their mean token
    entropy (completions without tokens are left out; all zero when none has any)."""
    has_tokens = completion_mask.bool().any(-1)
    per_completion = masked_mean(entropy, completion_mask, dim=-1)[has_tokens]
    if per_completion.numel() == 0:
        zero = entropy.new_zeros(())
        return {"mean": zero, "max": zero, "min": zero}
    return {"mean": per_completion.mean(), "max": per_completion.max(),
            "min": per_completion.min()}
