"""benchmarks/async_cpu.py's reduction of logging.jsonl rows (the benchmark itself starts a
rollout server and two training runs: not part of the test suite): per-batch wall time from
the rows' `time` stamps after the warm-up rows, completion tokens per second, phase means,
staleness mean and max, importance-correction means; the async/sync ratios; the table."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
async_cpu = pytest.importorskip("async_cpu")


def row(step, time, tokens, **extra):
    return {"step": step, "time": time, "rollout/completion_tokens": tokens,
            "time/rollout_s": 0.5 * step, "time/train_s": 1.0, **extra}


ASYNC_ROWS = [
    row(1, 100.0, 999, **{"rollout/staleness": 0.0, "rollout/staleness_max": 0.0,
                          "rollout/is_weight_mean": 1.0}),
    row(2, 102.0, 300, **{"rollout/staleness": 1.0, "rollout/staleness_max": 1.0,
                          "rollout/is_weight_mean": 0.5, "rollout_correction/ess": 0.75}),
    row(3, 105.0, 200, **{"rollout/staleness": 0.5, "rollout/staleness_max": 2.0,
                          "rollout/is_weight_mean": 0.75, "rollout_correction/ess": None}),
]


def test_summarize_leaves_out_the_warmup_rows():
    summary = async_cpu.summarize(ASYNC_ROWS, warmup=1, run_s=20.0)
    assert summary == {
        "batches": 2, "wall_s": 5.0, "batch_s": 2.5, "completion_tokens": 500,
        "tokens_per_s": 100.0, "rollout_s": 1.25, "train_s": 1.0, "staleness": 0.75,
        "staleness_max": 2.0, "is_weight_mean": 0.625, "ess": 0.75, "run_s": 20.0}


def test_summarize_with_two_warmup_rows_and_a_synchronous_run():
    rows = [row(1, 10.0, 1), row(2, 14.0, 8), row(3, 18.0, 40)]
    assert async_cpu.summarize(rows, warmup=2) == {
        "batches": 1, "wall_s": 4.0, "batch_s": 4.0, "completion_tokens": 40,
        "tokens_per_s": 10.0, "rollout_s": 1.5, "train_s": 1.0}


@pytest.mark.parametrize("warmup", [0, 3])
def test_summarize_needs_a_row_before_and_after_the_warmup(warmup):
    with pytest.raises(ValueError, match="warmup"):
        async_cpu.summarize(ASYNC_ROWS, warmup=warmup)


def test_ratios_use_each_modes_mean():
    sync = [{"tokens_per_s": 100.0, "batch_s": 4.0}, {"tokens_per_s": 300.0, "batch_s": 2.0}]
    async_ = [{"tokens_per_s": 300.0, "batch_s": 1.5}]
    assert async_cpu.ratios(sync, async_) == {"tokens_per_s_ratio": 1.5, "batch_s_speedup": 2.0}


def test_markdown_table():
    table = async_cpu.markdown_table({"sync": {"batches": 2, "batch_s": 2.5,
                                               "tokens_per_s": 1234.5678}})
    header, rule, line = table.splitlines()
    assert header.startswith("| run | batches | batch_s | tokens_per_s | rollout_s |")
    assert rule == "|" + "---|" * len(async_cpu.COLUMNS)
    assert line == "| sync | 2 | 2.5 | 1235 | " + " | ".join(["-"] * 13) + " |"
