"""benchmarks/trl_sweep_pick.py: of a sweep's log, TRL's `fastest` summaries only, the run with
the fewest seconds per rollout batch picked (the fields it adds to the setting), {} when every
candidate failed or the setting alone was fastest."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.quick
BENCHMARKS = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks")
sys.path.insert(0, BENCHMARKS)
import trl_sweep_pick  # noqa: E402

LOG = [
    "INFO 11-29 10:27:01 [api_utils.py:273] non-default args: {'seed': 42}",
    json.dumps({"name": "rollout_batch", "tool": "trl_fastest", "batch": 2, "wall_s": 1.0}),
    json.dumps({"name": "summary", "tool": "trl_fastest", "wall_s": 5.61, "peak_gib": 63.9,
                "config": {"gradient_checkpointing": False}}),
    json.dumps({"name": "failed", "tool": "trl_fastest", "returncode": 1}),
    "trl_fastest_sweep: {\"torch_compile\": true} failed",
    json.dumps({"name": "summary", "tool": "trl_fastest", "wall_s": 4.9, "peak_gib": 70.2,
                "config": {"gradient_checkpointing": False, "per_device_train_batch_size": 16,
                           "gradient_accumulation_steps": 4}}),
    json.dumps({"name": "summary", "tool": "ours", "wall_s": 2.9, "config": {"x": 1}}),
    json.dumps(["a", "list"]),
]


def test_the_fastest_trl_run_of_the_log_is_picked():
    runs = trl_sweep_pick.summaries(LOG)
    assert [run["wall_s"] for run in runs] == [5.61, 4.9]   # ours' summary and others left out
    # the fields it adds to TRL's `fastest` setting (gradient checkpointing off) only
    assert trl_sweep_pick.pick(runs) == {"per_device_train_batch_size": 16,
                                         "gradient_accumulation_steps": 4}
    assert trl_sweep_pick.pick(runs[:1]) == {}   # the setting alone was fastest


def test_no_run_gives_trls_fastest_as_it_is(tmp_path):
    assert trl_sweep_pick.pick(trl_sweep_pick.summaries(LOG[:2])) == {}
    log = tmp_path / "sweep.log"
    log.write_text("\n".join(LOG) + "\n")
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "trl_sweep_pick.py"),
                           str(log)], capture_output=True, text=True, check=True)
    assert json.loads(proc.stdout)["per_device_train_batch_size"] == 16
    assert proc.stderr.count("s per rollout batch") == 2
