"""GPU: the two ways of using the colocated engine's generation time on CUDA, where their
kernels run on CUDA streams of their own beside vLLM's (CUDA graphs on):

- --tail_logprobs: tests/vllm/tail_worker.py on the GPU (float32, the tiny Qwen3 of
  tests/vllm/test_tail.py with its EOS raised): the logprobs the tail's passes computed on their
  stream during the generation equal the synchronous passes' (a stream race would show as O(1)
  differences or NaN), so do the losses, and the tail ran passes;
- --async_generate in colocate mode: three rollout batches through `megatron rlhf`, the next
  generated in the engine's thread (its own stream) while the trainer trains: lag 0, 1, 1, the
  first batch on-policy (engine and trainer logprobs within 1e-3).

    python -m pytest tests/gpu/test_overlap_gpu.py -q -s
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.distributed.launch import REPO

pytestmark = pytest.mark.gpu
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")
WORKER = os.path.join(REPO, "tests", "vllm", "tail_worker.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm")
    from swift_megatron.fixtures import build_math_dataset, build_tiny_model
    from tests.vllm.test_tail import raise_eos

    root = tmp_path_factory.mktemp("overlap")
    dataset = build_math_dataset(str(root / "math.jsonl"))
    model = build_tiny_model("qwen3", str(root / "model"), head_dim=32, initializer_range=0.1)
    raise_eos(model, dataset)
    return model, dataset


def common(model, dataset, out) -> list:
    return ["--model", model, "--dataset", dataset, "--external_plugins", PLUGIN,
            "--reward_funcs", "digit_ratio", "contains_answer", "--num_generations", "4",
            "--global_batch_size", "16", "--micro_batch_size", "2", "--beta", "0.1",
            "--lr", "1e-3", "--report_to", "none", "--add_version", "false",
            "--output_dir", str(out), "--use_vllm", "true", "--vllm_mode", "colocate",
            "--vllm_gpu_memory_utilization", "0.3", "--vllm_max_model_len", "512",
            "--torch_dtype", "float32"]


def run(cmd, timeout=1200) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                    os.environ.get("PYTHONPATH")])),
               SWIFT_MEGATRON_NO_BAR="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def test_tail_logprobs_on_cuda_equal_the_synchronous_passes(model_dir, tmp_path):
    model, dataset = model_dir
    proc = run([sys.executable, WORKER, *common(model, dataset, tmp_path / "out"),
                "--steps_per_generation", "2", "--max_completion_length", "48",
                "--train_iters", "8", "--tail_logprobs", "true", "--offload_ref_model", "true"])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    assert result["warm_up_tail_passes"] >= 5
    for case in ("micro_batch_size", "max_tokens_packed"):
        got = result[case]
        assert got["same_completions"] and got["rollout/tail_passes"] >= 5
        for kind in ("old_logprobs", "ref_logprobs"):
            assert got["max_diff"][kind] < 1e-3 and got["mean_diff"][kind] < 1e-4
        for (loss, kl), (sync_loss, sync_kl) in zip(got["losses"]["tail"], got["losses"]["sync"]):
            assert loss == pytest.approx(sync_loss, rel=1e-3, abs=1e-5)
            assert kl == pytest.approx(sync_kl, rel=1e-3)
        assert got["ref_offloaded_after"]


def test_colocate_async_generate_on_cuda(model_dir, tmp_path):
    model, dataset = model_dir
    out = tmp_path / "async"
    shutil.rmtree(out, ignore_errors=True)
    run([sys.executable, "-m", "swift_megatron.cli.main", "rlhf", *common(model, dataset, out),
         "--max_completion_length", "48", "--train_iters", "3", "--log_interval", "1",
         "--async_generate", "true", "--rollout_importance_sampling_mode", "token_truncate"])
    with open(out / "logging.jsonl") as f:
        rows = [json.loads(line) for line in f]
    print(json.dumps([{k: r.get(k) for k in ("rollout/staleness", "rollout/logprob_abs_diff_mean",
                                             "rollout/is_weight_mean", "time/rollout_s",
                                             "time/train_s", "time/sync_s")} for r in rows]))
    assert [r["rollout/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["rollout/logprob_abs_diff_mean"] < 1e-3
    assert all(r["rollout/logprob_abs_diff_mean"] > 1e-3 for r in rows[1:])
