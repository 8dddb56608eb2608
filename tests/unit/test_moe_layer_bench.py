"""benchmarks/moe_layer.py on the CPU (tiny MoE preset, two variants): each row's TFLOP/s is the
active-parameter FLOPs of its tokens/s, the profile names every part of a MoE model, backward
work included (the experts' grouped GEMMs: forward and both gradients), and the host-sync count
of one MoE layer is zero with grouped experts and our dispatch, megatron's `masked_select`s
with its own dispatcher."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))
PARTS = {"attention", "router", "dispatch", "experts", "combine", "head", "embedding"}


@pytest.fixture(scope="module")
def rows():
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "moe_layer.py"),
                           "--preset", "tiny-moe", "--tokens", "128", "--seq_len", "32",
                           "--steps", "1", "--warmup", "1", "--device", "cpu", "--profile",
                           "--variants", "grouped", "megatron"],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {row["variant"]: row for row in found}


def test_tflops_are_the_active_parameter_flops_of_the_tokens_per_second(rows):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    from moe_layer import hf_config

    from swift_megatron.planning.cost import active_parameters, attention_flops_per_token

    hf = hf_config("tiny-moe")
    per_token = 6 * active_parameters(hf) + attention_flops_per_token(hf, 32)
    for row in rows.values():
        assert row["tokens"] == 128 and row["tokens_per_s"] > 0
        assert row["tflops"] == pytest.approx(per_token * row["tokens_per_s"] / 1e12, abs=0.01)


def test_the_profile_splits_the_step_into_its_parts(rows):
    for row in rows.values():
        assert PARTS <= set(row["parts_ms"])
        assert all(ms >= 0 for ms in row["parts_ms"].values())
    layers, gemms = 2, rows["grouped"]["gemm_calls"]
    assert gemms["aten::_grouped_mm"] == layers * 6      # fc1, fc2: forward, input, weight grads
    assert "aten::_grouped_mm" not in rows["megatron"]["gemm_calls"]


def test_host_syncs_of_a_moe_layer(rows):
    assert rows["grouped"]["syncs_moe_layer"]["calls"] == {}
    assert rows["megatron"]["syncs_moe_layer"]["calls"]["masked_select"] == 2
