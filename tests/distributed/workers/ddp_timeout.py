"""Worker: start a run's process groups from `megatron rlhf` flags (rlhf/grpo/components.py
`parallel_state`, here PP=2 over 2 processes) and record the timeout of each group: the world,
every megatron parallel_state group (gloo ones too), ours (the model replica's) and one made
afterwards the way vLLM's colocated engine and the rollout client make theirs
(torch.distributed.new_group). Writes {out_dir}/rank{R}.json: {group: seconds}.
"""
import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.parallel.state import ParallelState
from swift_megatron.rlhf.grpo.components import parallel_state

MEGATRON_GROUPS = ("tensor_model_parallel", "pipeline_model_parallel", "data_parallel",
                   "context_parallel", "model_parallel", "embedding", "position_embedding",
                   "expert_model_parallel", "expert_data_parallel", "tensor_and_data_parallel")


def timeout_of(group) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir")
    parser.add_argument("--ddp_timeout")
    a = parser.parse_args()
    args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--device", "cpu",
                                         "--pipeline_model_parallel_size", "2",
                                         "--ddp_timeout", a.ddp_timeout], "megatron rlhf")
    state = parallel_state(args)
    groups = {"world": dist.group.WORLD, "replica": state.mp_group,
              "data_parallel_gloo": mpu.get_data_parallel_group_gloo(),
              "later": dist.new_group(backend="gloo")}
    for name in MEGATRON_GROUPS:
        with contextlib.suppress(AssertionError):   # a group this rank is not in
            groups[name] = getattr(mpu, f"get_{name}_group")()
    with open(os.path.join(a.out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({name: timeout_of(group) for name, group in groups.items()}, f)
    ParallelState.destroy()


if __name__ == "__main__":
    main()
