"""The GPU gate: GRPO with vLLM colocate on every model family the product supports, full and
LoRA, each at real layer widths with reduced depth, the defaults otherwise; one log per case and
one summary table.

    python tests/gpu/matrix.py --out $OUT/matrix                      # every one-GPU case
    python tests/gpu/matrix.py --cases qwen3_5 qwen2_5_vl --out ...   # families (or case names)
    python tests/gpu/matrix.py --list                                 # the cases, no GPU needed

Every case runs `megatron rlhf` for two rollout batches (4 optimizer steps, 2 per rollout
batch, 64 completions of at most 128 tokens each) with `--check_weight_sync true`, after the same
command's `--dry_run true`, and passes when:
- the run exits 0 and logged both rollout batches;
- every logged loss (`loss/*`) and grad norm is finite;
- the engine-vs-trainer logprob gap after each sync (`sync/logprob_abs_diff_mean`) is under the
  family's tolerance (`--check_weight_sync_atol`: the default 0.05, 0.5 for random MoE routers
  of real width, docs/export.md);
- the dry run's training-memory estimate is within 15% of the measured training peak (the
  logprob and train phases' peak less the sleeping engine's share, benchmarks/trl_compare.py
  `memory_check`).
Flags beyond the defaults, as a colocate user sets them: the batch sizes above, the colocated
engine's share (`--vllm_gpu_memory_utilization 0.3`), `--sleep_level 1` and `--max_length` (the
task's longest prompt plus the completion: the dry run sizes micro-batches by it, else by the
completion plus 512 prompt tokens) and `--no_save_optim true` (the final checkpoint and its HF
export are written, then deleted after the case: disk). No environment variable is set.

The checkpoints are built first, side by side on the CPU, then the dry runs, side by side. Exits 1 when a case failed. tests/gpu/device_run.sh's `matrix` phase runs it.
"""
import argparse
import concurrent.futures
import json
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Dict, List, NamedTuple

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from grpo_step import build_model, build_task  # noqa: E402  (the benchmarks' presets)
from trl_compare import memory_check, memory_estimate  # noqa: E402

ESTIMATE_TOLERANCE = 0.15
MOE_SYNC_ATOL = 0.5   # bf16 routing of random routers at real width (docs/export.md)
ROLLOUT_BATCHES, STEPS_PER_ROLLOUT = 2, 2
RUN_FLAGS = ["--num_generations", "8", "--micro_batch_size", "8", "--global_batch_size", "32",
             "--steps_per_generation", str(STEPS_PER_ROLLOUT), "--max_completion_length", "128",
             "--train_iters", str(ROLLOUT_BATCHES * STEPS_PER_ROLLOUT), "--use_vllm", "true",
             "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization", "0.3",
             "--sleep_level", "1", "--check_weight_sync", "true", "--logging_steps", "1",
             "--report_to", "none", "--add_version", "false", "--no_save_optim", "true"]


class Family(NamedTuple):
    preset: str        # benchmarks/grpo_step.py PRESETS
    sync_atol: float   # --check_weight_sync_atol
    max_length: int    # --max_length: the task's longest prompt + 128 completion tokens
    what: str          # what the family exercises


# prompts: the math task's 24 tokens; the colour task's about 25 plus its image's 256 tokens
# (448 pixels in 14-pixel patches merged 2x2) or 196 (16-pixel patches)
TEXT, VL_14, VL_16 = 160, 448, 384
FAMILIES: Dict[str, Family] = {
    "llama3": Family("llama3.2-1b-4l", 0.05, TEXT,
                     "Llama 3.2 1B layers: tied embeddings, llama3 rope"),
    "qwen2": Family("qwen2.5-1.5b-4l", 0.05, TEXT, "Qwen2.5-1.5B layers: q/k/v biases, tied"),
    "qwen3": Family("qwen3-1.7b-4l", 0.05, TEXT, "Qwen3-1.7B layers: q/k norms"),
    "qwen3_moe": Family("qwen3-moe-4l", MOE_SYNC_ATOL, TEXT, "Qwen3-30B-A3B layers, 64 experts"),
    "qwen3_5": Family("qwen3.5-9b-4l", 0.05, TEXT,
                      "Qwen3.5-9B layers: 3 Gated DeltaNet + 1 attention"),
    "qwen3_5_moe": Family("qwen3.5-moe-4l", MOE_SYNC_ATOL, TEXT,
                          "Qwen3.5-35B-A3B layers, 64 experts"),
    "qwen2_5_vl": Family("qwen2.5-vl-3b-4l", 0.05, VL_14, "Qwen2.5-VL-3B, 4 tower blocks, images"),
    "qwen3_vl": Family("qwen3-vl-2b-4l", 0.05, VL_16,
                       "Qwen3-VL-2B, 4 tower blocks (deepstack), images"),
    "qwen3_5_vl": Family("qwen3.5-9b-4l-vl", 0.05, VL_16,
                         "Qwen3.5-9B layers, 4 tower blocks, images"),
}
MODES = {"full": [], "lora": ["--train_type", "lora"]}


class Case(NamedTuple):
    name: str
    family: str
    mode: str


def all_cases() -> List[Case]:
    return [Case(f"{family}_{mode}", family, mode) for family in FAMILIES for mode in MODES]


def select(cases: List[Case], wanted: List[str]) -> List[Case]:
    """The cases named in `wanted` (case names or family names; all when empty)."""
    known = {c.name for c in cases} | {c.family for c in cases}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"unknown matrix case(s) {unknown}; choose from {sorted(known)}")
    return [c for c in cases if not wanted or c.name in wanted or c.family in wanted]


