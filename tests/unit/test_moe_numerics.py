"""benchmarks/moe_numerics.py on a small random Qwen3.5-MoE (64 experts, top 8, 2 layers, no
vLLM) in a subprocess: its JSON lines hold every run, Megatron float32 equals transformers
float32 (the bridge's exactness on an untied 64-expert model), bf16 moves logprobs by bf16
noise, and a reversed router in one layer moves them by more."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks",
                      "moe_numerics.py")


def test_moe_numerics_lines(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1")
    out = subprocess.run([sys.executable, SCRIPT, "--hidden_size", "256", "--layers", "2",
                          "--sequences", "2", "--length", "32", "--no_vllm",
                          "--model_dir", str(tmp_path / "model")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    gaps = {(d["run"], d["against"]): d for d in lines if d["name"] == "logprob_gap"}
    assert gaps[("mcore_fp32", "hf_fp32")]["max"] < 1e-4
    for run in ("hf_bf16", "mcore_bf16", "mcore_bf16_router_bf16"):
        assert 0 < gaps[(run, "hf_fp32")]["mean"] < 0.05
    assert gaps[("error_router_rows_reversed", "hf_fp32")]["mean"] > \
        2 * gaps[("mcore_bf16", "hf_fp32")]["mean"]
    topk = [d for d in lines if d["name"] == "router_topk"][0]
    assert len(topk["per_layer"]) == 2 and 0 <= topk["tokens_with_other_experts"] < 0.2
