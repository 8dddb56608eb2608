"""The run's record for summary.md: `{output_dir}/args.json`, written by the training run.

    {"command": "megatron rlhf", "flags": {flag: value, ...every flag...},
     "changed": [flags whose value differs from the default], "batch_plan": {...BatchPlan...},
     "train_iters": N}

`flags` is flat (one entry per command-line flag, ms-swift's args.json style). The file is
replaced atomically, so a reader never sees half of it.
"""
import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

ARGS_FILE = "args.json"


def flat_flags(args) -> Dict[str, Any]:
    """{flag name: value} over every group of a command dataclass (e.g. RlhfArguments)."""
    flags: Dict[str, Any] = {}
    for group in dataclasses.fields(args):
        flags.update(dataclasses.asdict(getattr(args, group.name)))
    return flags


def group_defaults(group_cls) -> Dict[str, Any]:
    """A group's defaults as a bare command line resolves them (its __post_init__ fills some,
    e.g. --lr from --train_type); the declared defaults where a bare group is not valid."""
    from swift_megatron.arguments.parser import group_specs

    try:
        return dataclasses.asdict(group_cls())
    except Exception:  # a group that needs a value: compare with the declared defaults
        return {spec.name: spec.default for spec in group_specs(group_cls)}


def changed_flags(args) -> List[str]:
    """The flags whose value differs from the default, in declaration order."""
    changed = []
    for group in dataclasses.fields(args):
        values = dataclasses.asdict(getattr(args, group.name))
        defaults = group_defaults(type(getattr(args, group.name)))
        changed += [name for name, value in values.items() if value != defaults.get(name)]
    return changed


def record_run(output_dir: str, command: str, args, plan=None,
               train_iters: Optional[int] = None) -> str:
    """Write `{output_dir}/args.json` (see the module docstring); returns its path."""
    record = {"command": command, "flags": flat_flags(args), "changed": changed_flags(args),
              "batch_plan": dataclasses.asdict(plan) if plan is not None else None,
              "train_iters": train_iters}
    path = os.path.join(output_dir, ARGS_FILE)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(temporary, path)
    return path


def read_run_record(output_dir: str) -> Optional[dict]:
    """The record in args.json, or None when absent or unreadable (the report says so)."""
    path = os.path.join(output_dir, ARGS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("flags"), dict) else None
