"""A warm process for the tests' one-process `megatron` commands (run_together): multiprocessing's
forkserver, started once per pytest worker with the commands' modules preloaded, forks one child
per command. The child takes the command's environment, working directory, output files and
argv, then runs the CLI's own `main()`, exit path included (exit_without_teardown). Every
`python -m swift_megatron.cli.main rlhf` otherwise spends most of a tiny run importing
megatron.core (torch's dynamo and inductor), transformers' modeling code and matplotlib.

A command runs as a plain subprocess instead when it starts vLLM or names a config file (vLLM's
shared-memory segments are removed only by a real interpreter's teardown), is not one of
COMMANDS, or runs in an environment other than the warm process's, apart from FREE_ENV: modules
read some variables when they are imported, so a preloaded module would not see the change."""
import multiprocessing
import os
import subprocess
import sys

PRELOAD = ["swift_megatron.cli.main", "swift_megatron.cli.rlhf", "swift_megatron.cli.export",
           "swift_megatron.rlhf.grpo.trainer", "transformers.modeling_utils", "matplotlib.pyplot"]
COMMANDS = ("rlhf", "export", "plot", "demo")
FREE_ENV = {"MASTER_PORT", "PYTEST_CURRENT_TEST", "SWIFT_MEGATRON_NO_BAR", "PYTHONPATH"}
CLI = [sys.executable, "-m", "swift_megatron.cli.main"]

_server = {}   # "context": the forkserver context, "env": the environment it started with


def forkable(cmd, env) -> bool:
    """Whether `cmd` (with environment `env`) may run as a child of the warm process."""
    if cmd[:3] != CLI or len(cmd) < 4 or cmd[3] not in COMMANDS:
        return False
    if any("vllm" in arg or arg.startswith("--config") for arg in map(str, cmd[4:])):
        return False
    base = _server.get("env", os.environ)
    return all(env.get(key) == base.get(key) for key in (set(env) | set(base)) - FREE_ENV)


def start(argv, env, cwd, stdout_path, stderr_path) -> "Child":
    """`megatron ARGV` in a child of the warm process (started on first use), its output
    written to the two paths."""
    if not _server:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _server.update(context=context, env=dict(os.environ))
    process = _server["context"].Process(target=_run_cli,
                                         args=(list(argv), env, cwd, stdout_path, stderr_path))
    process.start()
    return Child(process)


def _run_cli(argv, env, cwd, stdout_path, stderr_path):
    """In the child: become `python -m swift_megatron.cli.main ARGV` and run it."""
    from swift_megatron.cli import main

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        with open(path, "w") as f:
            os.dup2(f.fileno(), fd)
    sys.argv = [main.__file__, *argv]
    main.main()


class Child:
    """The subprocess.Popen methods run_together uses, for a multiprocessing child."""

    def __init__(self, process):
        self.process = process

    @property
    def returncode(self):
        return self.process.exitcode

    def poll(self):
        return self.process.exitcode

    def wait(self, timeout=None):
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout)
        return self.process.exitcode

    def kill(self):
        self.process.kill()
