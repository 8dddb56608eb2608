"""benchmarks/trl_compare.py's TRL launch: torchrun accepts the worker's command line at 2 GPUs
(an option of the worker's named like one of torchrun's own made torchrun refuse it as
ambiguous on the two-GPU machine) and passes the worker's options through unchanged."""
import argparse
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
