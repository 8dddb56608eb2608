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

from swift_megatron.errors import UserError

SEED_MAX = 2**32 - 1   # numpy's (and so vLLM's and transformers' set_seed) largest seed


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


def check_seed(name: str, value: int) -> None:
    """A seed in [0, 2**32 - 1], the range every seeded library accepts."""
    if not 0 <= value <= SEED_MAX:
        raise UserError(f"--{name} must be in [0, {SEED_MAX}] (2**32 - 1, the largest seed numpy "
                        f"and vLLM accept), got {value}")


def refuse_empty(group: Any, names: Sequence[str]) -> None:
    """Path flags given as '' (e.g. `--output_dir ''`): an error, not a silent default."""
    for name in names:
        value = getattr(group, name)
        if isinstance(value, str) and not value.strip():
            raise UserError(f"--{name} got an empty value; give a path")
