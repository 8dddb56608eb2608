"""Where a training run starts from, as ms-swift's flags say it (checkpoint/sources.py finds
what a path holds):

- base weights: `--model` (an HF checkpoint, through the bridge), or `--mcore_model`: a Megatron
  model directory or training checkpoint of ours, or an ms-swift Megatron checkpoint;
- LoRA adapters: `--adapters` or `--mcore_adapter`: a PEFT adapter, a LoRA training checkpoint of
  ours (its `adapter/`), or an ms-swift LoRA checkpoint (its PEFT files, else its adapter tensors
  converted to PEFT at load time);
- training state (optimizer, RNG, step, data position): `--load` resumes a save directory or
  checkpoint of ours; `--mcore_model` / `--mcore_adapter` resume it only with `--finetune false`
  (ms-swift's default `--finetune true` loads weights only and starts at step 0). An ms-swift
  checkpoint's training state is ms-swift's own format: its weights load, the run starts at
  step 0, and a notice says so.
"""
import dataclasses
import json
import os
from typing import List, Optional

from swift_megatron.arguments.lora import LoraArguments
from swift_megatron.arguments.training import TrainingArguments
from swift_megatron.checkpoint.integrity import check_checkpoint_files
from swift_megatron.checkpoint.ms_swift import LATEST, is_ms_swift_checkpoint, read_ms_swift_checkpoint
from swift_megatron.checkpoint.sources import (OUR_META, AdapterSource, WeightsSource,
                                               adapter_source, mcore_source, our_model_dir)
from swift_megatron.errors import UserError


@dataclasses.dataclass(frozen=True)
class Start:
    weights: Optional[WeightsSource]    # the base weights (None: --model through the bridge)
    adapter: Optional[AdapterSource]    # the LoRA adapter to continue
    resume_dir: Optional[str]           # our training checkpoint whose state to resume
    notices: List[str] = dataclasses.field(default_factory=list)


def _resumable(path: str, flag: str) -> Optional[str]:
    """Our checkpoint directory behind `path`, or None for an ms-swift checkpoint."""
    if not os.path.isdir(path):
        raise UserError(f"--{flag} {path}: no such directory")
    ours = our_model_dir(path)
    if ours is None and not is_ms_swift_checkpoint(path):
        raise UserError(f"--{flag} {path}: neither a save directory of ours ({LATEST} naming an "
                        f"iter_* directory with {OUR_META}), one of its iter_* directories, nor "
                        "an ms-swift Megatron checkpoint")
    return ours


def plan_start(training: TrainingArguments, lora: LoraArguments) -> Start:
    """The sources of the module docstring (UserError when a path holds none of them)."""
    t, notices = training, []
    weights = mcore_source(t.mcore_model, "--mcore_model") if t.mcore_model else None
    if lora.adapters and t.mcore_adapter:
        raise UserError("pass --adapters or --mcore_adapter, not both")
    adapter = None
    if lora.adapters or t.mcore_adapter:
        flag = "--mcore_adapter" if t.mcore_adapter else "--adapters"
        adapter = adapter_source(t.mcore_adapter or lora.adapters[0], flag)
    resume = None
    if t.load:
        resume = _resumable(t.load, "load")
        if resume is None:
            weights, adapter = _ms_swift_load(t.load, weights, adapter)
            notices.append(f"--load {t.load} is an ms-swift checkpoint: its weights load, its "
                           "optimizer and step (ms-swift's format) do not; training starts at "
                           "step 0")
    elif not t.finetune and (t.mcore_adapter or t.mcore_model):
        path = t.mcore_adapter or t.mcore_model
        resume = _resumable(path, "mcore_adapter" if t.mcore_adapter else "mcore_model")
        if resume is None:
            notices.append(f"--finetune false: {path} is an ms-swift checkpoint, whose optimizer "
                           "and step are in ms-swift's format: its weights load, training "
                           "starts at step 0")
    if resume:   # --mcore_model's and --mcore_adapter's directories: checkpoint/sources.py
        check_checkpoint_files(resume)
    return Start(weights, adapter, resume, notices)


