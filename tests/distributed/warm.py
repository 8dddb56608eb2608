"""A warm process for the tests' `megatron` commands and torchrun worker scripts (run_together):
multiprocessing's forkserver, started once per pytest worker with the commands' modules
preloaded, forks one child per process. Every `python -m swift_megatron.cli.main rlhf` otherwise
spends most of a tiny run importing megatron.core (torch's dynamo and inductor), transformers'
modeling code and matplotlib: 8.5 s of CPU per process, 20 s for a two-rank launch with its
torchrun.

A one-process command's child takes the command's environment, working directory, output files
and argv, then runs the CLI's own `main()`, exit path included (exit_without_teardown). A launch
of N ranks on one node (`megatron` under NPROC_PER_NODE=N, or `torch.distributed.run
--nproc_per_node=N script`) becomes N children, each given the variables torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...), rank 0 hosting the
rendezvous store; as under torchrun, the ranks share the output files, and a rank that fails
stops the others. What this skips is the launch itself: swift_megatron.launch's relaunch and
exit codes are tested through real torchrun (tests/unit/test_cli.py, tests/e2e), and a caller
that checks them passes `warm_start=False` to run_together.

A command runs as a plain subprocess instead when it starts vLLM (any vLLM flag or path, except
a `--vllm_mode server` trainer's: its engines are a rollout server's) or names a config file
(vLLM's shared-memory segments are removed only by a real interpreter's teardown), is not one of
COMMANDS, spans several nodes, or runs in an environment other than the warm process's, apart
from FREE_ENV: modules read some variables when they are imported, so a preloaded module would
not see the change."""
import multiprocessing
import os
import runpy
import subprocess
import sys
import time
from typing import Dict, List, NamedTuple, Optional

PRELOAD = ["swift_megatron.cli.main", "swift_megatron.cli.rlhf", "swift_megatron.cli.export",
           "swift_megatron.rlhf.grpo.trainer", "transformers.modeling_utils", "matplotlib.pyplot"]
COMMANDS = ("rlhf", "export", "plot", "demo")
FREE_ENV = {"MASTER_PORT", "PYTEST_CURRENT_TEST", "SWIFT_MEGATRON_NO_BAR", "PYTHONPATH",
            "NPROC_PER_NODE", "SWIFT_MEGATRON_ROLLOUT_API_KEY"}
CLI = [sys.executable, "-m", "swift_megatron.cli.main"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

_server = {}   # "context": the forkserver context, "env": the environment it started with


class Launch(NamedTuple):
    """What one command runs: `target` ("cli" or a worker script's path) with `argv`, on
    `nproc` ranks meeting at `master_port`, as torchrun's workers (`torchrun`) or as one plain
    process."""
    target: str
    argv: List[str]
    nproc: int
    master_port: str
    torchrun: bool


def parse(cmd, env) -> Optional[Launch]:
    """The Launch of `cmd` (with environment `env`) when it may run as children of the warm
    process, else None."""
    cmd = list(map(str, cmd))
    if starts_vllm(cmd[3:]) or any(arg.startswith("--config") for arg in cmd[3:]):
        return None
    base = _server.get("env", os.environ)
    if any(env.get(key) != base.get(key) for key in (set(env) | set(base)) - FREE_ENV):
        return None
    if cmd[:3] == CLI and len(cmd) > 3 and cmd[3] in COMMANDS:
        nproc = env.get("NPROC_PER_NODE") or "1"
        if not nproc.isdigit() or int(nproc) < 1:
            return None   # a bad value: the command's own error
        return Launch("cli", cmd[3:], int(nproc), env.get("MASTER_PORT", "29500"),
                      torchrun=bool(env.get("NPROC_PER_NODE")))
    if cmd[:3] == TORCHRUN:
        options, rest = {}, cmd[3:]
        while rest and rest[0].startswith("--") and "=" in rest[0]:
            name, value = rest.pop(0)[2:].split("=", 1)
            options[name] = value
        if set(options) == {"nproc_per_node", "master_addr", "master_port"} and rest and \
                options["nproc_per_node"].isdigit() and options["master_addr"] == "127.0.0.1":
            return Launch(rest[0], rest[1:], int(options["nproc_per_node"]),
                          options["master_port"], torchrun=True)
    return None


def starts_vllm(args: List[str]) -> bool:
    """Whether a command with these arguments may start a vLLM engine in its own process: it
    names vLLM anywhere, and is not a `--vllm_mode server` trainer."""
    server = "--vllm_mode" in args[:-1] and args[args.index("--vllm_mode") + 1] == "server"
    return any("vllm" in arg for arg in args) and not server


def forkable(cmd, env) -> bool:
    """Whether `cmd` (with environment `env`) may run as children of the warm process."""
    return parse(cmd, env) is not None


def rank_env(env, launch: Launch, rank: int) -> Dict[str, str]:
    """The environment of `rank`: the command's, plus what torchrun sets for its workers."""
    env = {key: value for key, value in env.items() if key != "NPROC_PER_NODE"}
    if launch.torchrun:
        n = str(launch.nproc)
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                   WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, ROLE_WORLD_SIZE=n, GROUP_WORLD_SIZE="1",
                   ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=launch.master_port,
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
    return env


def start(cmd, env, cwd, stdout_path, stderr_path) -> "Ranks":
    """`cmd` (forkable) as children of the warm process (started on first use), their output
    written to the two paths."""
    if not _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _server.update(context=context, env=dict(os.environ))
    launch = parse(cmd, env)
    processes = [_server["context"].Process(
        target=_run, args=(launch.target, launch.argv, rank_env(env, launch, rank), cwd,
                           stdout_path, stderr_path)) for rank in range(launch.nproc)]
    for process in processes:
        process.start()
    return Ranks(processes)


def _run(target, argv, env, cwd, stdout_path, stderr_path):
    """In the child: become `python -m swift_megatron.cli.main ARGV` (target "cli") or
    `python SCRIPT ARGV`, and run it."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        with open(path, "a") as f:   # the ranks share the files, as torchrun's workers do
            os.dup2(f.fileno(), fd)
    if target == "cli":
        from swift_megatron.cli import main

        sys.argv = [main.__file__, *argv]
        main.main()
    else:
        sys.argv = [target, *argv]
        sys.path.insert(0, os.path.dirname(target))
        runpy.run_path(target, run_name="__main__")


class Ranks:
    """The subprocess.Popen methods run_together uses, for the children of one command. When a
    rank fails the others are killed (as torchrun stops its workers); the exit code is then
    the launcher's (swift_megatron.launch.launcher_exit_code)."""

    def __init__(self, processes):
        self.processes = processes

    @property
    def returncode(self):
        codes = [p.exitcode for p in self.processes]
        if None in codes:
            return None
        if len(codes) == 1 or not any(codes):
            return codes[0]
        from swift_megatron.launch import launcher_exit_code

        return launcher_exit_code([code for code in codes if code])

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            if any(p.exitcode for p in self.processes):   # one failed: stop the rest
                self.kill()
            elif deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("warm ranks", timeout)
            self.processes[0].join(0.05) if len(self.processes) == 1 else time.sleep(0.05)
        return self.returncode

    def kill(self):
        for process in self.processes:
            if process.exitcode is None:
                process.kill()
        for process in self.processes:
            process.join()
