"""`--auto_parallel` on the GPU: its choice against a small grid of hand-picked layouts for the
same work, each run once in this command (trl_compare.py's GRPO workload, ours only).
Feeds docs/gpu.md, "Not yet measured on the current code" until its first GPU run (device_run.sh's
auto_grid*).

    python benchmarks/auto_grid.py --preset qwen2.5-1.5b                  # one GPU: GRIDS[1]
    python benchmarks/auto_grid.py --preset qwen3-8b --nproc 2            # two GPUs: GRIDS[2]
    python benchmarks/auto_grid.py --preset qwen3-8b --lora 16            # LoRA rank 16
    python benchmarks/auto_grid.py --grid tp2="--tensor_model_parallel_size 2" ...   # own grid

Every run gets trl_compare's command without its fixed `--recompute_granularity none`: the grid
layouts set their own flags, and the `auto` run sets `--auto_parallel true` alone (the planner
keeps flags a user sets, so it must see none of the layout flags). Per run: seconds per rollout
batch (the first `--warmup_batches` left out), the training's measured peak memory and the dry
run's estimate of it (dry_run_memory.py's `memory_check`). Passes (exit 0) when the automatic choice
ran, its seconds per rollout batch are within 10% of the fastest grid layout that ran, and every
run's estimate is within 10% of its measured peak. One JSON line per run (trl_compare's summary
line), then a `verdict` line and a table.
"""
import argparse
import os
import sys
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trl_compare import emit, parse_variant, prepare, rounded, run_ours  # noqa: E402

TOLERANCE = 0.10
AUTO = ("auto", ["--auto_parallel", "true"])
GRIDS: Dict[int, List[Tuple[str, str]]] = {
    # one GPU: recomputation and the micro-batch token budget (ms-swift's default is selective)
    1: [("selective", "--recompute_granularity selective"),
        ("none_8k", "--recompute_granularity none --max_tokens_per_micro_batch 8192"),
        ("selective_16k", "--recompute_granularity selective --max_tokens_per_micro_batch 16384"),
        ("full_16k", "--recompute_granularity full --recompute_method uniform "
                     "--recompute_num_layers 1 --max_tokens_per_micro_batch 16384")],
    # two GPUs: data, tensor (with and without sequence parallelism) and pipeline parallel
    2: [("dp2", "--recompute_granularity selective"),
        ("tp2", "--tensor_model_parallel_size 2 --recompute_granularity selective"),
        ("tp2_sp", "--tensor_model_parallel_size 2 --sequence_parallel true "
                   "--recompute_granularity selective"),
        ("pp2", "--pipeline_model_parallel_size 2 --recompute_granularity selective")],
}


def fastest(results: Dict[str, dict]) -> Optional[str]:
    """The grid layout (not `auto`) with the fewest seconds per rollout batch."""
    grid = {k: r for k, r in results.items() if k != "auto"}
    return min(grid, key=lambda k: grid[k]["wall_s"]) if grid else None


def verdict(results: Dict[str, dict]) -> List[str]:
    """What failed: the automatic choice did not run, was more than 10% slower than the fastest
    grid layout, or a run's estimate was more than 10% off its measured peak."""
    failed = []
    best = fastest(results)
    if "auto" not in results:
        failed.append("the automatic choice did not run")
    elif best and results["auto"]["wall_s"] > (1 + TOLERANCE) * results[best]["wall_s"]:
        failed.append(f"auto {results['auto']['wall_s']:.2f} s per rollout batch, more than "
                      f"{TOLERANCE:.0%} slower than {best}'s {results[best]['wall_s']:.2f} s")
    for label, r in results.items():
        ratio = r.get("estimate_vs_training")
        if ratio is None or abs(ratio - 1) > TOLERANCE:
            failed.append(f"{label}: estimate / measured peak {ratio} outside 1 +- {TOLERANCE}")
    return failed


def table(runs: List[str], results: Dict[str, dict]) -> str:
    lines = ["| layout | s per rollout batch | vs fastest grid | training peak GiB | estimate GiB "
             "| estimate / peak |", "|---|---|---|---|---|---|"]
    best = fastest(results)
    for label in runs:
        r = results.get(label)
        if r is None:
            lines.append(f"| {label} | failed (out of memory or an error: its log) | | | | |")
            continue
        versus = f"{r['wall_s'] / results[best]['wall_s']:.2f}x" if best else "-"
        estimate = max(r.get("estimate/train_gib", 0), r.get("estimate/logprobs_gib", 0))
        lines.append(f"| {label} | {r['wall_s']:.2f} | {versus} | {r.get('training_gib', 0):.1f} "
                     f"| {estimate:.1f} | {r.get('estimate_vs_training') or 0:.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen2.5-1.5b")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs (the grid of that count)")
    parser.add_argument("--rollout_batches", type=int, default=3)
    parser.add_argument("--warmup_batches", type=int, default=1)
    parser.add_argument("--completion_length", type=int, default=256)
    parser.add_argument("--lora", type=int, default=0, metavar="RANK")
    parser.add_argument("--grid", action="append", default=[], metavar='NAME="FLAGS"',
                        help="the hand-tried layouts (repeatable; default GRIDS[--nproc])")
    parser.add_argument("--work_dir", default="/tmp/auto_grid")
    parser.add_argument("rlhf_args", nargs="*", help="flags every run gets (the work)")
    a = parser.parse_args()
    a.variable_length, a.sleep_level, a.free_layout = False, 1, True
    grid = [parse_variant(g) for g in a.grid] or [(k, v.split()) for k, v in GRIDS[a.nproc]]
    os.makedirs(a.work_dir, exist_ok=True)
    model, task = prepare(a)
    results = {}
    for label, flags in [AUTO, *grid]:
        try:
            results[label] = run_ours(a, model, task, label, flags)
        except Exception as error:   # e.g. out of memory: the rest still runs
            emit(name="failed", tool=label, error=repr(error)[:300])
            continue
        emit(name="summary", tool=label, nproc=a.nproc, **rounded(results[label]))
    failed = verdict(results)
    emit(name="verdict", preset=a.preset, nproc=a.nproc, lora=a.lora, fastest=fastest(results),
         failed=failed)
    print(table([AUTO[0], *(label for label, _ in grid)], results))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
