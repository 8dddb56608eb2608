"""Run a worker script under torch.distributed.run on CPU (gloo) and collect its JSON results,
or several `megatron` commands at once (run_cli_together: two one-process runs on 2 cores take
about the time of one).

Each worker writes `{out_dir}/rank{RANK}.json`; `run_workers` returns those dicts by rank.
"""
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.distributed import warm

WORKERS = Path(__file__).parent / "workers"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port that is free now, drawn below the kernel's ephemeral range. A port from bind(0)
    lies inside that range, so between this call and the server's own bind, any outgoing
    connection may take it as its source port (CI saw `megatron rollout` fail with "Address
    already in use" while the trainer polled that very port)."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.SystemRandom().randrange(max(1024, low - 12000), low)   # not the seeded one
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port


def run_workers(script: str, nproc: int, out_dir, args=(), timeout: int = 300):
    return run_workers_together([(script, nproc, out_dir, args)], timeout)[0]


def run_workers_together(jobs, timeout: int = 300):
    """run_workers of each (script, nproc, out_dir, args) in `jobs`, all started at once (a
    one-process run next to another leaves no core idle); their results in that order."""
    commands = []
    for script, nproc, out_dir, args in jobs:
        os.makedirs(out_dir, exist_ok=True)
        commands.append(([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                          "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                          str(WORKERS / script), "--out_dir", str(out_dir), *map(str, args)], {}))
    results = []
    for (script, nproc, out_dir, _), proc in zip(jobs, run_together(commands, timeout)):
        if proc.returncode != 0:
            raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                                 f"{proc.stderr[-8000:]}")
        results.append([json.loads((Path(out_dir) / f"rank{r}.json").read_text())
                        for r in range(nproc)])
    return results


def run_cli_together(commands, timeout: int = 600, warm_start: bool = True):
    """`python -m swift_megatron.cli.main ARGV` for each (argv, env overrides) in `commands`, all
    started at once, each with its own MASTER_PORT; their CompletedProcess in that order. A
    command without vLLM runs as children forked from a process that has imported the command's
    modules once (warm.py; NPROC_PER_NODE=N: N ranks, without torchrun): the same code path,
    minus 8.5 s of imports per process. `warm_start=False`: plain subprocesses (what checks
    the relaunch under torchrun)."""
    return run_together([([sys.executable, "-m", "swift_megatron.cli.main", *map(str, argv)],
                          dict(env, SWIFT_MEGATRON_NO_BAR="1", MASTER_PORT=str(free_port())))
                         for argv, env in commands], timeout, cwd=REPO, warm_start=warm_start)


def run_together(commands, timeout: int, cwd=None, warm_start: bool = True):
    """Each (cmd, env overrides) in `commands` started at once (in `cwd`, OMP_NUM_THREADS=1 unless
    overridden); their CompletedProcess (text stdout and stderr) in that order. After a timeout
    the ones still running are killed and subprocess.TimeoutExpired is raised. Commands that
    warm.forkable accepts (`megatron` commands, torchrun worker scripts) run as forked children
    of the warm process, unless `warm_start` is False."""
    started = []
    for cmd, extra in commands:
        env = dict(os.environ, OMP_NUM_THREADS="1",   # keeps a PYTHONPATH the packages need
                   PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                            os.environ.get("PYTHONPATH")])))
        env.update(extra)
        logs = [tempfile.NamedTemporaryFile("w+") for _ in range(2)]   # stdout, stderr
        if warm_start and warm.forkable(cmd, env):
            proc = warm.start(cmd, env, cwd or os.getcwd(), logs[0].name, logs[1].name)
        else:
            proc = subprocess.Popen(cmd, stdout=logs[0], stderr=logs[1], text=True, env=env,
                                    cwd=cwd)
        started.append((cmd, proc, logs))
    deadline = time.monotonic() + timeout
    try:
        for _, proc, _ in started:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
    finally:
        for _, proc, _ in started:   # the others, after one failed or timed out
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = []
    for cmd, proc, logs in started:
        stdout, stderr = (log.seek(0) or log.read() for log in logs)
        for log in logs:
            log.close()
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    return results
