"""benchmarks/dry_run_memory.py: the measured training memory (the logprob and train phases'
peak less the sleeping engine's share) against the dry run's estimate, hand-computed; and the
estimate line the dry run prints, parsed."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
dry_run_memory = pytest.importorskip("dry_run_memory")


def test_training_memory_is_the_larger_phase_peak_less_the_sleeping_engine():
    rows = [{"memory/logprobs_peak_gib": 50.0, "memory/train_peak_gib": 60.0,
             "memory/rollout_peak_gib": 70.0, "memory/engine_asleep_gib": 40.0},
            {"memory/train_peak_gib": 62.0, "memory/engine_asleep_gib": 41.0}]
    out = dry_run_memory.memory_check(rows, {"train": 23.1, "logprobs": 11.0, "peak": 99.0})
    assert out["training_gib"] == pytest.approx(62.0 - 41.0)
    assert out["estimate_vs_training"] == pytest.approx(23.1 / 21.0)
    assert out["measured/rollout_peak_gib"] == 70.0 and "measured/sync_peak_gib" not in out
    assert out["estimate/peak_gib"] == 99.0 and "estimate/generate_gib" not in out


def test_no_cuda_phase_logged_gives_the_estimate_alone():
    out = dry_run_memory.memory_check([{"loss": 0.1}], {"train": 5.0})
    assert out == {"estimate/train_gib": 5.0}


def test_estimate_parses_the_dry_run_line_and_a_failed_dry_run_gives_none(capsys):
    line = "memory per GPU (estimate, GiB): train 12.5, logprobs 8.25, peak 40"
    ok = [sys.executable, "-c", f"print({line!r})", "--"]
    assert dry_run_memory.memory_estimate(ok, dict(os.environ)) == \
        {"train": 12.5, "logprobs": 8.25, "peak": 40.0}
    failing = [sys.executable, "-c", "import sys; sys.exit(3)", "--"]
    assert dry_run_memory.memory_estimate(failing, dict(os.environ)) == {}
    assert '"name": "dry_run_failed", "returncode": 3' in capsys.readouterr().out
