"""training/profile.py measure_phase: the seconds of a phase, and no memory keys off CUDA;
device_memory: the whole device's used memory and torch's reserved bytes, on CUDA only."""
import time

import pytest
import torch

from swift_megatron.training.profile import device_memory, measure_phase


def test_measure_phase_records_seconds_only_on_cpu():
    metrics = {}
    with measure_phase("train", metrics, torch.device("cpu")):
        time.sleep(0.05)
    assert list(metrics) == ["time/train_s"]
    assert 0.05 <= metrics["time/train_s"] < 1.0


def test_measure_phase_records_on_error_free_exit_only():
    metrics = {}
    with pytest.raises(RuntimeError):
        with measure_phase("sync", metrics, torch.device("cpu")):
            raise RuntimeError("boom")
    assert metrics == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measure_phase_peak_memory_on_cuda():
    metrics = {}
    with measure_phase("logprobs", metrics, torch.device("cuda")):
        block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        del block
    assert metrics["memory/logprobs_peak_gib"] >= 0.25


def test_device_memory_is_empty_off_cuda():
    assert device_memory(torch.device("cpu")) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_memory_counts_what_torch_holds_and_more():
    block = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    found = device_memory(torch.device("cuda"))
    assert found["reserved_gib"] >= 0.5 and found["device_used_gib"] >= found["reserved_gib"]
    del block
