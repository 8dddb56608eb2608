"""GPU: --optimizer_cpu_offload (megatron-core's HybridDeviceOptimizer) as swift-megatron builds
it, alone, with --optimizer_offload_fraction 0.5, with --use_precision_aware_optimizer (which
works without Transformer Engine only there), and with --offload_optimizer's offload/reload
around every step. Four bf16 Adam steps of a tiny model from the same weights
(tests/distributed/workers/optimizer_offload.py) must reproduce the GPU optimizer's losses and
weights, with the optimizer state in host memory.

    python -m pytest tests/gpu/test_optimizer_offload_gpu.py -q -s
"""
import json

import pytest

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    result = run_workers("optimizer_offload.py", 1, tmp_path_factory.mktemp("offload"),
                         timeout=600)[0]
    print(json.dumps(result, indent=1))
    return result


@pytest.mark.parametrize("variant", ["offload", "offload_half", "precision_aware",
                                     "precision_aware_colocate"])
def test_offloaded_optimizer_trains_like_the_gpu_optimizer(report, variant):
    plain, got = report["plain"], report[variant]
    assert got["inner_optimizer"] == "HybridDeviceOptimizer"
    assert got["losses"] == pytest.approx(plain["losses"], abs=2e-3)
    assert got["grad_norms"] == pytest.approx(plain["grad_norms"], rel=2e-2)
    assert got["max_param_diff_vs_plain"] < 1e-2   # bf16 weights of magnitude ~0.02-1
    assert plain["losses"][0] != plain["losses"][-1]


def test_adam_moments_live_in_host_memory(report):
    assert report["plain"]["moments"]["cpu"] == 0 and report["plain"]["moments"]["cuda"] > 0
    for variant in ("offload", "precision_aware", "precision_aware_colocate"):
        assert report[variant]["moments"] == {"cuda": 0,
                                              "cpu": report["plain"]["moments"]["cuda"]}


def test_precision_aware_also_moves_the_master_params_to_the_host(report):
    masters = report["plain"]["master_params"]["cuda"]
    # without it the distributed optimizer keeps its float32 main params on the GPU (and the
    # hybrid optimizer a host copy)
    assert report["offload"]["master_params"] == {"cuda": masters, "cpu": masters}
    for variant in ("precision_aware", "precision_aware_colocate"):
        assert report[variant]["master_params"] == {"cuda": 0, "cpu": masters}


def test_half_offload_splits_the_moments(report):
    half = report["offload_half"]["moments"]
    assert half["cpu"] > 0 and half["cuda"] > 0
    assert half["cpu"] + half["cuda"] == report["plain"]["moments"]["cuda"]
