"""Multi-process launching, as ms-swift does it: when NPROC_PER_NODE or NNODES is set (with
optional NODE_RANK, MASTER_ADDR, MASTER_PORT), a command re-executes itself under torchrun
(`python -m swift_megatron.launch`: torch.distributed.run, ending as one process would) with
those values; otherwise it runs as one process. NPROC_PER_NODE may be a number, `gpu` (one
process per visible GPU) or `auto` (per GPU, else per CPU core), as torchrun takes it.
"""
import os
import signal
import subprocess
import sys
from typing import List, Mapping, Optional, Sequence

from swift_megatron.errors import UserError

LAUNCH_VARS = ("NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PID = "SWIFT_MEGATRON_LAUNCHER_PID"   # set by relaunch for the workers of its torchrun
_STOPPING = [False]   # a SIGTERM arrived (exit_on_sigterm)
NPROC_WORDS = ("gpu", "auto")


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


def _device_count() -> int:
    import torch  # only for NPROC_PER_NODE=gpu|auto

    return torch.cuda.device_count()


def nproc_per_node(env: Mapping[str, str] = os.environ) -> int:
    """Processes per node: NPROC_PER_NODE as a number, or resolved like torchrun's gpu / auto."""
    value = (env.get("NPROC_PER_NODE") or "").strip()
    if value.lower() not in NPROC_WORDS:
        return _int_env(env, "NPROC_PER_NODE", 1)
    gpus = _device_count()
    if value.lower() == "gpu" and gpus == 0:
        raise UserError("NPROC_PER_NODE=gpu but no GPU is visible; give a number of processes")
    return gpus or os.cpu_count() or 1


def check_launch_env(env: Mapping[str, str] = os.environ) -> None:
    """UserError for launch variables torchrun would reject (checked by the dry run too)."""
    nnodes = _int_env(env, "NNODES", 1)
    node_rank = _int_env(env, "NODE_RANK", 0)
    if node_rank >= nnodes:
        raise UserError(f"NODE_RANK={node_rank} must be smaller than NNODES={nnodes}")
    _int_env(env, "MASTER_PORT", 29500)
    if (env.get("NPROC_PER_NODE") or "").strip().lower() not in NPROC_WORDS:
        _int_env(env, "NPROC_PER_NODE", 1)


def under_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """True inside a torchrun-launched worker."""
    return "LOCAL_RANK" in env and "WORLD_SIZE" in env


def planned_world_size(env: Mapping[str, str] = os.environ) -> int:
    """The world size this command runs with: the launcher's, or NPROC_PER_NODE x NNODES."""
    if under_launcher(env):
        return _int_env(env, "WORLD_SIZE", 1)
    check_launch_env(env)
    return nproc_per_node(env) * _int_env(env, "NNODES", 1)


def wants_launcher(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the command relaunches itself under torchrun (NPROC_PER_NODE or NNODES set)."""
    return not under_launcher(env) and bool(env.get("NPROC_PER_NODE") or env.get("NNODES"))


def torchrun_argv(command: str, argv: Sequence[str],
                  env: Mapping[str, str] = os.environ) -> Optional[List[str]]:
    """The torchrun command line that relaunches `megatron <command> argv`, or None when this
    process should run the command itself (neither NPROC_PER_NODE nor NNODES, or already a
    launched worker)."""
    if not wants_launcher(env):
        return None
    check_launch_env(env)
    nproc = (env.get("NPROC_PER_NODE") or "1").strip()
    launcher = [sys.executable, "-m", "swift_megatron.launch",
                f"--nproc_per_node={nproc.lower() if nproc.lower() in NPROC_WORDS else int(nproc)}",
                f"--nnodes={_int_env(env, 'NNODES', 1)}",
                f"--node_rank={_int_env(env, 'NODE_RANK', 0)}",
                f"--master_addr={env.get('MASTER_ADDR') or '127.0.0.1'}",
                f"--master_port={_int_env(env, 'MASTER_PORT', 29500)}"]
    return launcher + ["-m", "swift_megatron.cli.main", command, *argv]


def relaunch(cmd: List[str]) -> int:
    """Run the launcher in the foreground and return its exit code. The launcher gets SIGTERM
    when this process dies, even by `kill -9`, and then stops its workers: nothing goes on
    training in the background. Ctrl-C reaches the launcher too (one process group): this
    process waits for it to stop its workers instead of killing it."""
    print("launching: " + " ".join(cmd), flush=True)
    parent = os.getpid()
    env = dict(os.environ, **{LAUNCHER_PID: str(parent)})
    with subprocess.Popen(cmd, env=env, preexec_fn=lambda: _terminate_with(parent)) as launcher:
        while True:
            try:
                return launcher.wait()
            except KeyboardInterrupt:
                continue


def stop_with_launcher(env: Mapping[str, str] = os.environ) -> None:
    """In a worker that torchrun started: SIGTERM when torchrun dies. torchrun stops its workers
    when it is stopped, but not when it dies before it can (kill -9, or a stop that reaches it
    while it is still starting them: measured, one worker trained on alone). Under `relaunch`,
    a worker whose launching command is already gone stops at once."""
    if "TORCHELASTIC_RUN_ID" not in env:
        return
    _terminate_with(os.getppid())
    launcher = env.get(LAUNCHER_PID, "")
    if launcher.isdigit() and not _alive(int(launcher)):
        import signal

        os.kill(os.getpid(), signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        pass
    return True


def _terminate_with(parent: int) -> None:
    """In a child (between fork and exec, or a worker as it starts): ask Linux to send it SIGTERM
    when `parent` dies (a no-op elsewhere); when the parent is already gone, terminate now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def launcher_exit_code(exit_codes: Sequence[int]) -> int:
    """The exit code of a launch whose failed workers exited with `exit_codes`. A worker that
    failed by itself exits 1-127; torchrun stops the others, which then show a signal (a
    negative code, or 128 + the signal where they handle it). 2 when each worker that failed by
    itself had a user error (exit 2), else the first other such code, else the first signal
    as 128 + its number."""
    own = [code for code in exit_codes if 0 < code < 128]
    if own:
        return next((code for code in own if code != 2), 2)
    return next((code if code > 0 else 128 - code for code in exit_codes), 1)


def run_torchrun(argv: Sequence[str]) -> int:
    """torch.distributed.run on `argv` (what `relaunch` runs), ending as one process would: a
    user error in the workers (exit 2; each printed its `error:` line) exits 2 without
    torchrun's traceback and failure table; another failure prints one line per failed rank;
    a stop (SIGTERM, SIGINT) exits 128 + the signal."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(list(argv)))
    except ChildFailedError as failed:
        ranks = sorted(failed.failures.items())
        code = launcher_exit_code([failure.exitcode for _, failure in ranks])
        if code != 2:
            for rank, failure in ranks:
                print(f"error: rank {rank} (pid {failure.pid}) exited with {failure.exitcode}",
                      file=sys.stderr, flush=True)
        return code
    except SignalException as stopped:
        return 128 + int(stopped.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(run_torchrun(sys.argv[1:]))


def exit_on_sigterm(signum, frame) -> None:
    """The trainer's SIGTERM handler (torchrun stopping its workers, a scheduler's kill): leave
    through the trainer's way out, which gives back a rollout server's weight-sync communicator,
    then exit 143; a second SIGTERM does not interrupt that way out."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _STOPPING[0] = True
    raise SystemExit(128 + signal.SIGTERM)


def raise_if_stopping() -> None:
    """SystemExit(143) when a SIGTERM arrived whose SystemExit Python swallowed: the handler runs
    wherever the interpreter is, and an exception raised inside a garbage-collector callback, a
    __del__ or a weakref callback is printed ("Exception ignored in ...") and dropped (seen: a
    trainer went on training after SIGTERM). The trainer calls this between rollout batches."""
    if _STOPPING[0]:
        raise SystemExit(128 + signal.SIGTERM)
