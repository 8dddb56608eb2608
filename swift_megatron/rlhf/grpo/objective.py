"""The callbacks Megatron's forward_backward_func runs on the last pipeline stage: GRPO's loss
of one micro-batch (with its metrics), and logprob collection for the forward-only passes
(old policy, reference, teacher). They glue the output layer's logprobs (model/head.py) to the
pure GRPO math (losses.py, diagnostics.py); no process groups here beyond what those use.

One micro-batch's loss, in order: per-token advantages (A, plus the teacher term with a
teacher), the off-policy sequence mask, the per-token objective of --loss_type with the entropy
mask on its policy term and the KL term (unless --kl_in_reward), the rollout importance weights,
then the aggregation into its share of the step loss (real: its group loss instead).
"""
import dataclasses
from typing import Dict, Optional, Tuple

import torch

from swift_megatron.model.head import FinalHidden
from swift_megatron.parallel.context import CPShare
from swift_megatron.rlhf.grpo.batch import unpack
from swift_megatron.rlhf.grpo.diagnostics import (entropy_summary, importance_weight_metrics,
                                                  offpolicy_metrics)
from swift_megatron.rlhf.grpo.losses import (FipoSettings, aggregate_loss, entropy_mask, kl_k3,
                                             masked_mean, off_policy_keep, policy_loss,
                                             real_group_loss, real_kl_term, rollout_correction,
                                             token_advantages)


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
    rollout_correction: Optional[str] = None   # --rollout_importance_sampling_mode
    rollout_correction_threshold: float = 2.0
    offpolicy_metrics: bool = False            # rollout_correction/ diagnostics
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    real_tau: float = 0.5
    fipo: FipoSettings = FipoSettings()
    num_generations: int = 8                   # real's group size
    kl_in_reward: bool = False                 # the KL went into the rewards, not the loss
    top_entropy_quantile: float = 1.0
    log_entropy: bool = False
    off_policy_sequence_mask_delta: Optional[float] = None
    teacher_kl_coef: float = 1.0


@dataclasses.dataclass(frozen=True)
class StepConstants:
    """Totals over the whole optimizer step (all micro-batches of all DP ranks)."""

    num_sequences: int
    num_tokens: float
    num_micro_batches: int
    contribution_scale: float  # undoes megatron's 1/micro-batches and DDP's 1/dp averaging


def token_logprobs(micro_batch: dict, output: FinalHidden, settings: LossSettings,
                   with_entropy: bool = False):
    """log p(target) [B, S] (with `with_entropy`: and the entropy of the next-token distribution
    [B, S], without gradient, from the same pass over the vocabulary). A packed micro-batch's
    [T] values are gathered back to [B, S]; with context parallelism the hidden states are of
    this CP rank's positions and every rank's values are gathered (each rank computes the same
    loss)."""
    packed = "packed_index" in micro_batch
    targets = micro_batch["packed_targets" if packed else "targets"]
    share = CPShare.of(micro_batch)
    if share is not None:
        targets = share.local(targets, -1)
    values = output.logprobs(targets, settings.temperature, settings.vocab_size, with_entropy)
    if with_entropy:
        return tuple(_in_sequence_order(micro_batch, share, v) for v in values)
    return _in_sequence_order(micro_batch, share, values)


def _in_sequence_order(micro_batch: dict, share: Optional[CPShare], values: torch.Tensor
                       ) -> torch.Tensor:
    """Values per position of the model's output -> [B, S]: CP ranks' positions gathered,
    a packed micro-batch unpacked."""
    if share is not None:
        values = share.gather(values, -1, reduce_grads=False)
    if "packed_index" in micro_batch:
        return unpack(values, micro_batch["packed_index"])
    return values


def collect_logprobs(settings: LossSettings, micro_batch: dict,
                     output: FinalHidden) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Forward-only callback: no loss, the logprobs of the targets [B, S]."""
    logprobs = token_logprobs(micro_batch, output, settings).detach()
    return logprobs.new_zeros(()), {"logprobs": logprobs}


def grpo_loss(settings: LossSettings, step: StepConstants, micro_batch: dict,
              output: FinalHidden) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """This micro-batch's scaled contribution to the step loss, and its metrics."""
    mask = micro_batch["completion_mask"]
    logprobs, entropy = token_logprobs(micro_batch, output, settings, with_entropy=True)
    old = micro_batch.get("old_logprobs")
    old = logprobs.detach() if old is None else old
    advantages = micro_batch["advantages"]
    if "teacher_logprobs" in micro_batch:
        advantages = token_advantages(advantages, mask, micro_batch["teacher_logprobs"], old,
                                      settings.teacher_kl_coef)
    kept = None
    if settings.top_entropy_quantile < 1:
        kept = entropy_mask(entropy, mask, settings.top_entropy_quantile)
    if settings.off_policy_sequence_mask_delta is not None:
        behaviour = micro_batch.get("rollout_logprobs", old)
        keep = off_policy_keep(logprobs, behaviour, mask, advantages,
                               settings.off_policy_sequence_mask_delta)
        mask = mask * keep.unsqueeze(-1).to(mask.dtype)
    beta = 0.0 if settings.kl_in_reward else settings.beta
    if settings.loss_type == "real":
        contribution, info = _real_contribution(settings, step, micro_batch, logprobs, old, mask, beta)
    else:
        contribution, info = _token_contribution(settings, step, micro_batch, logprobs, old,
                                                 advantages, mask, beta, kept)
    metrics = _metrics(contribution, entropy, old, info, micro_batch, mask, settings)
    return contribution * step.contribution_scale, metrics


