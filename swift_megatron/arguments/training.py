"""Training flags: tuner, optimizer and schedule, length of the run, checkpoints, logging; and
the completion-level batch sizes. Names and defaults are ms-swift's (`--save_steps`,
`--logging_steps`, `--eval_steps`, `--output_dir`); Megatron-LM's names are aliases."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg, check_seed, refuse_empty
from swift_megatron.errors import UserError

REPORT_TARGETS = ("tensorboard", "wandb", "swanlab", "none")


def check_lr_bounds(values) -> None:
    """--min_lr and --lr_warmup_init must not exceed --lr (`values`: the training flags or the
    optimizer settings built from them)."""
    if values.min_lr > values.lr:
        raise UserError(f"--min_lr {values.min_lr} must not exceed --lr {values.lr}")
    if values.lr_warmup_init > values.lr:
        raise UserError(f"--lr_warmup_init {values.lr_warmup_init} must not exceed "
                        f"--lr {values.lr}")
ADAM_STATE_DTYPES = ("fp32", "bf16", "fp16", "fp8")
_LOW_PRECISION_STATES = {dtype: "fp16 and fp8 Adam states need Transformer Engine's scaled "
                                "states; bf16 works" for dtype in ("fp16", "fp8")}
LR_DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass
class TrainingArguments:
    """Training"""

    train_type: str = arg("full", "full: train every weight; lora: train LoRA adapters only; "
                          "lora_llm (vision-language models, as ms-swift): LoRA adapters on the "
                          "language model, the vision tower and aligner trained in full.",
                          choices=["full", "lora", "lora_llm"], aliases=["tuner_type"])
    # Optimizer and schedule
    lr: Optional[float] = arg(None, "Peak learning rate. Default: 1e-5 for full, 1e-4 for lora "
                              "and lora_llm.")
    min_lr: float = arg(0.0, "Learning rate at the end of the decay.")
    vit_lr: Optional[float] = arg(None, "Vision-language models: peak learning rate of the "
                                  "vision tower (its merger excepted), which trains with "
                                  "--freeze_vit false or --train_type lora_llm; it follows the "
                                  "--lr schedule scaled by vit_lr / lr (its minimum is "
                                  "min_lr x vit_lr / lr). Default: --lr (as ms-swift).")
    aligner_lr: Optional[float] = arg(None, "Vision-language models: peak learning rate of the "
                                      "aligner (the vision tower's merger), which trains with "
                                      "--freeze_aligner false or --train_type lora_llm; scaled "
                                      "with the schedule as --vit_lr. Default: --lr (as "
                                      "ms-swift).")
    lr_decay_style: str = arg("cosine", "Decay after warmup (WSD: constant, then a final decay "
                              "of --lr_wsd_decay_iters steps).", choices=list(LR_DECAY_STYLES))
    lr_decay_iters: Optional[int] = arg(None, "Optimizer steps of warmup + decay. Default: "
                                        "--train_iters.")
    lr_warmup_iters: int = arg(0, "Warmup optimizer steps (linear from --lr_warmup_init to --lr).")
    lr_warmup_fraction: Optional[float] = arg(None, "Warmup as a fraction of --lr_decay_iters; "
                                              "overrides --lr_warmup_iters.")
    lr_warmup_init: float = arg(0.0, "Learning rate at the start of the warmup.")
    lr_wsd_decay_style: str = arg("exponential", "WSD: shape of the final decay.",
                                  choices=list(WSD_DECAY_STYLES))
    lr_wsd_decay_iters: Optional[int] = arg(None, "WSD: optimizer steps of the final decay "
                                            "(required with --lr_decay_style WSD).")
    weight_decay: float = arg(0.1, "AdamW weight decay.")
    weight_decay_incr_style: str = arg("constant", "How weight decay moves over the run "
                                       "(megatron's schedule, by optimizer step): constant "
                                       "(--weight_decay throughout), or linear / cosine from "
                                       "--start_weight_decay to --end_weight_decay.",
                                       choices=["constant", "linear", "cosine"])
    start_weight_decay: Optional[float] = arg(None, "Weight decay at the first step (with "
                                              "--weight_decay_incr_style linear or cosine).")
    end_weight_decay: Optional[float] = arg(None, "Weight decay at the last step (with "
                                            "--weight_decay_incr_style linear or cosine).")
    apply_wd_to_qk_layernorm: bool = arg(False, "Apply weight decay to the query and key norms "
                                         "of q/k-norm models (Qwen3, Qwen3.5), which are "
                                         "exempt otherwise like every 1-D parameter.")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.95, "Adam beta2.")
    adam_eps: float = arg(1e-8, "Adam epsilon.")
    clip_grad: float = arg(1.0, "Clip the global gradient norm to this value (0 disables).")
    max_skipped_steps: int = arg(3, "An optimizer step whose global gradient norm is NaN or "
                                 "inf is skipped (weights, optimizer state and schedule "
                                 "untouched; logged as update_skipped); this many skipped steps "
                                 "in a row stop the run with an error (0: never stop).")
    optimizer_cpu_offload: bool = arg(False, "Keep the optimizer state (a fraction of it, "
                                      "--optimizer_offload_fraction) in host memory and run its "
                                      "update on the CPU (megatron-core's hybrid optimizer; "
                                      "needs CUDA, --use_distributed_optimizer true, "
                                      "--use_precision_aware_optimizer true and bf16/fp16 "
                                      "training).")
    optimizer_offload_fraction: float = arg(1.0, "Fraction of the optimizer state offloaded by "
                                            "--optimizer_cpu_offload.")
    use_precision_aware_optimizer: bool = arg(False, "The precision-aware optimizer: Adam's "
                                              "states in --exp_avg_dtype / --exp_avg_sq_dtype "
                                              "(float32 main parameters and gradients in the "
                                              "distributed optimizer). With "
                                              "--optimizer_cpu_offload true megatron-core's "
                                              "hybrid optimizer keeps them, in float32.")
    exp_avg_dtype: str = arg("fp32", "With --use_precision_aware_optimizer: dtype in which "
                             "Adam keeps its first moment (bf16 halves its memory; the update "
                             "is computed in float32).", choices=ADAM_STATE_DTYPES,
                             not_yet=_LOW_PRECISION_STATES)
    exp_avg_sq_dtype: str = arg("fp32", "With --use_precision_aware_optimizer: dtype in which "
                                "Adam keeps its second moment (as --exp_avg_dtype).",
                                choices=ADAM_STATE_DTYPES, not_yet=_LOW_PRECISION_STATES)
    main_params_dtype: str = arg("fp32", "With --use_precision_aware_optimizer: dtype of the "
                                 "optimizer's main parameters (fp32 only here).",
                                 choices=["fp32", "fp16"],
                                 not_yet={"fp16": "main parameters below float32 need "
                                                  "Transformer Engine's FusedAdam"})
    main_grads_dtype: str = arg("fp32", "With --use_precision_aware_optimizer: dtype of the "
                                "main gradients (fp32 only here).", choices=["fp32", "bf16"],
                                not_yet={"bf16": "gradients are accumulated and reduced in "
                                                 "float32"})
    # Length of the run
    train_iters: Optional[int] = arg(None, "Optimizer steps to run. Default: --num_train_epochs "
                                     "passes over the prompts.")
    num_train_epochs: Optional[int] = arg(None, "Passes over the prompt dataset when "
                                          "--train_iters is not given (default 1).")
    exit_interval: Optional[int] = arg(None, "Stop after this many optimizer steps (saving a "
                                       "checkpoint), e.g. to split a long run into jobs that each "
                                       "resume with --load.")
    seed: int = arg(42, "Random seed for data order, initialisation and sampling, in "
                    "[0, 2**32 - 1].")
    # Checkpoints
    output_dir: Optional[str] = arg(None, "Where logs, completions, checkpoints (unless --save "
                                    "is given) and the final model go. Default: "
                                    "megatron_output/<model name>. A v<N>-<time> subdirectory is "
                                    "added unless --add_version false.")
    add_version: bool = arg(True, "Write into a new <output_dir>/v<N>-<YYYYMMDD-HHMMSS> "
                            "directory, so runs never overwrite each other.")
    save: Optional[str] = arg(None, "Directory for checkpoints (Megatron-LM's name). Default: the "
                              "output directory.")
    save_steps: int = arg(500, "Save a checkpoint every N optimizer steps, and at the end.",
                          aliases=["save_interval"])
    save_safetensors: bool = arg(True, "At every save also write the weights as a Hugging Face "
                                 "checkpoint, <save>/checkpoint-<step> (LoRA: the adapter in PEFT "
                                 "format, and with --merge_lora the merged model in "
                                 "checkpoint-<step>-merged).")
    merge_lora: Optional[bool] = arg(None, "LoRA: with --save_safetensors, also write the merged "
                                     "model at every save. Default: --save_safetensors.")
    save_total_limit: Optional[int] = arg(None, "Keep at most N checkpoints (>= 2): the oldest "
                                          "are deleted, never the latest nor the one with the "
                                          "best reward/mean.")
    no_save_optim: bool = arg(False, "Do not save optimizer and scheduler state.")
    no_save_rng: bool = arg(False, "Do not save RNG state.")
    load: Optional[str] = arg(None, "Resume from this checkpoint directory (a save directory or "
                              "one iter_* directory): weights, optimizer, RNG, step and data "
                              "position.")
    mcore_model: Optional[str] = arg(None, "Start from the weights of this Megatron checkpoint "
                                     "(ours, or ms-swift's torch_dist) instead of --model's; with "
                                     "--finetune false, resume its training state too.")
    mcore_adapter: Optional[str] = arg(None, "LoRA: start from the adapters of this Megatron "
                                       "checkpoint; with --finetune false, resume its training "
                                       "state too.")
    finetune: bool = arg(True, "With --mcore_model / --mcore_adapter: load the weights only and "
                         "start at step 0. false: resume optimizer, RNG, step and data position "
                         "(--load always resumes).")
    no_load_optim: bool = arg(False, "When resuming, do not load the optimizer state.")
    no_load_rng: bool = arg(False, "When resuming, do not load the RNG state.")
    # Logging and evaluation
    logging_steps: int = arg(5, "Log metrics every N optimizer steps.", aliases=["log_interval"])
    eval_steps: Optional[int] = arg(None, "Evaluate on the validation prompts every N optimizer "
                                    "steps. Default: --save_steps, when there are validation "
                                    "prompts.", aliases=["eval_interval"])
    report_to: List[str] = arg(["tensorboard"], "Metric sinks besides the console and "
                               "logging.jsonl: tensorboard, wandb, swanlab or none.",
                               choices=list(REPORT_TARGETS))
    tensorboard_dir: Optional[str] = arg(None, "Tensorboard event directory. Default: "
                                         "<output_dir>/runs.")
    wandb_project: str = arg("megatron-swift", "wandb project.")
    wandb_exp_name: Optional[str] = arg(None, "wandb run name. Default: the output directory.")
    swanlab_project: str = arg("megatron-swift", "swanlab project.")
    swanlab_exp_name: Optional[str] = arg(None, "swanlab experiment name. Default: the output "
                                          "directory.")
    eval_iters: int = arg(-1, "Evaluation batches per evaluation, as ms-swift: -1 (the "
                          "default) evaluates every validation prompt, 0 turns evaluation off; "
                          "choose how many prompts with --val_dataset FILE#N or "
                          "--split_dataset_ratio.")
    tensorboard_queue_size: int = arg(50, "ms-swift: tensorboard events held in memory before "
                                      "they are written to disk.",
                                      no_effect="the tensorboard events are written at every "
                                                "logged step")
    max_shard_size: str = arg("5GB", "Largest safetensors shard of the HF checkpoints written "
                              "at each save (e.g. 5GB, 500MB).")
    save_missing_weights: bool = arg(False, "ms-swift: copy the source checkpoint's weights "
                                     "that the Megatron model does not hold into HF "
                                     "checkpoints.",
                                     no_effect="always done (Qwen3.5's multi-token prediction "
                                               "head is copied from the source checkpoint)")
    dry_run: bool = arg(False, "Print the batch plan for the world size NPROC_PER_NODE x NNODES "
                        "would launch, check everything that needs no weights (model config, "
                        "datasets, plugins and reward names, --system file, launch variables) "
                        "and exit without launching or loading anything.")

    @property
    def uses_lora(self) -> bool:
        """Whether the language model trains through LoRA adapters (lora and lora_llm)."""
        return self.train_type in ("lora", "lora_llm")

    def __post_init__(self):
        for name in ("train_iters", "num_train_epochs", "save_steps", "eval_steps",
                     "exit_interval", "logging_steps", "lr_decay_iters", "lr_wsd_decay_iters"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        self._check_optimizer_values()
        check_seed("seed", self.seed)
        refuse_empty(self, ("output_dir", "save", "load", "mcore_model", "mcore_adapter",
                            "tensorboard_dir"))
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction < 1:
            raise UserError(f"--lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.lr_decay_style == "WSD" and self.lr_wsd_decay_iters is None:
            raise UserError("--lr_decay_style WSD needs --lr_wsd_decay_iters (the steps of the "
                            "final decay)")
        self._check_weight_decay_schedule()
        if self.eval_iters not in (-1, 0):
            raise UserError(f"--eval_iters {self.eval_iters}: every evaluation covers all "
                            "validation prompts (-1, the default) or none (0); choose how many "
                            "with --val_dataset FILE#N or --split_dataset_ratio")
        if not 0 < self.optimizer_offload_fraction <= 1:
            raise UserError(f"--optimizer_offload_fraction must be in (0, 1], got "
                            f"{self.optimizer_offload_fraction}")
        if self.save_total_limit is not None and self.save_total_limit < 2:
            raise UserError(f"--save_total_limit must be >= 2 (the latest and the best "
                            f"checkpoint), got {self.save_total_limit}")
        if self.load and (self.mcore_model or self.mcore_adapter):
            raise UserError("pass --load (resume a run of ours) or --mcore_model/--mcore_adapter "
                            "(with --finetune), not both")
        if self.train_iters is None and self.num_train_epochs is None:
            self.num_train_epochs = 1
        if self.merge_lora is None:
            self.merge_lora = self.save_safetensors
        if "none" in self.report_to:
            self.report_to = []

    @property
    def weight_decay_range(self) -> tuple:
        """(start, end) weight decay of megatron's schedule: --weight_decay twice when constant."""
        if self.weight_decay_incr_style == "constant":
            return self.weight_decay, self.weight_decay
        return self.start_weight_decay, self.end_weight_decay

    def _check_weight_decay_schedule(self) -> None:
        """ms-swift's (Megatron-LM's) rule: start/end with a changing style only, both then."""
        given = [n for n in ("start_weight_decay", "end_weight_decay") if getattr(self, n) is not None]
        if self.weight_decay_incr_style == "constant" and given:
            raise UserError(f"--{given[0]} needs --weight_decay_incr_style linear or cosine "
                            "(constant uses --weight_decay)")
        if self.weight_decay_incr_style != "constant" and len(given) < 2:
            raise UserError(f"--weight_decay_incr_style {self.weight_decay_incr_style} needs "
                            "--start_weight_decay and --end_weight_decay")
        if any(getattr(self, n) < 0 for n in given):
            raise UserError("--start_weight_decay and --end_weight_decay must be >= 0")

    def _check_optimizer_values(self) -> None:
        """Ranges of the optimizer and schedule values (NaN and inf are refused by the parser)."""
        if self.lr is not None and self.lr <= 0:
            raise UserError(f"--lr must be > 0, got {self.lr}")
        for name, freeze in (("vit_lr", "--freeze_vit"), ("aligner_lr", "--freeze_aligner")):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UserError(f"--{name} must be > 0, got {getattr(self, name)} (to keep those "
                                f"weights unchanged, leave {freeze} at true)")
        for name in ("min_lr", "lr_warmup_init", "weight_decay", "clip_grad"):
            if getattr(self, name) < 0:
                raise UserError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.max_skipped_steps < 0:
            raise UserError(f"--max_skipped_steps must be >= 0, got {self.max_skipped_steps}")
        if self.lr_warmup_iters < 0:
            raise UserError(f"--lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"--{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0:
            raise UserError(f"--adam_eps must be > 0, got {self.adam_eps}")


@dataclass
class BatchArguments:
    """Batch sizes (completion level: one completion is one sample)"""

    micro_batch_size: int = arg(1, "Completions per forward/backward pass on one data-parallel rank.")
    global_batch_size: int = arg(16, "Completions per optimizer step over all data-parallel ranks: "
                                 "micro_batch_size x dp_size x gradient accumulation steps.")
    max_tokens_per_micro_batch: Optional[int] = arg(
        None, "Form each optimizer step's micro-batches by a token budget instead of "
        "--micro_batch_size completions: consecutive completions whose prompt + completion tokens "
        "add up to at most this many (a longer one alone), as verl's dynamic batch size. Fewer, "
        "fuller micro-batches when completions are short; the loss is the same, except bnpo's, "
        "which is a per-micro-batch mean.")

    def __post_init__(self):
        for name in ("micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise UserError(f"--max_tokens_per_micro_batch must be >= 1, got "
                            f"{self.max_tokens_per_micro_batch}")
