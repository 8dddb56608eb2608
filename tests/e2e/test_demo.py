"""`megatron demo`, the README's main job: the reward the tiny model learns rises, with margin,
and the run's report is written where the demo's last line says."""
import os

import pytest

from swift_megatron.demo.run import reward_curve
from tests.distributed.launch import run_cli_together

pytestmark = pytest.mark.slow


def test_demo_reward_rises(tmp_path):
    proc = run_cli_together([(["demo", "--output_dir", tmp_path], {})], timeout=900)[0]
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