def _ms_swift_load(path: str, weights: Optional[WeightsSource], adapter: Optional[AdapterSource]):
    """--load of an ms-swift checkpoint: its full weights, or its LoRA adapter (as ms-swift's
    --mcore_adapter), unless another flag already gives that part."""
    if read_ms_swift_checkpoint(path).tuner_type == "full":
        if weights is not None:
            raise UserError(f"--load {path} (an ms-swift full checkpoint) and --mcore_model both "
                            "give the base weights: pass one")
        return mcore_source(path, "--load"), adapter
    if adapter is not None:
        raise UserError(f"--load {path} (an ms-swift LoRA checkpoint) and --adapters/"
                        "--mcore_adapter both give the adapter: pass one")
    return weights, adapter_source(path, "--load")


def check_resume_step(resume_dir: Optional[str], train_iters: int) -> None:
    """UserError when the checkpoint to resume (its trainer_state.json) is past `train_iters`
    optimizer steps (--train_iters, or what --num_train_epochs makes of the dataset; 0: not
    known yet). A checkpoint exactly at train_iters resumes as a finished run."""
    path = os.path.join(resume_dir, "trainer_state.json") if resume_dir else None
    if not train_iters or path is None or not os.path.isfile(path):
        return
    with open(path) as f:
        step = int(json.load(f).get("step", 0))
    if step > train_iters:
        raise UserError(f"{resume_dir} is at step {step}, beyond this run's {train_iters} "
                        "optimizer steps (--train_iters / --num_train_epochs): raise them to "
                        "continue training")


LAYOUT_FLAGS = {"tp": "--tensor_model_parallel_size", "pp": "--pipeline_model_parallel_size",
                "ep": "--expert_model_parallel_size", "etp": "--expert_tensor_parallel_size",
                "first": "--decoder_first_pipeline_num_layers",
                "last": "--decoder_last_pipeline_num_layers",
                "grouped_experts": "--moe_grouped_gemm"}
UNEVEN = ("first", "last")   # absent from saved_with: an even split (none)


def _shown(value) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else \
        str(value)


def check_resume_layout(resume_dir: Optional[str], parallel, load_optim: bool,
                        grouped_experts: Optional[bool] = None) -> None:
    """Resuming the optimizer state needs the model-parallel layout it was saved with (megatron
    reshards the weights across TP/PP/EP, not the distributed optimizer's buffers; the DP size
    may change), and a MoE model's experts in the same form (`grouped_experts`:
    --moe_grouped_gemm of a run that trains them, None otherwise; grouped and per-expert weights
    load into each other, their optimizer buffers do not). UserError naming the flags to keep,
    or --no_load_optim."""
    if resume_dir is None or not load_optim or \
            not os.path.isdir(os.path.join(resume_dir, "optimizer")):
        return
    with open(os.path.join(resume_dir, OUR_META)) as f:
        saved = json.load(f).get("saved_with") or {}
    now = {"tp": parallel.tensor_model_parallel_size, "pp": parallel.pipeline_model_parallel_size,
           "ep": parallel.expert_model_parallel_size, "etp": parallel.expert_tensor_parallel_size,
           "first": parallel.decoder_first_pipeline_num_layers,
           "last": parallel.decoder_last_pipeline_num_layers,
           "grouped_experts": grouped_experts}
    saved = {**dict.fromkeys(UNEVEN), **saved}
    moe = max(saved.get("ep", 1), now["ep"]) > 1   # ETP matters only with expert parallelism
    changed = [f"{LAYOUT_FLAGS[k]} {_shown(saved[k])} (this run: {_shown(now[k])})"
               for k in LAYOUT_FLAGS if k in saved and saved[k] != now[k]
               and (k != "etp" or moe) and (k != "grouped_experts" or now[k] is not None)]
    if changed:
        raise UserError(f"{resume_dir} was saved with {', '.join(changed)}: its optimizer state "
                        "resumes only in that layout. Keep those values, or pass --no_load_optim "
                        "true to resume the weights, step and data position with a fresh "
                        "optimizer (the weights reshard to any layout)")
