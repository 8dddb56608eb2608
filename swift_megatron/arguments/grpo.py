"""GRPO flags: generation sizes, sampling, the loss and its clipping, rewards, filtering."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
_ISSUE_14 = "not supported yet (issue 14: GRPO algorithm coverage)"


@dataclass
class GRPOArguments:
    """GRPO"""

    rlhf_type: str = arg("grpo", "The RLHF algorithm.", choices=["grpo"])
    # Generation batch
    num_generations: int = arg(8, "Completions sampled per prompt (the group size G).")
    steps_per_generation: Optional[int] = arg(None, "Optimizer steps per rollout batch. Default: "
                                              "generation_batch_size / global_batch_size, else 1.")
    generation_batch_size: Optional[int] = arg(None, "Completions per rollout batch. Default: "
                                               "global_batch_size x steps_per_generation.")
    max_completion_length: int = arg(512, "Longest completion in tokens.")
    # Sampling
    num_generations_eval: Optional[int] = arg(None, "Completions per validation prompt. Default: "
                                              "--num_generations.")
    temperature: float = arg(0.9, "Sampling temperature (also applied to the trainer's logprobs).")
    top_p: float = arg(1.0, "Nucleus sampling threshold (1.0 disables).")
    top_k: int = arg(-1, "Sample among the k most likely tokens (-1 or 0 disables).")
    repetition_penalty: float = arg(1.0, "Penalty on repeated tokens (1.0 disables).")
    # Loss
    beta: float = arg(0.04, "KL coefficient against the reference model; 0 skips the reference "
                      "model entirely.")
    epsilon: float = arg(0.2, "Lower clip range of the importance ratio: 1 - epsilon.")
    epsilon_high: Optional[float] = arg(None, "Upper clip range: 1 + epsilon_high (DAPO's "
                                        "clip-higher). Default: --epsilon.")
    delta: Optional[float] = arg(None, "Two-sided clipping: also cap the ratio at delta for "
                                 "negative advantages (INTELLECT-2). Must exceed 1 + epsilon_high.")
    loss_type: str = arg("grpo", "Token aggregation: grpo (mean of per-sequence token means), "
                         "bnpo (token mean of the micro-batch), dr_grpo (sum / (completions x "
                         "max_completion_length)), dapo (sum / completion tokens of the whole "
                         "optimizer step).", choices=list(LOSS_TYPES) + ["cispo", "sapo", "real", "fipo"],
                         not_yet={name: _ISSUE_14 for name in ("cispo", "sapo", "real", "fipo")})
    importance_sampling_level: str = arg("token", "Importance ratio per token, per sequence "
                                         "(GSPO) or sequence-level value with token gradients "
                                         "(GSPO-token).",
                                         choices=["token", "sequence", "sequence_token"])
    scale_rewards: str = arg("group", "Divide advantages by the reward std of the group, of the "
                             "whole batch, or not at all (Dr. GRPO).",
                             choices=["group", "batch", "none", "gdpo"], not_yet={"gdpo": _ISSUE_14})
    rollout_importance_sampling_mode: Optional[str] = arg(
        None, "Correct the train/inference mismatch with truncated importance weights "
        "min(pi_old / pi_rollout, threshold), per token or per sequence (TIS).",
        choices=["token_truncate", "sequence_truncate", "token_mask", "sequence_mask"],
        not_yet={"token_mask": _ISSUE_14, "sequence_mask": _ISSUE_14})
    rollout_importance_sampling_threshold: float = arg(
        2.0, "Upper bound of the rollout importance weights.")
    # Rewards
    reward_funcs: List[str] = arg([], "Reward functions: built-ins (accuracy, format, cosine, "
                                  "repetition, soft_overlong) or functions from --external_plugins.")
    reward_weights: Optional[List[float]] = arg(None, "One weight per reward function (default 1 each).")
    external_plugins: List[str] = arg([], "Python files to import before resolving --reward_funcs.")
    cosine_min_len_value_wrong: float = arg(-0.5, "cosine reward: value for a short wrong answer.")
    cosine_max_len_value_wrong: float = arg(0.0, "cosine reward: value for a long wrong answer.")
    cosine_min_len_value_correct: float = arg(1.0, "cosine reward: value for a short correct answer.")
    cosine_max_len_value_correct: float = arg(0.5, "cosine reward: value for a long correct answer.")
    cosine_max_len: Optional[int] = arg(None, "cosine reward: length scale (default max_completion_length).")
    repetition_n_grams: int = arg(3, "repetition reward: n-gram size.")
    repetition_max_penalty: float = arg(-1.0, "repetition reward: penalty for fully repeated text.")
    # Filtering
    dynamic_sample: bool = arg(False, "Resample groups whose rewards all agree (zero std), DAPO style.")
    max_resample_times: int = arg(3, "Resampling rounds for --dynamic_sample before falling back.")
    overlong_filter: bool = arg(False, "Mask truncated completions out of the loss.")
    soft_max_length: Optional[int] = arg(None, "soft_overlong reward: length where the penalty "
                                         "reaches -1 (default max_completion_length).")
    soft_cache_length: Optional[int] = arg(None, "soft_overlong reward: the penalty ramps over the "
                                           "last soft_cache_length tokens before soft_max_length.")
    log_completions: bool = arg(False, "Write prompts, completions and rewards to completions.jsonl.")
    log_rollout_offpolicy_metrics: bool = arg(
        False, "ms-swift: log the rollout engine vs trainer mismatch metrics.",
        no_effect="they are always logged (rollout/kl_trainer_vs_engine, "
                  "rollout/logprob_abs_diff_mean)")

    def __post_init__(self):
        if self.num_generations < 2:
            raise UserError(f"--num_generations must be >= 2 (a group needs two completions to "
                            f"compare), got {self.num_generations}")
        for name in ("steps_per_generation", "generation_batch_size", "num_generations_eval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        if self.max_completion_length < 1:
            raise UserError(f"--max_completion_length must be >= 1, got {self.max_completion_length}")
        if self.temperature <= 0:
            raise UserError(f"--temperature must be > 0, got {self.temperature}")
        if self.top_k < -1:
            raise UserError(f"--top_k must be >= -1 (-1 or 0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.beta < 0 or self.epsilon < 0:
            raise UserError("--beta and --epsilon must be >= 0")
        if self.rollout_importance_sampling_threshold <= 0:
            raise UserError("--rollout_importance_sampling_threshold must be > 0")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            raise UserError(f"--delta must exceed 1 + epsilon_high = {1 + self.epsilon_high}, "
                            f"got {self.delta}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise UserError(f"--reward_weights has {len(self.reward_weights)} values but "
                            f"--reward_funcs names {len(self.reward_funcs)} functions")
        if self.soft_cache_length is not None and self.soft_max_length is not None \
                and self.soft_cache_length >= self.soft_max_length:
            raise UserError("--soft_cache_length must be smaller than --soft_max_length")
