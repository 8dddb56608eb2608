"""Training flags: tuner, optimizer and schedule, length of the run, checkpoints, logging; and
the completion-level batch sizes."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

REPORT_TARGETS = ("tensorboard", "wandb", "swanlab", "none")


@dataclass
class TrainingArguments:
    """Training"""

    train_type: str = arg("full", "full: train every weight; lora: train LoRA adapters only.",
                          choices=["full", "lora"], aliases=["tuner_type"])
    lr: Optional[float] = arg(None, "Peak learning rate. Default: 1e-5 for full, 1e-4 for lora.")
    min_lr: float = arg(0.0, "Learning rate at the end of the decay.")
    lr_decay_style: str = arg("cosine", "Decay after warmup.",
                              choices=["cosine", "linear", "constant"])
    lr_warmup_iters: int = arg(0, "Warmup optimizer steps (linear from 0 to --lr).")
    lr_warmup_fraction: Optional[float] = arg(None, "Warmup as a fraction of --train_iters; "
                                              "overrides --lr_warmup_iters.")
    weight_decay: float = arg(0.1, "AdamW weight decay.")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.95, "Adam beta2.")
    clip_grad: float = arg(1.0, "Clip the global gradient norm to this value (0 disables).")
    train_iters: Optional[int] = arg(None, "Optimizer steps to run. Default: --num_train_epochs "
                                     "passes over the prompts.")
    num_train_epochs: Optional[int] = arg(None, "Passes over the prompt dataset when "
                                          "--train_iters is not given (default 1).")
    seed: int = arg(42, "Random seed for data order, initialisation and sampling.")
    save: Optional[str] = arg(None, "Directory for checkpoints (and the final HF weights).")
    save_interval: Optional[int] = arg(None, "Save a checkpoint every N optimizer steps "
                                       "(and always at the end when --save is given).")
    load: Optional[str] = arg(None, "Resume from this checkpoint directory (a --save directory).")
    no_save_optim: bool = arg(False, "Do not save optimizer and scheduler state.")
    no_save_rng: bool = arg(False, "Do not save RNG state.")
    exit_interval: Optional[int] = arg(None, "Stop after this many optimizer steps (saving a "
                                       "checkpoint when --save is given), e.g. to split a long "
                                       "run into jobs that each resume with --load.")
    log_interval: int = arg(1, "Log metrics every N optimizer steps.")
    eval_interval: Optional[int] = arg(None, "Evaluate on --val_dataset every N optimizer steps.")
    report_to: List[str] = arg(["tensorboard"], "Metric sinks besides the console and "
                               "logging.jsonl: tensorboard, wandb, swanlab or none.",
                               choices=list(REPORT_TARGETS))
    output_dir: Optional[str] = arg(None, "Where logs, completions and the final model go. "
                                    "Default: --save, else output/<time>.")
    dry_run: bool = arg(False, "Print the batch plan for the world size NPROC_PER_NODE x NNODES "
                        "would launch, check the model-dependent rules when --model is readable, "
                        "and exit without launching or loading anything.")

    def __post_init__(self):
        for name in ("train_iters", "num_train_epochs", "save_interval", "eval_interval",
                     "exit_interval"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        if self.log_interval < 1:
            raise UserError(f"--log_interval must be >= 1, got {self.log_interval}")
        if self.lr_warmup_fraction is not None and not 0 <= self.lr_warmup_fraction < 1:
            raise UserError(f"--lr_warmup_fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.lr is None:
            self.lr = 1e-4 if self.train_type == "lora" else 1e-5
        if self.train_iters is None and self.num_train_epochs is None:
            self.num_train_epochs = 1
        if "none" in self.report_to:
            self.report_to = []


@dataclass
class BatchArguments:
    """Batch sizes (completion level: one completion is one sample)"""

    micro_batch_size: int = arg(1, "Completions per forward/backward pass on one data-parallel rank.")
    global_batch_size: int = arg(16, "Completions per optimizer step over all data-parallel ranks: "
                                 "micro_batch_size x dp_size x gradient accumulation steps.")

    def __post_init__(self):
        for name in ("micro_batch_size", "global_batch_size"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name} must be >= 1, got {getattr(self, name)}")
