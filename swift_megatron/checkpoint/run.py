"""What a training run writes at each save, and where (ms-swift's conventions on top of ours).

    <dir>/iter_XXXXXXX/                  resumable checkpoint (checkpoint/trainer.py)
    <dir>/latest_checkpointed_iteration.txt
    <dir>/checkpoint-<step>/             --save_safetensors: the HF checkpoint of the policy
                                         (LoRA: its PEFT adapter)
    <dir>/checkpoint-<step>-merged/      LoRA with --merge_lora: the merged HF checkpoint
    <output_dir>/final_hf/               the trained model (hard links to the last save's HF
                                         files when it is the final step; else written)
    <output_dir>/final_adapter/          LoRA: the trained adapter

<dir> is --save, else the output directory. `--save_total_limit N` keeps the N newest saves,
never deleting the latest nor the one with the best reward/mean (ms-swift keeps "best and
last"). Every function is collective: call it on every rank.
"""
import json
import math
import os
import shutil
from typing import Callable, List, Optional

import torch.distributed as dist

from swift_megatron.paths import staging_dir, sweep_stale
from swift_megatron.checkpoint.run_dir import BEST_FILE
from swift_megatron.checkpoint.trainer import iteration_dir
from swift_megatron.logging import get_logger

logger = get_logger(__name__)


def hf_dir(save_dir: str, step: int, merged: bool = False) -> str:
    return os.path.join(save_dir, f"checkpoint-{step}" + ("-merged" if merged else ""))


def link_tree(source: str, target: str) -> None:
    """`target` as a copy of `source` whose files are hard links (no second copy on disk),
    published by renaming a temporary directory. Global rank 0 only."""
    sweep_stale(target)
    tmp = staging_dir(target)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(source, tmp, copy_function=os.link)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def saved_steps(save_dir: str) -> List[int]:
    """Steps with a resumable checkpoint in save_dir, oldest first."""
    steps = []
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        if name.startswith("iter_") and name[5:].isdigit():
            steps.append(int(name[5:]))
    return sorted(steps)


def read_best(save_dir: str) -> Optional[dict]:
    path = os.path.join(save_dir, BEST_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def record_best(save_dir: str, step: int, reward: Optional[float]) -> None:
    """Remember `step` as the best save when its reward/mean beats the recorded one (rank 0)."""
    if reward is None or not math.isfinite(reward):
        return
    best = read_best(save_dir)
    if best is None or reward > best["reward"] or best["step"] not in saved_steps(save_dir):
        tmp = os.path.join(save_dir, BEST_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"step": step, "reward": reward}, f)
        os.replace(tmp, os.path.join(save_dir, BEST_FILE))


def rotate(save_dir: str, limit: Optional[int]) -> List[int]:
    """Delete the oldest saves beyond `limit` (keeping the latest and the best); returns the
    deleted steps. Global rank 0 only."""
    steps = saved_steps(save_dir)
    if not limit or len(steps) <= limit:
        return []
    best = read_best(save_dir)
    keep = {steps[-1]} | ({best["step"]} if best else set())
    removable = [s for s in steps if s not in keep]
    doomed = removable[:max(0, len(steps) - limit)]
    for step in doomed:
        for path in (iteration_dir(save_dir, step), hf_dir(save_dir, step),
                     hf_dir(save_dir, step, merged=True)):
            shutil.rmtree(path, ignore_errors=True)
    return doomed


def on_rank0(fn: Callable[[], None]) -> None:
    """Run fn on global rank 0, then let every rank continue together."""
    if dist.get_rank() == 0:
        fn()
    dist.barrier()
