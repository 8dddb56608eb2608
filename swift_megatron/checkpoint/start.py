"""Where a training run starts from, as ms-swift's flags say it:

- base weights: `--model` (an HF checkpoint, through the bridge), or `--mcore_model` (a Megatron
  model directory or training checkpoint of ours);
- LoRA adapters: `--adapters` (PEFT), or the adapter of `--mcore_adapter` (a LoRA training
  checkpoint of ours: its `adapter/`);
- training state (optimizer, RNG, step, data position): `--load` always resumes; `--mcore_model`
  / `--mcore_adapter` resume only with `--finetune false` (ms-swift's default `--finetune true`
  loads weights only and starts at step 0).
"""
import dataclasses
import os
from typing import Optional

from swift_megatron.arguments.lora import LoraArguments
from swift_megatron.arguments.training import TrainingArguments
from swift_megatron.errors import UserError


@dataclasses.dataclass(frozen=True)
class Start:
    weights_dir: Optional[str]   # Megatron model directory with the base weights (else --model)
    adapter_dir: Optional[str]   # PEFT adapter directory to load
    resume_dir: Optional[str]    # training checkpoint whose state to resume


def _checkpoint(flag: str, path: str) -> str:
    from swift_megatron.checkpoint.trainer import resolve_load_dir

    if not os.path.isdir(path):
        raise UserError(f"--{flag} {path}: no such directory")
    try:
        return resolve_load_dir(path)
    except UserError as error:
        raise UserError(f"--{flag} {path}: {error}") from None


def plan_start(training: TrainingArguments, lora: LoraArguments) -> Start:
    """The three sources of the module docstring, resolved to directories (UserError when a
    directory is missing or is not a checkpoint)."""
    t = training
    weights = _checkpoint("mcore_model", t.mcore_model) if t.mcore_model else None
    adapter = lora.adapters[0] if lora.adapters else None
    adapter_ckpt = _checkpoint("mcore_adapter", t.mcore_adapter) if t.mcore_adapter else None
    if adapter_ckpt:
        if adapter:
            raise UserError("pass --adapters (a PEFT adapter) or --mcore_adapter, not both")
        adapter = os.path.join(adapter_ckpt, "adapter")
        if not os.path.isdir(adapter):
            raise UserError(f"--mcore_adapter {t.mcore_adapter}: no adapter/ directory (is it a "
                            f"checkpoint of a --train_type lora run?)")
    resume = _checkpoint("load", t.load) if t.load else None
    if not t.finetune and resume is None:
        resume = adapter_ckpt or weights
    return Start(weights, adapter, resume)
