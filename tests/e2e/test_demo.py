"""`megatron demo`, the README's main job: the reward the tiny model learns rises, with margin,
and the run's report is written where the demo's last line says."""
import os
import subprocess
import sys

import pytest

from swift_megatron.demo.run import reward_curve
from tests.distributed.launch import REPO

pytestmark = pytest.mark.slow


def test_demo_reward_rises(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1")
    proc = subprocess.run([sys.executable, "-m", "swift_megatron.cli.main", "demo",
                           "--output_dir", str(tmp_path)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "reward rose from" in proc.stdout and "max abs logit diff" in proc.stdout
    assert "-> PASS" in proc.stdout  # the conversion precision check passed
    curve = [row["reward/mean"] for row in reward_curve(os.path.join(tmp_path, "grpo"))]
    assert len(curve) == 30
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert last > first + 0.1, curve  # observed: ~0.01 -> ~0.4
    assert os.path.isfile(os.path.join(tmp_path, "grpo", "final_hf", "model.safetensors"))
    report = os.path.join(tmp_path, "grpo", "report")
    assert proc.stdout.rstrip().endswith(f"report (plots, summary.md, completions.html): {report}")
    assert {"overview.png", "reward_functions.png", "completions.html"} <= set(os.listdir(report))
    assert "- 30 logged steps, step 1 to 30 of 30: finished" in open(os.path.join(report, "summary.md")).read()
