"""`megatron <command> [flags]`: route to a command module; user errors exit 2 without traceback.

Commands: rlhf (GRPO training), export (HF <-> Megatron conversion), rollout (vLLM server),
demo (the tiny end-to-end job on an embedded model and dataset), plot (a run's report from its
logs). Importing this module and parsing flags never imports torch, so every `--help` is
instant.
"""
import importlib
import sys

from swift_megatron.errors import UserError

COMMANDS = {
    "rlhf": ("swift_megatron.cli.rlhf", "GRPO training of an HF causal LM on Megatron-core"),
    "export": ("swift_megatron.cli.export", "convert HF <-> Megatron checkpoints, merge LoRA"),
    "rollout": ("swift_megatron.cli.rollout", "serve vLLM rollouts for server-mode training"),
    "demo": ("swift_megatron.cli.demo", "the main job on an embedded tiny model and dataset"),
    "plot": ("swift_megatron.cli.plot", "a run's report: metric plots, summary, completions page"),
}

USAGE = "usage: megatron {" + ",".join(COMMANDS) + "} [flags]   (megatron <command> --help)\n\n" + \
    "\n".join(f"  {name:<8} {text}" for name, (_, text) in COMMANDS.items())


def run(argv) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        raise UserError(f"megatron: unknown command '{command}'{hint}\n{USAGE}")
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(rest) or 0


def main(argv=None) -> None:
    try:
        code = run(sys.argv[1:] if argv is None else list(argv))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = exc.exit_code
    sys.exit(code)


if __name__ == "__main__":
    main()
