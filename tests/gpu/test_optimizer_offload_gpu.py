"""GPU: --optimizer_cpu_offload with --use_precision_aware_optimizer (megatron-core's
HybridDeviceOptimizer) as swift-megatron builds it, with --optimizer_offload_fraction 1 and 0.5,
and with --offload_optimizer's offload/reload around every step; and bf16 Adam moments
(--exp_avg_dtype / --exp_avg_sq_dtype bf16, training/adam_states.py) on the GPU. Four bf16 Adam steps of a tiny
model from the same weights (tests/distributed/workers/optimizer_offload.py) must reproduce the
GPU optimizer's losses and weights, with the Adam moments and float32 main params on the host.

    python -m pytest tests/gpu/test_optimizer_offload_gpu.py -q -s

Measured on an H100 (torch 2.11, megatron-core 0.16.1, no Transformer Engine): the losses of
all offload variants equal the GPU optimizer's to 4e-6 over 4 steps (6.23298 6.26726 6.23373
6.23909 vs 6.23298 6.26726 6.23369 6.23909), final weights within one bf16 rounding (2.4e-3).
"""
import json

import pytest

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.gpu
OFFLOADED = ("offload", "offload_half", "offload_colocate")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    result = run_workers("optimizer_offload.py", 1, tmp_path_factory.mktemp("offload"),
                         timeout=600)[0]
    print(json.dumps(result, indent=1))
    return result


@pytest.mark.parametrize("variant", OFFLOADED)
def test_offloaded_optimizer_trains_like_the_gpu_optimizer(report, variant):
    plain, got = report["plain"], report[variant]
    assert got["inner_optimizer"] == "HybridDeviceOptimizer"
    assert got["losses"] == pytest.approx(plain["losses"], abs=2e-3)
    assert got["grad_norms"] == pytest.approx(plain["grad_norms"], rel=2e-2)
    assert got["max_param_diff_vs_plain"] < 1e-2   # bf16 weights of magnitude ~0.02-1
    assert plain["losses"][0] != plain["losses"][-1]


def test_the_gpu_optimizer_runs_torchs_fused_adamw(report):
    """training/optim.py switches megatron's torch AdamW to the fused kernel on CUDA; the
    offloaded variants (megatron's hybrid optimizer) keep theirs and still match it above."""
    assert report["plain"]["inner_optimizer"] == "AdamW" and report["plain"]["fused"]


def test_moments_and_main_params_live_in_host_memory(report):
    plain = report["plain"]
    assert plain["moments"]["cpu"] == 0 and plain["master_params"]["cpu"] == 0
    for variant in ("offload", "offload_colocate"):
        assert report[variant]["moments"] == {"cuda": 0, "cpu": plain["moments"]["cuda"]}
        assert report[variant]["master_params"] == {"cuda": 0,
                                                    "cpu": plain["master_params"]["cuda"]}


def test_half_offload_splits_the_state(report):
    plain, half = report["plain"], report["offload_half"]
    for kind in ("moments", "master_params"):
        assert half[kind]["cpu"] > 0 and half[kind]["cuda"] > 0
        assert half[kind]["cpu"] + half[kind]["cuda"] == plain[kind]["cuda"]


def test_offload_optimizer_moves_gpu_memory_only(report):
    moved = report["offload_colocate"]["offloaded_bytes"]
    # the bf16 parameter shards the hybrid optimizer updates (on the GPU); not the host state
    assert len(moved) == 4 and len(set(moved)) == 1
    assert 0 < moved[0] < report["offload_colocate"]["moments"]["cpu"]


def test_bf16_moments_take_half_the_memory_and_train_like_float32(report):
    plain, low = report["plain"], report["bf16_moments"]
    assert low["inner_optimizer"] == "LowPrecisionAdamW"
    assert low["moments"] == {"cuda": plain["moments"]["cuda"] // 2, "cpu": 0}
    assert low["losses"] == pytest.approx(plain["losses"], abs=2e-3)
    assert low["max_param_diff_vs_plain"] < 1e-2   # bf16 weights: a few roundings
