"""Metric sinks: logging.jsonl content, the console line's order and formatting, tensorboard
scalars read back from the event file (in --tensorboard_dir), wandb/swanlab through stand-in
modules (project and run names from the flags, ms-swift's defaults), missing or unknown sinks,
non-finite values, completions.jsonl, reduce_metrics and close()."""
import json
import logging
import math
import os
import sys
import types

import pytest
import torch

from swift_megatron.errors import UserError
from swift_megatron.logging.completions import CompletionsLogger
from swift_megatron.logging.metrics import (MetricsLogger, SinkSettings, check_report_to,
                                            format_metrics, format_value, reduce_metrics)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def read_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(log_dir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class FakeRun:
    def __init__(self):
        self.logged, self.finished = [], 0

    def log(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def finish(self):
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch):
    module = types.ModuleType("wandb")
    module.run = FakeRun()
    module.init_kwargs = None

    def init(**kwargs):
        module.init_kwargs = kwargs
        return module.run

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


@pytest.fixture
def fake_swanlab(monkeypatch):
    module = types.ModuleType("swanlab")
    run = FakeRun()
    module.logged, module.init_kwargs = run.logged, None
    module.init = lambda **kwargs: setattr(module, "init_kwargs", kwargs)
    module.log, module.finish = run.log, run.finish
    module.fake_run = run
    monkeypatch.setitem(sys.modules, "swanlab", module)
    return module


# ---------------------------------------------------------------------------------------------
# Pure helpers


def test_reduce_metrics_averages_over_micro_batches_that_have_the_key():
    reduced = reduce_metrics([
        {"loss": torch.tensor(1.0), "kl": 0.5},
        {"loss": torch.tensor(3.0)},
        {"loss": 2.0, "kl": torch.tensor(1.5, dtype=torch.float64), "clip": 1},
    ])
    assert reduced == {"loss": 2.0, "kl": 1.0, "clip": 1.0}
    assert all(type(value) is float for value in reduced.values())
    assert reduce_metrics([]) == {}


def test_reduce_metrics_rejects_non_scalar_tensors():
    with pytest.raises(ValueError, match="'low_clip' must be a scalar"):
        reduce_metrics([{"low_clip": torch.zeros(2, 3)}])


@pytest.mark.parametrize("value, text", [
    (0.123456, "0.1235"), (3, "3"), (3.0, "3"), (True, "1"), (1e-5, "1e-05"),
    (2.5e-7, "2.5e-07"), (12345.6, "12346"), (123.456, "123.5"), (-0.5, "-0.5"),
    (2e9, "2e+09"), (float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf"),
])
def test_format_value(value, text):
    assert format_value(value) == text


def test_format_metrics_puts_the_important_keys_first():
    metrics = {"time/rollout_s": 1.5, "lr": 1e-5, "perf/tokens_per_s": 12345.6,
               "grad_norm": 0.987654, "kl": 0.00123, "reward/std": 0.25,
               "reward/mean": 0.5, "loss/policy": 0.123456, "loss": 0.2,
               "rollout/completion_length_mean": 87.25, "loss/kl": torch.tensor(0.01)}
    assert format_metrics(metrics) == (
        "loss=0.2 loss/kl=0.01 loss/policy=0.1235 reward/mean=0.5 kl=0.00123 "
        "grad_norm=0.9877 lr=1e-05 perf/tokens_per_s=12346 reward/std=0.25 "
        "rollout/completion_length_mean=87.25 time/rollout_s=1.5")


def test_format_metrics_matches_names_inside_namespaces():
    metrics = {"optim/lr": 1e-6, "optim/grad_norm": 2.0, "policy/kl": 0.1, "a": 1.0}
    assert format_metrics(metrics) == "policy/kl=0.1 optim/grad_norm=2 optim/lr=1e-06 a=1"


# ---------------------------------------------------------------------------------------------
# MetricsLogger


def test_jsonl_and_console_line(tmp_path, swift_logs, monkeypatch):
    monkeypatch.setattr("time.time", lambda: 1700000000.25)
    with MetricsLogger(str(tmp_path / "out"), report_to=[]) as metrics_logger:
        metrics_logger.log(1, {"reward/mean": 0.5, "loss/policy": torch.tensor(0.25),
                               "perf/tokens_per_s": 1234.5678})
        metrics_logger.log(2, {"loss/policy": 0.125, "rollout/truncated": 3})
    assert read_jsonl(tmp_path / "out" / "logging.jsonl") == [
        {"step": 1, "time": 1700000000.25, "reward/mean": 0.5, "loss/policy": 0.25,
         "perf/tokens_per_s": 1234.5678},
        {"step": 2, "time": 1700000000.25, "loss/policy": 0.125, "rollout/truncated": 3},
    ]
    lines = [(r.name, r.levelno, r.getMessage()) for r in swift_logs.records]
    assert lines == [  # the console shows the CONSOLE_KEYS subset; jsonl has everything
        ("swift_megatron.logging.metrics", logging.INFO, "step 1 | loss/policy=0.25 reward/mean=0.5"),
        ("swift_megatron.logging.metrics", logging.INFO, "step 2 | loss/policy=0.125"),
    ]
    assert os.listdir(tmp_path / "out") == ["logging.jsonl"]  # no sink directories


def test_jsonl_is_flushed_after_each_log_and_appends_on_resume(tmp_path):
    first = MetricsLogger(str(tmp_path), report_to=[])
    first.log(1, {"loss": 1.0})
    assert read_jsonl(tmp_path / "logging.jsonl")[0]["loss"] == 1.0  # before close
    first.close()
    with MetricsLogger(str(tmp_path), report_to=[]) as second:
        second.log(2, {"loss": 0.5})
    assert [row["step"] for row in read_jsonl(tmp_path / "logging.jsonl")] == [1, 2]


def test_resume_drops_the_killed_runs_later_steps(tmp_path):
    """A run killed after logging steps 1-4 but saving at 2, resumed in the same directory:
    one line per step afterwards (steps 3-4 come again from the resumed run)."""
    first = MetricsLogger(str(tmp_path), report_to=[])
    for step in range(1, 5):
        first.log(step, {"loss": float(step)})
    first._file.write('{"step": 5, "loss"')   # a half-written line from the kill
    first.close()
    resumed = MetricsLogger(str(tmp_path), report_to=[])
    assert resumed.drop_after(2) == 3
    for step in (3, 4):
        resumed.log(step, {"loss": 10.0 * step})
    resumed.close()
    rows = [json.loads(line) for line in open(tmp_path / "logging.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]


def test_reserved_metric_names_are_rejected(tmp_path):
    with MetricsLogger(str(tmp_path), report_to=[]) as metrics_logger:
        with pytest.raises(ValueError, match=r"\['step'\] are reserved"):
            metrics_logger.log(1, {"step": 3.0})


def test_tensorboard_scalars_read_back(tmp_path):
    with MetricsLogger(str(tmp_path), report_to=["tensorboard"]) as metrics_logger:
        metrics_logger.log(1, {"loss/policy": 0.5, "lr": 1e-5})
        metrics_logger.log(2, {"loss/policy": 0.25})
    scalars = read_scalars(str(tmp_path / "runs"))
    assert scalars["loss/policy"] == [(1, 0.5), (2, 0.25)]
    assert scalars["lr"] == [(1, pytest.approx(1e-5))]
    assert set(scalars) == {"loss/policy", "lr"}


def test_non_finite_values_null_in_jsonl_skipped_by_sinks(tmp_path, swift_logs, fake_wandb):
    with MetricsLogger(str(tmp_path), report_to=["tensorboard", "wandb"]) as metrics_logger:
        metrics_logger.log(1, {"loss": float("nan"), "reward/mean": float("inf"), "kl": 0.5})
        metrics_logger.log(2, {"loss": torch.tensor(float("nan")), "kl": 0.25})
    rows = read_jsonl(tmp_path / "logging.jsonl")
    assert [{k: v for k, v in row.items() if k != "time"} for row in rows] == [
        {"step": 1, "loss": None, "reward/mean": None, "kl": 0.5},
        {"step": 2, "loss": None, "kl": 0.25},
    ]
    assert read_scalars(str(tmp_path / "runs")) == {"kl": [(1, 0.5), (2, 0.25)]}
    assert fake_wandb.run.logged == [(1, {"kl": 0.5}), (2, {"kl": 0.25})]
    messages = [(r.levelno, r.getMessage()) for r in swift_logs.records]
    assert messages == [
        (logging.INFO, "step 1 | loss=nan reward/mean=inf kl=0.5"),
        (logging.WARNING, "non-finite metrics not sent to tensorboard, wandb "
                          "(logging.jsonl records null): loss, reward/mean"),
        (logging.INFO, "step 2 | loss=nan kl=0.25"),  # loss already warned about
    ]


def test_wandb_sink(tmp_path, fake_wandb):
    config = {"lr": 1e-5, "model": "tiny"}
    sinks = SinkSettings(wandb_project="my-project", wandb_exp_name="run-7")
    metrics_logger = MetricsLogger(str(tmp_path), report_to=["wandb"], run_config=config,
                                   sinks=sinks)
    assert fake_wandb.init_kwargs == {"project": "my-project", "name": "run-7",
                                      "dir": str(tmp_path), "config": config}
    metrics_logger.log(3, {"loss": torch.tensor(0.5), "grad_norm": 1.0})
    metrics_logger.close()
    metrics_logger.close()
    assert fake_wandb.run.logged == [(3, {"loss": 0.5, "grad_norm": 1.0})]
    assert fake_wandb.run.finished == 1


def test_wandb_defaults_are_ms_swifts_and_ignore_the_environment(tmp_path, fake_wandb,
                                                                 monkeypatch):
    # ms-swift passes project and name to wandb.init, whose arguments override WANDB_PROJECT
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    monkeypatch.chdir(tmp_path)
    with MetricsLogger("out/v0", report_to=["wandb"]):
        pass
    assert fake_wandb.init_kwargs == {"project": "megatron-swift",
                                      "name": str(tmp_path / "out" / "v0"), "dir": "out/v0",
                                      "config": None}


def test_swanlab_sink(tmp_path, fake_swanlab, monkeypatch):
    monkeypatch.setenv("SWANLAB_PROJECT", "from-env")
    sinks = SinkSettings(swanlab_project="lab", swanlab_exp_name="exp-3")
    with MetricsLogger(str(tmp_path), report_to=["swanlab"], run_config={"a": 1},
                       sinks=sinks) as ml:
        ml.log(2, {"loss": 0.5})
    assert fake_swanlab.init_kwargs == {"project": "lab", "experiment_name": "exp-3",
                                        "logdir": str(tmp_path / "swanlog"), "config": {"a": 1}}
    assert (tmp_path / "swanlog").is_dir()
    assert fake_swanlab.logged == [(2, {"loss": 0.5})]
    assert fake_swanlab.fake_run.finished == 1


def test_swanlab_defaults(tmp_path, fake_swanlab):
    with MetricsLogger(str(tmp_path), report_to=["swanlab"]):
        pass
    assert (fake_swanlab.init_kwargs["project"], fake_swanlab.init_kwargs["experiment_name"]) \
        == ("megatron-swift", str(tmp_path))


def test_tensorboard_events_land_in_tensorboard_dir(tmp_path):
    board = tmp_path / "board"
    with MetricsLogger(str(tmp_path / "out"), report_to=["tensorboard"],
                       sinks=SinkSettings(tensorboard_dir=str(board))) as metrics_logger:
        metrics_logger.log(4, {"loss": 0.75})
    assert read_scalars(str(board)) == {"loss": [(4, 0.75)]}
    assert not (tmp_path / "out" / "runs").exists()


def test_the_trainer_passes_the_sink_flags(tmp_path, fake_wandb, fake_swanlab):
    from types import SimpleNamespace

    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command
    from swift_megatron.rlhf.grpo.components import loggers

    args = parse_command(RlhfArguments, [
        "--model", "m", "--dataset", "d", "--report_to", "tensorboard", "wandb", "swanlab",
        "--tensorboard_dir", str(tmp_path / "tb"), "--wandb_project", "wp",
        "--wandb_exp_name", "wn", "--swanlab_project", "sp", "--swanlab_exp_name", "sn"],
        "megatron rlhf")
    metrics, completions = loggers(args, SimpleNamespace(rank=0), str(tmp_path / "out"), {})
    with metrics:
        metrics.log(1, {"loss": 1.0})
    completions.close()
    assert (fake_wandb.init_kwargs["project"], fake_wandb.init_kwargs["name"]) == ("wp", "wn")
    assert (fake_swanlab.init_kwargs["project"], fake_swanlab.init_kwargs["experiment_name"]) \
        == ("sp", "sn")
    assert read_scalars(str(tmp_path / "tb")) == {"loss": [(1, 1.0)]}


@pytest.mark.parametrize("sink", ["wandb", "swanlab"])
@pytest.mark.parametrize("enabled", [True, False])
def test_uninstalled_sink_is_a_user_error_on_every_rank(tmp_path, monkeypatch, sink, enabled):
    monkeypatch.setitem(sys.modules, sink, None)  # `import <sink>` raises ImportError
    with pytest.raises(UserError) as info:
        MetricsLogger(str(tmp_path / "out"), report_to=["tensorboard", sink], enabled=enabled)
    assert str(info.value) == f"--report_to {sink}: {sink} is not installed (pip install {sink})"
    assert not (tmp_path / "out").exists()


def test_unknown_sink_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match=r"^--report_to mlflow: unknown sink \(choose from "
                                        r"tensorboard, wandb, swanlab or none\)$"):
        MetricsLogger(str(tmp_path), report_to=["mlflow"])


def test_check_report_to_dedupes_and_drops_none():
    assert check_report_to(["tensorboard", "none", "tensorboard"]) == ["tensorboard"]
    assert check_report_to([]) == []


def test_disabled_logger_writes_nothing(tmp_path, swift_logs, fake_wandb):
    out = tmp_path / "out"
    with MetricsLogger(str(out), report_to=["tensorboard", "wandb"], enabled=False) as ml:
        ml.log(1, {"loss": 1.0})
    assert not out.exists()
    assert swift_logs.records == []
    assert fake_wandb.init_kwargs is None and fake_wandb.run.logged == []


def test_close_is_idempotent_and_log_after_close_raises(tmp_path):
    metrics_logger = MetricsLogger(str(tmp_path), report_to=["tensorboard"])
    metrics_logger.log(1, {"loss": 1.0})
    metrics_logger.close()
    metrics_logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        metrics_logger.log(2, {"loss": 1.0})
    assert read_scalars(str(tmp_path / "runs")) == {"loss": [(1, 1.0)]}


# ---------------------------------------------------------------------------------------------
# CompletionsLogger


def test_completions_jsonl_content(tmp_path):
    rows = [
        {"truncated": False, "completion": "4", "prompt": "2+2?", "prompt_id": 0,
         "reward": 1.0, "rewards": {"accuracy": 1.0, "format": torch.tensor(0.0)},
         "advantage": torch.tensor(0.5), "length": 1, "extra": "kept"},
        {"prompt": "1+1? é", "completion": "3", "reward": float("nan"),
         "rewards": {"accuracy": float("nan")}, "prompt_id": 1, "step": 7},
    ]
    with CompletionsLogger(str(tmp_path / "out"), enabled=True) as completions:
        completions.log(7, rows)
        completions.log(8, [{"prompt": "p", "completion": "c"}])
    path = tmp_path / "out" / "completions.jsonl"
    lines = path.read_text(encoding="utf-8").splitlines()
    assert [list(json.loads(line)) for line in lines] == [
        ["step", "prompt_id", "prompt", "completion", "reward", "rewards", "advantage",
         "length", "truncated", "extra"],
        ["step", "prompt_id", "prompt", "completion", "reward", "rewards"],
        ["step", "prompt", "completion"],
    ]
    assert read_jsonl(path) == [
        {"step": 7, "prompt_id": 0, "prompt": "2+2?", "completion": "4", "reward": 1.0,
         "rewards": {"accuracy": 1.0, "format": 0.0}, "advantage": 0.5, "length": 1,
         "truncated": False, "extra": "kept"},
        {"step": 7, "prompt_id": 1, "prompt": "1+1? é", "completion": "3", "reward": None,
         "rewards": {"accuracy": None}},
        {"step": 8, "prompt": "p", "completion": "c"},
    ]
    assert "é" in lines[1]  # readable, not \u-escaped


def test_completions_require_prompt_and_completion(tmp_path):
    with CompletionsLogger(str(tmp_path)) as completions:
        with pytest.raises(ValueError, match=r"row 1 lacks \['completion'\]"):
            completions.log(1, [{"prompt": "a", "completion": "b"}, {"prompt": "a"}])
        with pytest.raises(ValueError, match="row 0 has step 2, logged at step 1"):
            completions.log(1, [{"prompt": "a", "completion": "b", "step": 2}])
    assert (tmp_path / "completions.jsonl").read_text() == ""  # nothing half-written


def test_completions_flushed_per_call_and_disabled_writes_nothing(tmp_path):
    completions = CompletionsLogger(str(tmp_path / "on"), enabled=True)
    completions.log(1, [{"prompt": "a", "completion": "b"}])
    assert len(read_jsonl(tmp_path / "on" / "completions.jsonl")) == 1  # before close
    completions.close()
    completions.close()
    disabled = CompletionsLogger(str(tmp_path / "off"), enabled=False)
    disabled.log(1, [{"prompt": "a", "completion": "b"}])
    disabled.close()
    assert not (tmp_path / "off").exists()


def test_importing_metrics_does_not_import_tensorboard():
    import subprocess

    code = ("import sys, swift_megatron.logging.metrics, swift_megatron.logging.completions; "
            "print(any(m.startswith(('tensorboard', 'torch.utils.tensorboard')) "
            "for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_reduce_metrics_propagates_nan():
    assert math.isnan(reduce_metrics([{"loss": float("nan")}, {"loss": 1.0}])["loss"])
