"""benchmarks/trl_compare.py's TRL launch: torchrun accepts the worker's command line at 2 GPUs
(an option of the worker's named like one of torchrun's own made torchrun refuse it as
ambiguous on the two-GPU machine) and passes the worker's options through unchanged; the
order of the runs (`--trl_first`) with the ratio lines it ends with; and which rollout batches
the averages hold (`--warmup_batches`)."""
import argparse
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
trl_compare = pytest.importorskip("trl_compare")


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_trl_worker_line_parses_under_torchrun(nproc):
    from torch.distributed.run import get_args_parser

    a = argparse.Namespace(nproc=nproc, work_dir="/w", rollout_batches=4, completion_length=256,
                           sleep_level=2)
    cmd = trl_compare.trl_command(a, "/m", "/d.jsonl")
    worker = cmd[cmd.index(os.path.abspath(trl_compare.__file__)):]
    if nproc == 1:
        assert cmd[1:] == worker
        return
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    parsed = get_args_parser().parse_args(cmd[3:])
    assert parsed.nproc_per_node == "2"
    assert [parsed.training_script, *parsed.training_script_args] == worker
    assert "--trl_worker" in worker and "--nproc" not in worker
    assert worker[worker.index("--sleep_level") + 1] == "2"   # both tools at one level


@pytest.mark.parametrize("trl_first, order", [(False, ["ours", "wide", "trl"]),
                                              (True, ["trl", "ours", "wide"])])
def test_trl_first_swaps_the_order_and_keeps_the_ratios(monkeypatch, capsys, tmp_path,
                                                        trl_first, order):
    ran = []

    def ours(a, model, dataset, label, extra):
        ran.append(label)
        return {"wall_s": 2.0 if label == "ours" else 4.0, "peak_gib": 30.0}

    def trl(a, model, dataset):
        ran.append("trl")
        return {"wall_s": 8.0, "peak_gib": 40.0}

    monkeypatch.setattr(trl_compare, "prepare", lambda a: ("/m", "/d.jsonl"))
    monkeypatch.setattr(trl_compare, "run_ours", ours)
    monkeypatch.setattr(trl_compare, "run_trl", trl)
    monkeypatch.setattr(sys, "argv", ["trl_compare.py", "--work_dir", str(tmp_path),
                                      "--variant", "wide=--x 1",
                                      *(["--trl_first"] if trl_first else [])])
    trl_compare.main()
    assert ran == order
    lines = [line for line in capsys.readouterr().out.splitlines() if '"ratio"' in line]
    assert [(r["tool"], r["speedup_vs_trl"], r["memory_vs_trl"]) for r in map(json.loads, lines)] \
        == [("ours", 4.0, 0.75), ("wide", 2.0, 0.75)]


@pytest.mark.parametrize("warmup, mean", [(1, 7.0), (2, 5.5), (3, 6.0)])
def test_warmup_batches_leave_the_first_batches_out(monkeypatch, capsys, tmp_path, warmup, mean):
    """Rollout batches ending at 10, 20, 25, 31 s: walls 10, 5, 6 s for batches 2-4."""
    def fake_trl(cmd, check):
        with open(tmp_path / "trl_steps.jsonl", "w") as f:
            for step, end in zip(range(1, 9), [5, 10, 15, 20, 22, 25, 28, 31]):
                f.write(json.dumps(dict(step=step, time=end, peak_gib=float(step),
                                        completion_length_mean=9.0)) + "\n")

    monkeypatch.setattr(trl_compare.subprocess, "run", fake_trl)
    a = argparse.Namespace(nproc=1, work_dir=str(tmp_path), rollout_batches=4,
                           completion_length=256, sleep_level=1, warmup_batches=warmup)
    result = trl_compare.run_trl(a, "/m", "/d.jsonl")
    assert result == {"wall_s": mean, "peak_gib": 8.0}
    batches = [json.loads(line)["batch"] for line in capsys.readouterr().out.splitlines()]
    assert batches == [2, 3, 4]   # every batch is still printed


@pytest.mark.parametrize("warmup", ["0", "4"])
def test_warmup_batches_must_leave_a_batch(monkeypatch, capsys, warmup):
    monkeypatch.setattr(sys, "argv", ["trl_compare.py", "--rollout_batches", "4",
                                      "--warmup_batches", warmup])
    with pytest.raises(SystemExit) as exc:
        trl_compare.main()
    assert exc.value.code == 2
    assert "--warmup_batches" in capsys.readouterr().err