def _token_contribution(settings, step, micro_batch, logprobs, old, advantages, mask, beta, kept):
    per_token, info = policy_loss(
        logprobs, old, advantages, mask, epsilon_low=settings.epsilon,
        epsilon_high=settings.epsilon_high, delta=settings.delta,
        importance_sampling_level=settings.importance_sampling_level,
        ref_logprobs=micro_batch.get("ref_logprobs"), beta=beta, loss_type=settings.loss_type,
        tau_pos=settings.tau_pos, tau_neg=settings.tau_neg, fipo=settings.fipo, token_mask=kept)
    if settings.rollout_correction:
        weights = rollout_correction(old, micro_batch["rollout_logprobs"], mask,
                                     settings.rollout_correction,
                                     settings.rollout_correction_threshold)
        per_token = per_token * weights
        info["is_weight"] = weights
    if kept is not None:
        info["entropy_kept"] = kept
    contribution = aggregate_loss(
        per_token, mask, settings.loss_type, num_sequences=step.num_sequences,
        num_tokens=step.num_tokens, max_completion_length=settings.max_completion_length,
        num_micro_batches=step.num_micro_batches)
    return contribution, info


def _real_contribution(settings, step, micro_batch, logprobs, old, mask, beta):
    """REAL: the group losses / the step's number of groups, plus beta x the micro-batch's
    mean KL over its (kept) completion tokens / the step's micro-batches (real_kl_term)."""
    total, _ = real_group_loss(logprobs, old, micro_batch["advantages"], mask,
                               micro_batch["group_ids"], settings.real_tau,
                               settings.num_generations)
    contribution = total * settings.num_generations / step.num_sequences
    info: Dict[str, torch.Tensor] = {}
    if beta > 0:
        kl = kl_k3(logprobs, micro_batch["ref_logprobs"])
        contribution = contribution + beta * real_kl_term(kl, mask, step.num_micro_batches)
        info["kl"] = kl.detach()
    return contribution, info


@torch.no_grad()
def _metrics(contribution, entropy, old, info, micro_batch, mask, settings) -> Dict[str, torch.Tensor]:
    metrics = {"loss": contribution.detach(), "entropy": masked_mean(entropy, mask)}
    for name in ("low", "high"):
        if f"{name}_clip" in info:
            metrics[f"clip_ratio/{name}"] = masked_mean(info[f"{name}_clip"].float(), mask)
    if "low_clip" in info:
        region = info["low_clip"] | info["high_clip"]
        metrics["clip_ratio/region"] = masked_mean(region.float(), mask)
    if "kl" in info:
        metrics["kl"] = masked_mean(info["kl"], mask)
    if "future_kl" in info:
        for key, name in (("future_kl", "future_kl_mean"), ("influence_weight",
                          "influence_weight_mean"), ("safety_keep", "safety_keep_ratio")):
            metrics[f"fipo/{name}"] = masked_mean(info[key].float(), mask)
    if "entropy_kept" in info:
        metrics["entropy/kept_fraction"] = masked_mean(info["entropy_kept"].float(), mask)
    if settings.log_entropy:
        metrics.update({f"entropy/completion_{k}": v
                        for k, v in entropy_summary(entropy, mask).items()})
    if "teacher_logprobs" in micro_batch:
        metrics["teacher_kl"] = masked_mean(kl_k3(old, micro_batch["teacher_logprobs"]), mask)
    metrics.update(_rollout_metrics(old, info, micro_batch, mask, settings))
    return metrics


def _rollout_metrics(old, info, micro_batch, mask, settings) -> Dict[str, torch.Tensor]:
    """Engine vs trainer on the rollout's weights (the old policy)."""
    rollout = micro_batch.get("rollout_logprobs")
    if rollout is None:
        return {}
    metrics = {"rollout/logprob_abs_diff_mean": masked_mean((old - rollout).abs(), mask),
               "rollout/kl_trainer_vs_engine": masked_mean(kl_k3(old, rollout), mask)}
    if settings.offpolicy_metrics:
        metrics.update({f"rollout_correction/{k}": v
                        for k, v in offpolicy_metrics(old, rollout, mask).items()})
    if "is_weight" in info:
        found = importance_weight_metrics(old, rollout, info["is_weight"], mask,
                                          settings.rollout_correction,
                                          settings.rollout_correction_threshold)
        metrics.update({f"rollout_correction/{k}": v for k, v in found.items()})
        metrics["rollout/is_weight_mean"] = found["is_weight_mean"]
    return metrics
