"""benchmarks/layer_time.py on the CPU: every decoder layer of a tiny Qwen3.5 stack is timed on
its own with the model's own inputs (three Gated DeltaNet layers, then attention), the two
kernels alone too, and the ratio line is the mean layers' and the kernels' ratios."""
import json
import os
import subprocess
import sys

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir))


def test_layers_and_kernels_are_timed():
    done = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "layer_time.py"),
                           "--preset", "tiny-qwen3.5", "--seq", "64", "--device", "cpu",
                           "--repeats", "1"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    layers = [r for r in lines if r["name"] == "layer"]
    kernels = {r["kind"]: r for r in lines if r["name"] == "kernel"}
    ratio = lines[-1]
    assert [r["kind"] for r in layers] == ["gdn", "gdn", "gdn", "attention"]
    assert all(r["ms"] > 0 for r in layers + list(kernels.values()))
    gdn = sum(r["ms"] for r in layers[:3]) / 3
    assert abs(ratio["layer_gdn_over_attention"] / (gdn / layers[3]["ms"]) - 1) < 0.01
    kernel_ratio = kernels["gdn"]["ms"] / kernels["attention"]["ms"]
    assert abs(ratio["kernel_gdn_over_attention"] / kernel_ratio - 1) < 0.01
