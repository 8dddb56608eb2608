"""Multi-process launching, as ms-swift does it: when NPROC_PER_NODE is set (with optional
NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT), a command re-executes itself under
`python -m torch.distributed.run` with those values; otherwise it runs as one process.
"""
import os
import subprocess
import sys
from typing import List, Mapping, Optional, Sequence

from swift_megatron.errors import UserError

LAUNCH_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def _int_env(env: Mapping[str, str], name: str, default: int) -> int:
    value = env.get(name)
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} must be an integer") from None
    if number < (0 if name == "NODE_RANK" else 1):
        raise UserError(f"{name}={value} is out of range")
    return number


def under_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a torchrun-launched worker."""
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def planned_world_size(env: Mapping[str, str] = os.environ) -> int:
    """The world size this command runs with: the launcher's, or NPROC_PER_NODE x NNODES."""
    if under_launcher(env):
        return _int_env(env, "WORLD_SIZE", 1)
    return _int_env(env, "NPROC_PER_NODE", 1) * _int_env(env, "NNODES", 1)


def torchrun_argv(command: str, argv: Sequence[str],
                  env: Mapping[str, str] = os.environ) -> Optional[List[str]]:
    """The torchrun command line that relaunches `megatron <command> argv`, or None when this
    process should run the command itself (no NPROC_PER_NODE, or already a launched worker)."""
    if under_launcher(env) or not env.get("NPROC_PER_NODE"):
        return None
    nnodes = _int_env(env, "NNODES", 1)
    node_rank = _int_env(env, "NODE_RANK", 0)
    if node_rank >= nnodes:
        raise UserError(f"NODE_RANK={node_rank} must be smaller than NNODES={nnodes}")
    launcher = [sys.executable, "-m", "torch.distributed.run",
                f"--nproc_per_node={_int_env(env, 'NPROC_PER_NODE', 1)}",
                f"--nnodes={nnodes}", f"--node_rank={node_rank}",
                f"--master_addr={env.get('MASTER_ADDR') or '127.0.0.1'}",
                f"--master_port={_int_env(env, 'MASTER_PORT', 29500)}"]
    return launcher + ["-m", "swift_megatron.cli.main", command, *argv]


def relaunch(cmd: List[str]) -> int:
    """Run the launcher in the foreground and return its exit code."""
    print("launching: " + " ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode
