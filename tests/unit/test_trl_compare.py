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
                           sleep_level=2, trl_fastest='{"use_liger_kernel": true}')
    cmd = trl_compare.trl_command(a, "/m", "/d.jsonl", "fastest")
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
    assert worker[worker.index("--trl_setting") + 1] == "fastest"
    assert json.loads(worker[worker.index("--trl_config") + 1]) == {
        "gradient_checkpointing": False, "use_liger_kernel": True}


def test_trl_settings_defaults_and_fastest():
    a = argparse.Namespace(trl_fastest="{}")
    assert trl_compare.trl_overrides(a, "defaults") == {}
    assert trl_compare.trl_overrides(a, "fastest") == {"gradient_checkpointing": False}


@pytest.mark.parametrize("trl_first, order", [
    (False, ["ours", "wide", "trl_defaults", "trl_fastest"]),
    (True, ["trl_defaults", "trl_fastest", "ours", "wide"])])
def test_trl_first_swaps_the_order_and_keeps_the_ratios(monkeypatch, capsys, tmp_path,
                                                        trl_first, order):
    ran = []

    def ours(a, model, dataset, label, extra):
        ran.append(label)
        return {"wall_s": 2.0 if label == "ours" else 4.0, "peak_gib": 30.0,
                "device_peak_gib": 45.0}

    def trl(a, model, dataset, setting):
        ran.append(f"trl_{setting}")
        return {"wall_s": 8.0 if setting == "defaults" else 5.0, "peak_gib": 40.0,
                "device_peak_gib": 60.0 if setting == "defaults" else 50.0}

    monkeypatch.setattr(trl_compare, "prepare", lambda a: ("/m", "/d.jsonl"))
    monkeypatch.setattr(trl_compare, "run_ours", ours)
    monkeypatch.setattr(trl_compare, "run_trl", trl)
    monkeypatch.setattr(sys, "argv", ["trl_compare.py", "--work_dir", str(tmp_path),
                                      "--variant", "wide=--x 1",
                                      *(["--trl_first"] if trl_first else [])])
    trl_compare.main()
    assert ran == order
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    ratios = [(r["tool"], r["baseline"], r["speedup_vs_trl"], r["memory_vs_trl"],
               r["device_memory_vs_trl"]) for r in lines if r["name"] == "ratio"]
    assert ratios == [("ours", "trl_defaults", 4.0, 0.75, 0.75),
                      ("ours", "trl_fastest", 2.5, 0.75, 0.9),
                      ("wide", "trl_defaults", 2.0, 0.75, 0.75),
                      ("wide", "trl_fastest", 1.25, 0.75, 0.9)]
    headline, = [r for r in lines if r["name"] == "headline"]
    assert (headline["baseline"], headline["speedup_vs_trl"]) == ("trl_fastest", 2.5)


@pytest.mark.parametrize("warmup, mean", [(1, 7.0), (2, 5.5), (3, 6.0)])
def test_warmup_batches_leave_the_first_batches_out(monkeypatch, capsys, tmp_path, warmup, mean):
    """Rollout batches ending at 10, 20, 25, 31 s: walls 10, 5, 6 s for batches 2-4."""
    def fake_trl(cmd, check):
        with open(tmp_path / "trl_steps_defaults.jsonl", "w") as f:
            for step, end in zip(range(1, 9), [5, 10, 15, 20, 22, 25, 28, 31]):
                f.write(json.dumps(dict(step=step, time=end, peak_gib=float(step),
                                        completion_length_mean=9.0)) + "\n")

    monkeypatch.setattr(trl_compare.subprocess, "run", fake_trl)
    monkeypatch.setattr(trl_compare, "device_used_gib", lambda: None)   # no GPU here
    a = argparse.Namespace(nproc=1, work_dir=str(tmp_path), rollout_batches=4,
                           completion_length=256, sleep_level=1, warmup_batches=warmup,
                           trl_fastest="{}")
    result = trl_compare.run_trl(a, "/m", "/d.jsonl")
    assert result == {"wall_s": mean, "peak_gib": 8.0, "torch_peak_gib": 8.0,
                      "device_peak_gib": None, "config": {}}
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


def test_device_peak_is_the_largest_sample_over_the_start(monkeypatch):
    """NVML samples 10 (at the start), 30, 52, 41 GiB: the block's peak is 42 GiB."""
    samples = iter([10.0, 30.0, 52.0, 41.0])
    monkeypatch.setattr(trl_compare, "device_used_gib", lambda: next(samples, 41.0))
    with trl_compare.DevicePeak(interval_s=0.01) as device:
        import time
        time.sleep(0.2)
    assert device.peak_gib == 42.0


def test_lora_gives_both_tools_the_same_adapter():
    """--lora 16: ours with ms-swift's LoRA flags, TRL's worker with the rank to build peft's."""
    a = argparse.Namespace(nproc=1, work_dir="/w", rollout_batches=4, completion_length=256,
                           sleep_level=1, lora=16, trl_fastest="{}", rlhf_args=["--seed", "1"])
    ours = trl_compare.ours_command(a, "/m", "/d.jsonl", "/o", [])
    assert ours[-10:] == ["--train_type", "lora", "--lora_rank", "16", "--lora_alpha", "32",
                          "--lora_dropout", "0.05", "--seed", "1"]
    worker = trl_compare.trl_command(a, "/m", "/d.jsonl", "defaults")
    assert worker[worker.index("--lora") + 1] == "16"
    assert trl_compare.peft_config(0) is None
