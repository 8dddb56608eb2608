"""`megatron demo`: the main job on an embedded tiny model and synthetic dataset, end to end.

It builds a tiny random Qwen3 (real byte-level BPE tokenizer, chat template) and a synthetic
math dataset under --output_dir, then runs the same commands a user would, each as its own
process, printing each command first:
  1. `megatron rlhf --dry_run true`        the batch plan
  2. `megatron export --test_convert_precision true`   HF vs Megatron logits
  3. `megatron rlhf ...`                   GRPO with the rewards in demo/rewards.py
and finally the reward curve, whether the reward rose, and where the run's report is (plots,
summary.md and completions.html under <output_dir>/grpo/report). A second demo into the same
--output_dir replaces the first one's run. About a minute on a 2-core CPU machine.
"""
import json
import os
import shutil
import subprocess
import sys
from typing import List

from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.report import REPORT_DIR
from swift_megatron.report.plots import matplotlib_available

logger = get_logger(__name__)
PLUGIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rewards.py")


def grpo_flags(model: str, dataset: str, out: str, train_iters: int) -> List[str]:
    return ["--model", model, "--dataset", dataset, "--external_plugins", PLUGIN,
            "--reward_funcs", "digit_ratio", "contains_answer", "--reward_weights", "1", "0",
            "--num_generations", "8", "--global_batch_size", "64", "--micro_batch_size", "8",
            "--max_completion_length", "12", "--train_iters", str(train_iters), "--beta", "0",
            "--lr", "3e-3", "--lr_decay_style", "constant", "--temperature", "1.0",
            "--report_to", "none", "--logging_steps", "1", "--log_completions", "true",
            "--output_dir", out, "--add_version", "false"]


def _megatron(argv: List[str]) -> None:
    print("\n$ megatron " + " ".join(argv), flush=True)
    code = subprocess.run([sys.executable, "-m", "swift_megatron.cli.main", *argv]).returncode
    if code:
        raise UserError(f"demo step `megatron {argv[0]}` failed with exit code {code}")


def reward_curve(out: str) -> List[dict]:
    with open(os.path.join(out, "logging.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_demo(output_dir: str, train_iters: int) -> List[dict]:
    from swift_megatron.fixtures import build_math_dataset, build_tiny_model

    model = build_tiny_model("qwen3", os.path.join(output_dir, "tiny-qwen3"))
    dataset = build_math_dataset(os.path.join(output_dir, "math.jsonl"), num_rows=256)
    out = os.path.join(output_dir, "grpo")
    shutil.rmtree(out, ignore_errors=True)   # a second demo starts over (its logs would append)
    flags = grpo_flags(model, dataset, out, train_iters)
    _megatron(["rlhf", *flags, "--dry_run", "true"])
    _megatron(["export", "--model", model, "--test_convert_precision", "true"])
    _megatron(["rlhf", *flags])
    curve = reward_curve(out)
    print("\nstep  reward(digit_ratio)  contains_answer")
    for row in curve:
        print(f"{row['step']:>4}  {row['reward/digit_ratio/mean']:>19.3f}  "
              f"{row['reward/contains_answer/mean']:>15.3f}")
    print("\n" + outcome(curve[0]["reward/mean"], curve[-1]["reward/mean"]) +
          f"; the trained model is in {out}/final_hf")
    drawn = "plots, summary.md, completions.html" if matplotlib_available() else \
        "summary.md, completions.html; no plots: pip install matplotlib, then megatron plot"
    print(f"report ({drawn}): {os.path.join(out, REPORT_DIR)}")
    return curve


def outcome(first: float, last: float) -> str:
    """What the reward did, as it happened (a tiny random model learns, but not on every seed)."""
    if last > first:
        return f"reward rose from {first:.3f} to {last:.3f}"
    return f"reward went from {first:.3f} to {last:.3f}: it did not rise in this run"
