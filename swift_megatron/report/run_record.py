"""The run's record for summary.md: `{output_dir}/args.json`, written by the training run.

    {"command": "megatron rlhf", "flags": {flag: value, ...every flag...},
     "given": [the flags the user set], "batch_plan": {...BatchPlan...},
     "train_iters": N}

`flags` is flat (one entry per command-line flag, ms-swift's args.json style; API keys
masked). The file is
replaced atomically, so a reader never sees half of it.
"""
import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

ARGS_FILE = "args.json"


SECRET_SUFFIX = "api_key"  # flags whose values are never written (--vllm_server_api_key, ...)


def flat_flags(args) -> Dict[str, Any]:
    """{flag name: value} over every group of a command dataclass (e.g. RlhfArguments), with
    secrets (flags named *api_key) masked."""
    from swift_megatron.arguments.parser import flat_values

    return {name: "***" if name.endswith(SECRET_SUFFIX) and value else value
            for name, value in flat_values(args).items()}


def given_flags(args) -> List[str]:
    """The flags the user set (command line or config file: `args.explicit`), in declaration
    order."""
    explicit = getattr(args, "explicit", frozenset())
    return [name for name in flat_flags(args) if name in explicit]


def record_run(output_dir: str, command: str, args, plan=None,
               train_iters: Optional[int] = None) -> str:
    """Write `{output_dir}/args.json` (see the module docstring); returns its path."""
    record = {"command": command, "flags": flat_flags(args), "given": given_flags(args),
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
