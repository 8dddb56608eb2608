"""GPU: vLLM rollouts at a real shape (a random Qwen2.5-0.5B-shaped bf16 checkpoint), through
benchmarks/rollout.py, whose JSON lines are checked here (and printed: run with -s):

- colocate (one GPU, set up as a training process, Megatron model included): engine start,
  weight sync from a dict and from the bridge's export stream (GB/s), generation tokens/s, the
  vLLM-vs-transformers logprob mismatch, and sleep levels 1 and 2 freeing GPU memory, getting it
  back on wake-up with the greedy output unchanged after a weight sync during sleep, at level 1
  and, on an engine of its own, level 2; the same
  weight-sync checks on a Qwen3-MoE shape (8 layers, 64 experts);
- offload (one GPU): offload/reload of a bf16 Megatron model and its distributed optimizer is
  bit-identical and frees CUDA memory (tests/vllm/offload_worker.py);
- server (two GPUs): `megatron rollout` on GPU 0, the client's weight push over NCCL from
  GPU 1 (GB/s), perturbed weights change the output and the originals restore it.

    python -m pytest tests/gpu/test_vllm_gpu.py -q -s   # with vLLM (>= 0.26) and megatron-core
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.launch import REPO

pytestmark = pytest.mark.gpu
BENCH = os.path.join(REPO, "benchmarks", "rollout.py")
SIZES = ["--preset", "qwen2.5-0.5b", "--prompts", "128", "--prompt_len", "128",
         "--max_tokens", "256"]


def run_json(cmd, timeout=1800) -> dict:
    """Run a script; its JSON lines by "name" (every stdout line is echoed)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    lines = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            print(line)
            record = json.loads(line)
            lines[record.get("name", "result")] = record
    return lines


@pytest.fixture(scope="module")
def work_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rollout_bench"))


@pytest.fixture(scope="module")
def colocate_lines(work_dir):
    pytest.importorskip("vllm")
    return run_json([sys.executable, BENCH, "--mode", "colocate", "--work_dir", work_dir, *SIZES])


def test_colocate_engine(colocate_lines):
    lines = colocate_lines
    assert lines["weight_sync.dict"]["gb_per_s"] > 0.5
    if "seconds" in lines["weight_sync.bridge"]:
        assert lines["weight_sync.bridge"]["gb_per_s"] > 0.1
    assert lines["generate"]["tokens_per_s"] > 500
    mismatch = lines["logprob_mismatch"]["vs_transformers"]
    assert mismatch["model_dtype"]["mean"] < 0.05 and mismatch["float32"]["mean"] < 0.05
    sleep = lines["sleep.level1"]
    assert sleep["freed_gib"] > 5, sleep          # KV cache released, weights offloaded
    assert sleep["free_gib_after_wake"] < sleep["free_gib_asleep"] - 5, sleep
    assert sleep["greedy_unchanged"], sleep


def test_sleep_level2_keeps_outputs(work_dir):
    """An engine built for level 2 (as `megatron rlhf --sleep_level 2` builds it): a level-2
    sleep discards the weights, the sync reloads all of them, and greedy output is unchanged."""
    pytest.importorskip("vllm")
    sleep = run_json([sys.executable, BENCH, "--mode", "colocate", "--work_dir", work_dir,
                      "--sleep_level", "2", "--preset", "qwen2.5-0.5b", "--prompts", "32",
                      "--prompt_len", "128", "--max_tokens", "128"])["sleep.level2"]
    assert sleep["freed_gib"] > 5, sleep          # KV cache and weights released
    assert sleep["free_gib_after_wake"] < sleep["free_gib_asleep"] - 5, sleep
    assert sleep["greedy_unchanged"] and sleep["tensors_changed"] == 0, sleep


def test_colocate_moe_weight_sync(work_dir):
    """A Qwen3-MoE shape: the engine starts from dummy weights, so logprobs that match
    transformers' mean the synced experts landed in the layout vLLM's MoE backend expects
    (layerwise reload, vllm_compat)."""
    pytest.importorskip("vllm")
    lines = run_json([sys.executable, BENCH, "--mode", "colocate", "--work_dir", work_dir,
                      "--preset", "qwen3-moe-small", "--prompts", "32", "--prompt_len", "64",
                      "--max_tokens", "64"])
    mismatch = lines["logprob_mismatch"]["vs_transformers"]
    assert mismatch["model_dtype"]["mean"] < 0.05 and mismatch["float32"]["mean"] < 0.05
    assert lines["sleep.level1"]["greedy_unchanged"]


def test_offload_frees_cuda_memory():
    result = run_json([sys.executable, os.path.join(REPO, "tests", "vllm", "offload_worker.py"),
                       "--device", "cuda", "--dtype", "bfloat16", "--dist_opt", "1"])["result"]
    for round_ in result["rounds"]:
        assert round_["identical"] and round_["params_emptied"]
        assert round_["cuda_allocated_offloaded"] < round_["cuda_allocated_before"]
    plain = run_json([sys.executable, os.path.join(REPO, "tests", "vllm", "offload_worker.py"),
                      "--device", "cuda", "--dtype", "bfloat16", "--dist_opt", "1",
                      "--offload", "0"])["result"]
    # the same steps as a run that never offloaded (GPU kernels may differ in the last bits)
    assert result["losses"] == pytest.approx(plain["losses"], rel=1e-3)


def test_server_weight_push_over_nccl(work_dir):
    pytest.importorskip("vllm")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    lines = run_json([sys.executable, BENCH, "--mode", "server", "--server_gpu", "0",
                      "--client_gpu", "1", "--work_dir", work_dir, *SIZES])
    push = lines["weight_sync.server"]
    assert push["backend"] == "nccl" and push["gb_per_s"] > 0.5
    assert push["perturbed_changed_output"] and push["restored_output"]
    assert lines["generate.server"]["tokens_per_s"] > 500
