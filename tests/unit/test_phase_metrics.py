"""training/profile.py measure_phase: the seconds of a phase, and no memory keys off CUDA."""
import time

import pytest
import torch

from swift_megatron.training.profile import measure_phase


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