def command(case: Case, model: str, task: List[str], out: str) -> List[str]:
    family = FAMILIES[case.family]
    return [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model, *task,
            *RUN_FLAGS, "--check_weight_sync_atol", str(family.sync_atol), "--max_length",
            str(family.max_length), "--output_dir", out,
            *MODES[case.mode]]


def _finite(value) -> bool:
    return value is not None and math.isfinite(value)


def verdict(returncode: int, rows: List[dict], estimate: Dict[str, float],
            sync_atol: float) -> dict:
    """The case's numbers and the list of checks it failed (`failed`, empty when it passed)."""
    losses = [v for row in rows for k, v in row.items() if k.startswith("loss/")]
    grad_norms = [row.get("grad_norm") for row in rows]
    gaps = [row["sync/logprob_abs_diff_mean"] for row in rows
            if "sync/logprob_abs_diff_mean" in row]
    memory = memory_check(rows, estimate) if rows else {}
    ratio = memory.get("estimate_vs_training")
    failed = []
    if returncode != 0:
        failed.append(f"exit {returncode}")
    if len(rows) < ROLLOUT_BATCHES:
        failed.append(f"{len(rows)} of {ROLLOUT_BATCHES} rollout batches logged")
    if rows and not (losses and all(_finite(v) for v in losses + grad_norms)):
        failed.append("a loss or grad norm is not finite (or none was logged)")
    if rows and not (gaps and max(gaps) < sync_atol):
        failed.append(f"sync gap {max(gaps) if gaps else None} not under {sync_atol}")
    if rows and not (ratio and abs(ratio - 1) <= ESTIMATE_TOLERANCE):
        failed.append(f"estimate / measured {ratio} outside 1 +- {ESTIMATE_TOLERANCE}")
    return dict(loss=losses[-1] if losses else None, grad_norm=grad_norms[-1] if rows else None,
                sync_gap=max(gaps) if gaps else None, sync_atol=sync_atol,
                estimate_gib=max(estimate.get("train", 0), estimate.get("logprobs", 0)) or None,
                training_gib=memory.get("training_gib"), estimate_vs_training=ratio,
                failed=failed)


def read_rows(out: str) -> List[dict]:
    path = os.path.join(out, "logging.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_case(case: Case, model: str, task: List[str], a, estimate: Dict[str, float]) -> dict:
    out = os.path.join(a.work_dir, case.name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = command(case, model, task, out)
    start = time.time()
    with open(os.path.join(a.out, f"{case.name}.log"), "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        timeout=a.case_timeout).returncode
        except subprocess.TimeoutExpired:
            returncode = "timeout"
    result = verdict(returncode if isinstance(returncode, int) else -1, read_rows(out),
                     estimate, FAMILIES[case.family].sync_atol)
    if returncode == "timeout":
        result["failed"].insert(0, f"timed out after {a.case_timeout} s")
    for entry in os.scandir(out) if os.path.isdir(out) else ():   # the checkpoints: disk
        if entry.is_dir():
            shutil.rmtree(entry.path)
    return dict(case=case.name, seconds=round(time.time() - start, 1), **result)


def _fmt(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def table(results: List[dict]) -> str:
    lines = ["| case | result | s | loss | grad norm | sync gap (tol) | estimate / measured GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        memory = (f"{_fmt(r['estimate_gib'])} / {_fmt(r['training_gib'])} = "
                  f"{_fmt(r['estimate_vs_training'])}")
        lines.append(f"| {r['case']} | {'; '.join(r['failed']) or 'pass'} | {r['seconds']:.0f} | "
                     f"{_fmt(r['loss'])} | {_fmt(r['grad_norm'])} | {_fmt(r['sync_gap'])} "
                     f"({r['sync_atol']}) | {memory} |")
    return "\n".join(lines)


def prepare(cases: List[Case], work_dir: str) -> Dict[str, tuple]:
    """{family: (model dir, task flags)}, the checkpoints built side by side."""
    families = sorted({c.family for c in cases})
    presets = [FAMILIES[f].preset for f in families]
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(4, len(presets))) as pool:
        models = list(pool.map(build_model, presets,
                               [os.path.join(work_dir, "models", p) for p in presets],
                               ["bfloat16"] * len(presets)))
    return {f: (m, build_task(p, work_dir)) for f, p, m in zip(families, presets, models)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=[], help="case or family names (all)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_out") + "/matrix",
                        help="one log per case and results.jsonl")
    parser.add_argument("--work_dir", default="/tmp/gpu_matrix")
    parser.add_argument("--case_timeout", type=int, default=420)
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    a = parser.parse_args()
    cases = select(all_cases(), a.cases)
    if a.list:
        for c in cases:
            print(c.name, FAMILIES[c.family].preset, FAMILIES[c.family].what, sep="\t")
        return
    os.makedirs(a.out, exist_ok=True)
    inputs = prepare(cases, a.work_dir)
    env = dict(os.environ, SWIFT_MEGATRON_NO_BAR="1")
    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:   # CPU only
        estimates = list(pool.map(lambda c: memory_estimate(
            command(c, *inputs[c.family], os.path.join(a.work_dir, c.name)), env), cases))
    results = []
    for c, estimate in zip(cases, estimates):
        results.append(run_case(c, *inputs[c.family], a, estimate))
        print(json.dumps(dict(name="matrix_case", **results[-1])), flush=True)
        with open(os.path.join(a.out, "results.jsonl"), "a") as f:
            f.write(json.dumps(results[-1]) + "\n")
    print(table(results))
    sys.exit(1 if any(r["failed"] for r in results) else 0)


if __name__ == "__main__":
    main()
