"""--offload_model / --offload_optimizer (swift_megatron/training/offload.py) on a tiny Megatron
model in a subprocess (CPU, gloo): after Adam steps, offloading the DDP model (its parameters
empty meanwhile) and the optimizer, then reloading, gives back every parameter, Adam moment and
main param bit for bit, with the plain DDP optimizer and the distributed one (params inside the
contiguous buffer); training then continues exactly as a run that never offloaded. The GPU
version (tests/gpu/test_vllm_gpu.py) also checks that CUDA memory is freed."""
import json
import os
import subprocess
import sys

import pytest

from tests.distributed.launch import REPO

pytestmark = pytest.mark.slow
WORKER = os.path.join(REPO, "tests", "vllm", "offload_worker.py")


def run_worker(*flags) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, WORKER, *map(str, flags)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain():
    return run_worker("--offload", 0)


@pytest.mark.parametrize("dist_opt", [0, 1])
def test_offload_reload_is_bit_identical(plain, dist_opt):
    result = run_worker("--offload", 1, "--dist_opt", dist_opt)
    assert len(result["rounds"]) == 3
    for round_ in result["rounds"]:
        assert round_["identical"] and round_["params_emptied"] and round_["freed_bytes"] > 0
    if dist_opt == 0:
        assert result["losses"] == plain["losses"] and result["checksum"] == plain["checksum"]
    else:
        assert result["losses"] == pytest.approx(plain["losses"], rel=1e-6)
