"""Write docs/arguments.md, the flag reference of every command, from the argument dataclasses
(the help text lives at each field). tests/unit/test_docs.py fails when the file is stale.

    python scripts/gen_arguments_doc.py
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from swift_megatron.arguments.commands import (ExportCommandArguments, RlhfArguments,  # noqa: E402
                                               RolloutCommandArguments)
from swift_megatron.arguments.parser import command_groups, group_specs  # noqa: E402
from swift_megatron.cli.demo import DemoCommand  # noqa: E402
from swift_megatron.cli.plot import PlotCommand  # noqa: E402

COMMANDS = [("megatron rlhf", RlhfArguments), ("megatron export", ExportCommandArguments),
            ("megatron rollout", RolloutCommandArguments), ("megatron plot", PlotCommand),
            ("megatron demo", DemoCommand)]
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                   "arguments.md")


def _default(spec) -> str:
    value = spec.default
    return "none" if value is None else json.dumps(value) if isinstance(value, (bool, list, dict)) \
        else str(value)


def render() -> str:
    lines = ["# Flag reference", "",
             "Generated from the argument dataclasses by `python scripts/gen_arguments_doc.py`; "
             "every flag is also listed by `<command> --help`. A YAML/JSON file of the same "
             "names works too: `--config run.yaml` (flags on the command line override it).", ""]
    for command, cls in COMMANDS:
        lines += [f"## {command}", ""]
        for _, group in command_groups(cls):
            title = (group.__doc__ or group.__name__).strip().splitlines()[0]
            lines += [f"### {title}", "", "| flag | type | default | meaning |", "|---|---|---|---|"]
            for spec in group_specs(group):
                aliases = "".join(f" (also `--{a}`)" for a in spec.meta.get("aliases", ()))
                help_text = spec.meta.get("help", "").replace("|", "\\|")
                lines.append(f"| `--{spec.name}`{aliases} | {spec.type_name().replace('|', ', ')} "
                             f"| `{_default(spec)}` | {help_text} |")
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    with open(OUT, "w") as f:
        f.write(render())
    print(f"wrote {OUT}")
