"""`arg()`: declare a command-line flag as a dataclass field, with its help text at the field.

Metadata keys read by arguments/parser.py:
- help: one or more sentences shown by `--help` (type and default are appended there);
- choices: allowed values;
- aliases: extra flag names accepted for the same field (e.g. --tuner_type for --train_type);
- not_yet: set when the feature behind the flag does not exist yet; passing a value other than
  the default then fails with "not supported yet" instead of being silently ignored. A dict
  {value: reason} refuses only those values;
- no_effect: set on an ms-swift flag that has no effect in our design (a Transformer Engine
  fusion, a dataloader setting): the flag is accepted quietly; `--dry_run true` names every such
  flag it was given, with this reason.
"""
import dataclasses
from typing import Any, Optional, Sequence


def arg(default: Any = None, help: str = "", *, choices: Optional[Sequence] = None,
        aliases: Sequence[str] = (), not_yet: Optional[Any] = None,
        no_effect: Optional[str] = None):
    """A dataclass field that becomes one flat `--name` flag."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None,
                "aliases": tuple(aliases), "not_yet": not_yet, "no_effect": no_effect}
    if isinstance(default, (list, dict)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)
