"""The callbacks Megatron's forward_backward_func runs on the last pipeline stage: GRPO's loss
of one micro-batch (with its metrics), and logprob collection for the forward-only passes
(old policy, reference). They glue vocab-parallel logprobs (model/logprobs.py) to the pure
GRPO math (losses.py); no process groups here beyond what those use.
"""
import dataclasses
from typing import Dict, Optional, Tuple

import torch

from swift_megatron.model.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from swift_megatron.rlhf.grpo.batch import unpack
from swift_megatron.rlhf.grpo.losses import (aggregate_loss, kl_k3, masked_mean, policy_loss,
                                             rollout_correction)


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The loss flags (from GRPOArguments) plus what the model adds (the real vocab size)."""

    loss_type: str
    beta: float
    epsilon: float
    epsilon_high: float
    delta: Optional[float]
    importance_sampling_level: str
    temperature: float
    max_completion_length: int
    vocab_size: int
    rollout_correction: Optional[str] = None   # token_truncate | sequence_truncate | None
    rollout_correction_threshold: float = 2.0


@dataclasses.dataclass(frozen=True)
class StepConstants:
    """Totals over the whole optimizer step (all micro-batches of all DP ranks)."""

    num_sequences: int
    num_tokens: float
    num_micro_batches: int
    contribution_scale: float  # undoes megatron's 1/micro-batches and DDP's 1/dp averaging


def token_logprobs(micro_batch: dict, logits: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """log p(target) [B, S]; a packed micro-batch's [1, T] logits are gathered back to [B, S]."""
    if "packed_index" in micro_batch:
        packed = vocab_parallel_logprobs(logits[0], micro_batch["packed_targets"],
                                         settings.temperature, settings.vocab_size)
        return unpack(packed, micro_batch["packed_index"])
    return vocab_parallel_logprobs(logits, micro_batch["targets"], settings.temperature,
                                   settings.vocab_size)


def token_entropy(micro_batch: dict, logits: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """Entropy of the next-token distribution [B, S] (packed micro-batches gathered back)."""
    if "packed_index" in micro_batch:
        packed = vocab_parallel_entropy(logits[0], settings.temperature, settings.vocab_size)
        return unpack(packed, micro_batch["packed_index"])
    return vocab_parallel_entropy(logits, settings.temperature, settings.vocab_size)


def collect_logprobs(settings: LossSettings, micro_batch: dict,
                     logits: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Forward-only callback: no loss, the logprobs of the targets [B, S]."""
    return logits.new_zeros(()), {"logprobs": token_logprobs(micro_batch, logits, settings).detach()}


def grpo_loss(settings: LossSettings, step: StepConstants, micro_batch: dict,
              logits: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """This micro-batch's scaled contribution to the step loss, and its metrics."""
    mask = micro_batch["completion_mask"]
    logprobs = token_logprobs(micro_batch, logits, settings)
    old = micro_batch.get("old_logprobs")
    per_token, info = policy_loss(
        logprobs, logprobs.detach() if old is None else old, micro_batch["advantages"], mask,
        epsilon_low=settings.epsilon, epsilon_high=settings.epsilon_high, delta=settings.delta,
        importance_sampling_level=settings.importance_sampling_level,
        ref_logprobs=micro_batch.get("ref_logprobs"), beta=settings.beta)
    if settings.rollout_correction:
        weights = rollout_correction(logprobs.detach() if old is None else old,
                                     micro_batch["rollout_logprobs"], mask,
                                     settings.rollout_correction, settings.rollout_correction_threshold)
        per_token = per_token * weights
        info["is_weight"] = weights
    contribution = aggregate_loss(
        per_token, mask, settings.loss_type, num_sequences=step.num_sequences,
        num_tokens=step.num_tokens, max_completion_length=settings.max_completion_length,
        num_micro_batches=step.num_micro_batches)
    return contribution * step.contribution_scale, _metrics(contribution, logits, logprobs, info,
                                                            micro_batch, settings)


@torch.no_grad()
def _metrics(contribution, logits, logprobs, info, micro_batch, settings) -> Dict[str, torch.Tensor]:
    mask = micro_batch["completion_mask"]
    entropy = token_entropy(micro_batch, logits.detach(), settings)
    metrics = {
        "loss": contribution.detach(),
        "entropy": masked_mean(entropy, mask),
        "clip_ratio/low": masked_mean(info["low_clip"].float(), mask),
        "clip_ratio/high": masked_mean(info["high_clip"].float(), mask),
        "clip_ratio/region": masked_mean((info["low_clip"] | info["high_clip"]).float(), mask),
    }
    if "kl" in info:
        metrics["kl"] = masked_mean(info["kl"], mask)
    rollout = micro_batch.get("rollout_logprobs")
    if rollout is not None:  # engine vs trainer on the rollout's weights (old policy)
        trainer = micro_batch.get("old_logprobs", logprobs.detach())
        metrics["rollout/logprob_abs_diff_mean"] = masked_mean((trainer - rollout).abs(), mask)
        metrics["rollout/kl_trainer_vs_engine"] = masked_mean(kl_k3(trainer, rollout), mask)
    if "is_weight" in info:
        metrics["rollout/is_weight_mean"] = masked_mean(info["is_weight"], mask)
    return metrics
