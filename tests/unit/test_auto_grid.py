"""benchmarks/auto_grid.py, where no GPU is needed: the `auto` run leaves every layout flag to
the planner, the grids' flags parse, and the verdict fails each thing it checks."""
import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
auto_grid = pytest.importorskip("auto_grid")

LAYOUT_FLAGS = ("--recompute_granularity", "--tensor_model_parallel_size",
                "--pipeline_model_parallel_size", "--sequence_parallel",
                "--max_tokens_per_micro_batch", "--offload_ref_model", "--offload_optimizer")


def _command(flags, nproc=1):
    a = argparse.Namespace(nproc=nproc, completion_length=256, rollout_batches=3, sleep_level=1,
                           lora=0, rlhf_args=[], free_layout=True)
    task = ["--dataset", "d.jsonl", "--reward_funcs", "accuracy"]
    return auto_grid.run_ours.__globals__["ours_command"](a, "/m", task, "/o", flags)


def _explicit(cmd):
    from swift_megatron.arguments.commands import RlhfArguments
    from swift_megatron.arguments.parser import parse_command

    return parse_command(RlhfArguments, cmd[cmd.index("rlhf") + 1:], "megatron rlhf")


def test_the_auto_run_sets_no_layout_flag():
    """The planner keeps what a user sets: the automatic choice must see none of it."""
    cmd = _command(auto_grid.AUTO[1])
    assert not set(LAYOUT_FLAGS) & set(cmd)
    args = _explicit(cmd)
    assert args.planning.auto_parallel
    assert not {f.lstrip("-") for f in LAYOUT_FLAGS} & set(args.explicit)


@pytest.mark.parametrize("nproc", sorted(auto_grid.GRIDS))
def test_every_grid_layout_parses(nproc):
    for label, flags in auto_grid.GRIDS[nproc]:
        args = _explicit(_command(flags.split(), nproc))
        assert "recompute_granularity" in args.explicit, label   # each layout says its own


def _run(wall, ratio=1.0):
    return {"wall_s": wall, "estimate_vs_training": ratio, "training_gib": 40.0,
            "estimate/train_gib": 40.0 * ratio}


@pytest.mark.parametrize("results,failed", [
    ({"auto": _run(10.5), "a": _run(10.0), "b": _run(12.0)}, []),
    ({"auto": _run(11.5), "a": _run(10.0)}, ["auto 11.50 s per rollout batch, more than 10% "
                                              "slower than a's 10.00 s"]),
    ({"a": _run(10.0)}, ["the automatic choice did not run"]),
    ({"auto": _run(9.0), "a": _run(10.0, 0.85)}, ["a: estimate / measured peak 0.85 outside "
                                                  "1 +- 0.1"]),
])
def test_verdict(results, failed):
    assert auto_grid.verdict(results) == failed


def test_table_names_the_runs_that_failed():
    results = {"auto": _run(10.5), "a": _run(10.0)}
    lines = auto_grid.table(["auto", "a", "b"], results).splitlines()
    assert lines[2] == "| auto | 10.50 | 1.05x | 40.0 | 40.0 | 1.000 |"
    assert lines[4].startswith("| b | failed")
