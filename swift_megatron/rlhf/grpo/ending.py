"""The last lines of a `megatron rlhf` run: how far it got and in how long, where its final
model, its last and best checkpoints and its report are (ms-swift ends with its last and best
checkpoints). Pure: paths in, lines out."""
import os
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.report.summary import duration


@dataclass
class RunEnd:
    """What a run left: `final_model` (None when it stopped early), `final_adapter` (LoRA),
    `last` and `last_hf` (the last save, its HF copy or None), `best` ({"step", "reward"} of
    best_checkpoint.json, or None) with `best_path`, and `report` (summary.md, or None)."""

    step: int
    train_iters: int
    seconds: float
    save_dir: str
    last: str
    last_hf: Optional[str] = None
    final_model: Optional[str] = None
    final_adapter: Optional[str] = None
    best: Optional[dict] = None
    best_path: Optional[str] = None
    report: Optional[str] = None


def existing(*paths: Optional[str]) -> Optional[str]:
    """The first of `paths` that is a directory or file, else None."""
    return next((p for p in paths if p and os.path.exists(p)), None)


def closing_lines(end: RunEnd) -> List[str]:
    """The lines the run ends with, its model first."""
    took = duration(end.seconds)
    if end.step >= end.train_iters:
        lines = [f"finished: {end.train_iters} optimizer steps in {took}"]
    else:
        lines = [f"stopped at step {end.step} of {end.train_iters} after {took}; continue with "
                 f"--load {end.save_dir}"]
    if end.final_model:
        lines.append(f"final model (Hugging Face): {end.final_model}")
    if end.final_adapter:
        lines.append(f"final adapter (PEFT): {end.final_adapter}")
    hf_copy = f" (Hugging Face copy: {end.last_hf})" if end.last_hf else ""
    lines.append(f"last checkpoint: {end.last}{hf_copy}")
    if end.best and end.best_path:
        lines.append(f"best checkpoint: {end.best_path} (step {end.best['step']}, reward/mean "
                     f"{end.best['reward']:.4g})")
    if end.report:
        lines.append(f"report: {end.report}")
    return lines
