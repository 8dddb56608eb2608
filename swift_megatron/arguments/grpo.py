"""GRPO flags: generation sizes, sampling, the loss and its variants, advantages, the reference
and teacher models, rewards and reward models, filtering. Names, meanings and defaults are
ms-swift's (docs/rlhf.md has the formulas)."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "real", "fipo")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
# --scale_rewards and --kl_in_reward default by --advantage_estimator, as ms-swift documents
DEFAULT_SCALE_REWARDS = {"grpo": "group", "rloo": "none", "reinforce_plus_plus": "batch"}
REWARD_ERROR_POLICIES = ("raise", "skip")   # --reward_error_policy (rewards/registry.py applies it)


def check_rlhf_type(value: Optional[str]) -> None:
    """ms-swift's `megatron rlhf` also trains dpo, kto, rm, gkd...: refuse those first, before a
    flag of theirs is reported as unknown."""
    if value is not None and value != "grpo":
        raise UserError(f"--rlhf_type {value}: only grpo is supported (ms-swift's other RLHF "
                        f"types are not: see docs/migrating-from-ms-swift.md#not-supported)")


@dataclass
class GRPOArguments:
    """GRPO"""

    rlhf_type: str = arg("grpo", "The RLHF algorithm.", choices=["grpo"])
    # Generation batch
    num_generations: int = arg(8, "Completions sampled per prompt (the group size G). 1 only "
                               "with a teacher (on-policy distillation).")
    steps_per_generation: Optional[int] = arg(None, "Optimizer steps per rollout batch. Default: "
                                              "generation_batch_size / global_batch_size, else 1.")
    generation_batch_size: Optional[int] = arg(None, "Completions per rollout batch. Default: "
                                               "global_batch_size x steps_per_generation.")
    num_iterations: int = arg(1, "Passes over each rollout batch (mu in the GRPO paper): "
                              "steps_per_generation optimizer steps each, all against the "
                              "logprobs of the policy that generated it.")
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
                                        "clip-higher); with --loss_type cispo the bound on the "
                                        "ratio itself (e.g. 5.0). Default: --epsilon.")
    delta: Optional[float] = arg(None, "Two-sided clipping: also cap the ratio at delta for "
                                 "negative advantages (INTELLECT-2). Must exceed 1 + epsilon_high.")
    loss_type: str = arg("grpo", "grpo (mean of per-sequence token means), bnpo (token mean of "
                         "the micro-batch), dr_grpo (sum / (completions x max_completion_length)), "
                         "dapo (sum / completion tokens of the step), cispo (clipped IS weight, "
                         "dapo aggregation), sapo (soft gate, grpo aggregation), real (in-group "
                         "classification of sequence log ratios), fipo (future-KL weighted, dapo "
                         "aggregation).", choices=list(LOSS_TYPES))
    tau_pos: float = arg(1.0, "sapo: gate temperature for positive advantages.")
    tau_neg: float = arg(1.05, "sapo: gate temperature for negative advantages.")
    real_tau: float = arg(0.5, "real: temperature of the classification logits (gradient "
                          "weights are bounded by 1 / real_tau).")
    fipo_decay_rate: float = arg(32.0, "fipo: half-life of the future-KL discount, "
                                 "gamma = 2 ** (-1 / fipo_decay_rate).")
    fipo_clip_range: Optional[float] = arg(0.2, "fipo: clip the influence weight to "
                                           "[1 - c, 1 + c]; none or 0 disables.")
    fipo_clip_high_only: bool = arg(True, "fipo: clip the influence weight to [1, 1 + "
                                    "fipo_clip_range] instead.")
    fipo_safety_threshold: Optional[float] = arg(4.0, "fipo: tokens with a negative advantage "
                                                 "and an importance ratio above this keep the "
                                                 "influence weight within [0.8, 1].")
    importance_sampling_level: str = arg("token", "Importance ratio per token, per sequence "
                                         "(GSPO) or sequence-level value with token gradients "
                                         "(GSPO-token).",
                                         choices=["token", "sequence", "sequence_token"])
    top_entropy_quantile: float = arg(1.0, "Keep only the policy loss of the completion tokens "
                                      "whose entropy is in this top fraction of the micro-batch "
                                      "(0.2: the top 20%); 1.0 keeps every token.")
    log_entropy: bool = arg(False, "Also log entropy/completion_{mean,max,min} over the "
                            "step's completions (each completion's mean token entropy).")
    # Advantages
    advantage_estimator: str = arg("grpo", "grpo (reward minus group mean, scaled), rloo "
                                   "(leave-one-out baseline), reinforce_plus_plus (scaled by the "
                                   "std of the group-centred rewards).",
                                   choices=list(ADVANTAGE_ESTIMATORS))
    scale_rewards: Optional[str] = arg(None, "Divide advantages by the std of the group, of the "
                                       "whole batch, or not at all (Dr. GRPO); gdpo normalises "
                                       "each reward function within its groups, then the "
                                       "weighted sum over the batch. Default: group for grpo, "
                                       "none for rloo (and loss_type real), batch for "
                                       "reinforce_plus_plus.",
                                       choices=["group", "batch", "none", "gdpo"])
    kl_in_reward: Optional[bool] = arg(None, "Subtract beta x the completion's KL to the "
                                       "reference from its reward (instead of a KL loss term). "
                                       "Default: true for rloo and reinforce_plus_plus, false "
                                       "for grpo.")
    # Train/inference mismatch
    rollout_importance_sampling_mode: Optional[str] = arg(
        None, "Correct the train/inference mismatch with importance weights pi_old / pi_rollout: "
        "truncated at the threshold (token_truncate, sequence_truncate) or zero above it "
        "(token_mask, sequence_mask); sequence modes use the geometric mean over the completion.",
        choices=["token_truncate", "sequence_truncate", "token_mask", "sequence_mask"])
    rollout_importance_sampling_threshold: float = arg(
        2.0, "Upper bound of the rollout importance weights.")
    log_rollout_offpolicy_metrics: bool = arg(
        False, "Log the rollout_correction/ diagnostics of the engine vs trainer mismatch (KL, "
        "perplexities, chi2); always on with --rollout_importance_sampling_mode.")
    off_policy_sequence_mask_delta: Optional[float] = arg(
        None, "Drop completions with a negative advantage whose mean (rollout - current) "
        "logprob exceeds this (DeepSeek-V3.2's off-policy sequence masking).")
    # Reference model
    ref_model: Optional[str] = arg(None, "HF directory or hub id of the reference model. "
                                   "Default: the starting weights (LoRA: the base model).")
    ref_adapters: List[str] = arg([], "A PEFT adapter applied to the reference model.")
    mcore_ref_model: Optional[str] = arg(None, "Reference weights from a Megatron checkpoint of "
                                         "ours (instead of --ref_model).")
    mcore_ref_adapter: Optional[str] = arg(None, "Reference adapter from a LoRA training "
                                           "checkpoint of ours (its adapter/).")
    sync_ref_model: bool = arg(False, "Every --ref_model_sync_steps optimizer steps, move the "
                               "reference towards the policy (TR-DPO). Full training only.")
    ref_model_sync_steps: int = arg(512, "Optimizer steps between reference syncs.")
    ref_model_mixup_alpha: float = arg(0.6, "Sync: ref = alpha x policy + (1 - alpha) x ref.")
    offload_ref_model: bool = arg(False, "Keep the frozen reference model (full training, or "
                                  "--ref_model) in host memory except for its forward passes: "
                                  "frees its weights on the GPU during training and generation "
                                  "for two host copies per rollout batch. Ours, not ms-swift's.")
    # Teacher (on-policy distillation, OPD-RL)
    teacher_model: Optional[str] = arg(None, "HF directory or hub id of a teacher (a supported "
                                       "family, the same tokenizer): its logprobs of the sampled "
                                       "tokens join the advantages per token.")
    teacher_model_type: Optional[str] = arg(None, "Override the teacher's model family.")
    teacher_model_revision: Optional[str] = arg(None, "Hub revision of --teacher_model.")
    teacher_kl_coef: float = arg(1.0, "A_t = A + teacher_kl_coef x (teacher - policy logprob "
                                 "of token t).")
    offload_teacher_model: bool = arg(False, "Keep the teacher in host memory except for its "
                                      "forward passes.")
    # Rewards
    reward_funcs: List[str] = arg([], "Reward functions: built-ins (accuracy, format, cosine, "
                                  "repetition, soft_overlong) or functions from --external_plugins.")
    reward_weights: Optional[List[float]] = arg(None, "One weight per reward function, then one "
                                                "per reward model (default 1 each).")
    reward_model: List[str] = arg([], "Sequence-classification reward models (HF directories or "
                                  "hub ids), scored after --reward_funcs: logit 0 of the chat.")
    reward_model_plugin: List[str] = arg([], "One per --reward_model: default (the logit) or a "
                                         "plugin class registered in rm_plugins by "
                                         "--external_plugins.")
    external_plugins: List[str] = arg([], "Python files to import before resolving --reward_funcs.")
    reward_error_policy: str = arg("raise", "When a reward function raises: raise stops the run "
                                   "naming the function and the first failing completion; skip "
                                   "scores each completion it raises on as missing for that "
                                   "function (None, 0 in the weighted sum), with a warning, and "
                                   "counts them in reward/<name>/errors.",
                                   choices=list(REWARD_ERROR_POLICIES))
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
    # Multi-turn rollouts (docs/multi_turn.md)
    multi_turn_scheduler: Optional[str] = arg(None, "Roll out conversations of several model "
                                              "turns: a scheduler built in (calculator, "
                                              "gym_scheduler) or registered by "
                                              "--external_plugins answers each turn with the "
                                              "next user/tool message, or stops.")
    max_turns: Optional[int] = arg(None, "Most model turns per conversation (none: until the "
                                   "scheduler stops or the length budget is spent).")
    completion_length_limit_scope: str = arg("per_round", "Multi-turn: --max_completion_length "
                                             "bounds each model turn (per_round) or the whole "
                                             "completion, tool and environment tokens included "
                                             "(total). Prompt + completion stays within "
                                             "--max_length either way.",
                                             choices=["per_round", "total"])
    gym_env: Optional[str] = arg(None, "The gym environment of --multi_turn_scheduler "
                                 "gym_scheduler: built in (grid_world) or registered by "
                                 "--external_plugins; a row's env_config name overrides it.")
    use_gym_env: Optional[bool] = arg(None, "Add the environment's total reward per episode as "
                                      "the reward column gym_reward (after --reward_funcs and "
                                      "--reward_model; --reward_weights takes one weight more). "
                                      "Default: true when --gym_env is given.")

    # Asynchronous generation (docs/rlhf.md, "Asynchronous generation")
    async_generate: bool = arg(False, "Generate the next rollout batch while the trainer "
                               "trains on this one (one step off-policy: the engine holds the "
                               "weights of one update before): on the rollout servers, or in "
                               "colocate mode on the colocated vLLM engine in a thread of its own "
                               "(engine and training state both on the GPU: --sleep_level 0, no "
                               "offloading; the dry run checks that they fit). The engine's "
                               "logprobs are the behaviour policy of "
                               "--rollout_importance_sampling_mode; the staleness is logged as "
                               "rollout/staleness. Not with multi-turn rollouts.")

    @property
    def has_teacher(self) -> bool:
        return self.teacher_model is not None

    def has_frozen_reference(self, lora: bool) -> bool:
        """Whether the KL term's reference is a model of its own: not when there is none (beta 0)
        or when it is the LoRA policy (`lora`: --train_type lora) with its adapters disabled."""
        custom = (self.ref_model or self.mcore_ref_model or self.ref_adapters
                  or self.mcore_ref_adapter)
        return self.beta != 0 and (not lora or bool(custom))

    def __post_init__(self):
        self._check_sizes()
        self._check_loss()
        self._resolve_advantages()
        self._check_references()
        self._check_teacher()
        self._check_multi_turn()
        self._check_rewards()

    def _check_sizes(self):
        if self.num_generations < (1 if self.has_teacher else 2):
            raise UserError(f"--num_generations must be >= 2 (a group needs two completions to "
                            f"compare; 1 only with --teacher_model), got {self.num_generations}")
        for name in ("steps_per_generation", "generation_batch_size", "num_generations_eval",
                     "num_iterations"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        if self.max_completion_length < 1:
            raise UserError(f"--max_completion_length must be >= 1, got {self.max_completion_length}")
        if self.max_resample_times < 0:
            raise UserError(f"--max_resample_times must be >= 0 (0: --dynamic_sample never "
                            f"resamples), got {self.max_resample_times}")
        if self.temperature <= 0:
            raise UserError(f"--temperature must be > 0, got {self.temperature}")
        if self.repetition_penalty <= 0:
            raise UserError(f"--repetition_penalty must be > 0 (1.0 disables it), got "
                            f"{self.repetition_penalty}")
        if self.top_k < -1:
            raise UserError(f"--top_k must be >= -1 (-1 or 0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top_p must be in (0, 1], got {self.top_p}")

    def _check_loss(self):
        if self.beta < 0 or self.epsilon < 0:
            raise UserError("--beta and --epsilon must be >= 0")
        if self.rollout_importance_sampling_threshold <= 0:
            raise UserError("--rollout_importance_sampling_threshold must be > 0")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if self.delta is not None and self.delta <= 1 + self.epsilon_high:
            raise UserError(f"--delta must exceed 1 + epsilon_high = {1 + self.epsilon_high}, "
                            f"got {self.delta}")
        for name in ("tau_pos", "tau_neg", "real_tau", "fipo_decay_rate"):
            if getattr(self, name) <= 0:
                raise UserError(f"--{name} must be > 0, got {getattr(self, name)}")
        if self.fipo_clip_range is not None and self.fipo_clip_range < 0:
            raise UserError(f"--fipo_clip_range must be >= 0 (or none), got {self.fipo_clip_range}")
        if self.loss_type == "cispo" and self.epsilon_high <= 1:
            raise UserError(f"--loss_type cispo caps the importance ratio itself at --epsilon_high, "
                            f"which is {self.epsilon_high} (every weight would be below 1): set "
                            f"--epsilon_high above 1, e.g. 5.0")
        if not 0 < self.top_entropy_quantile <= 1:
            raise UserError(f"--top_entropy_quantile must be in (0, 1], got "
                            f"{self.top_entropy_quantile}")
        if self.loss_type == "real":
            for name, unused in (("top_entropy_quantile", self.top_entropy_quantile < 1),
                                 ("rollout_importance_sampling_mode",
                                  self.rollout_importance_sampling_mode is not None)):
                if unused:
                    raise UserError(f"--{name} has no effect with --loss_type real (its loss is "
                                    f"per group, not per token): drop one of them")

    def _resolve_advantages(self):
        default = "none" if self.loss_type == "real" else \
            DEFAULT_SCALE_REWARDS[self.advantage_estimator]
        if self.scale_rewards is None:
            self.scale_rewards = default
        elif self.loss_type == "real" and self.scale_rewards != "none":
            raise UserError(f"--loss_type real classifies completions by the sign of the "
                            f"unscaled advantage: --scale_rewards must be none, got "
                            f"{self.scale_rewards}")
        if self.scale_rewards == "gdpo" and self.advantage_estimator != "grpo":
            raise UserError(f"--scale_rewards gdpo computes its own advantages (per reward "
                            f"function, then over the batch): it needs --advantage_estimator grpo, "
                            f"got {self.advantage_estimator}")
        if self.kl_in_reward is None:
            self.kl_in_reward = self.advantage_estimator != "grpo"
        elif self.kl_in_reward and self.scale_rewards == "gdpo":
            raise UserError("--scale_rewards gdpo normalises each reward function and cannot "
                            "take --kl_in_reward true: choose one")

    def _check_references(self):
        if len(self.ref_adapters) > 1:
            raise UserError(f"--ref_adapters takes one adapter directory, got {len(self.ref_adapters)}")
        for ours, theirs in (("mcore_ref_model", "ref_model"), ("mcore_ref_adapter", "ref_adapters")):
            if getattr(self, ours) and getattr(self, theirs):
                raise UserError(f"pass --{theirs} or --{ours}, not both")
        if self.sync_ref_model and self.ref_model_sync_steps < 1:
            raise UserError(f"--ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")
        if not 0 <= self.ref_model_mixup_alpha <= 1:
            raise UserError(f"--ref_model_mixup_alpha must be in [0, 1], got "
                            f"{self.ref_model_mixup_alpha}")
        if self.sync_ref_model and self.beta == 0:
            raise UserError("--sync_ref_model true needs a reference model: --beta > 0")

    def _check_teacher(self):
        if not self.has_teacher:
            for name in ("teacher_model_type", "teacher_model_revision", "offload_teacher_model"):
                if getattr(self, name):
                    raise UserError(f"--{name} needs --teacher_model")
            return
        if self.loss_type in ("real", "fipo"):
            raise UserError(f"--teacher_model makes advantages per token; --loss_type "
                            f"{self.loss_type} needs one advantage per completion: use grpo, "
                            f"bnpo, dr_grpo, dapo, cispo or sapo")
        if self.off_policy_sequence_mask_delta is not None:
            raise UserError("--off_policy_sequence_mask_delta needs one advantage per completion; "
                            "--teacher_model makes them per token: drop one of them")
        if self.dynamic_sample and (self.num_generations == 1 or not self.reward_funcs):
            raise UserError("--dynamic_sample resamples groups whose rewards all agree: with "
                            "--teacher_model it needs --reward_funcs and --num_generations >= 2")
        if self.scale_rewards == "gdpo" and not self.reward_funcs:
            raise UserError("--scale_rewards gdpo normalises reward functions: pass --reward_funcs")

    def _check_multi_turn(self):
        if self.use_gym_env is None:
            self.use_gym_env = self.gym_env is not None
        if self.max_turns is not None and self.max_turns < 1:
            raise UserError(f"--max_turns must be >= 1 (or none: no limit), got {self.max_turns}")
        if self.multi_turn_scheduler is None:
            for name, given in (("max_turns", self.max_turns is not None),
                                ("gym_env", self.gym_env is not None),
                                ("completion_length_limit_scope",
                                 self.completion_length_limit_scope != "per_round")):
                if given:
                    raise UserError(f"--{name} applies to multi-turn rollouts: pass "
                                    f"--multi_turn_scheduler (e.g. gym_scheduler with --gym_env)")

    @property
    def num_reward_columns(self) -> int:
        """Reward functions, reward models and the gym reward (--use_gym_env)."""
        return len(self.reward_funcs) + len(self.reward_model) + int(bool(self.use_gym_env))

    def _check_rewards(self):
        if self.reward_model_plugin and len(self.reward_model_plugin) != len(self.reward_model):
            raise UserError(f"--reward_model_plugin names {len(self.reward_model_plugin)} plugins "
                            f"for {len(self.reward_model)} --reward_model (one each)")
        scorers = self.num_reward_columns
        if self.reward_weights is not None and len(self.reward_weights) != scorers:
            gym = " and --use_gym_env (gym_reward)" if self.use_gym_env else ""
            raise UserError(f"--reward_weights has {len(self.reward_weights)} values but "
                            f"--reward_funcs and --reward_model{gym} name {scorers} rewards")
        if self.soft_cache_length is not None and self.soft_max_length is not None \
                and self.soft_cache_length >= self.soft_max_length:
            raise UserError("--soft_cache_length must be smaller than --soft_max_length")
