"""`--system`: the system prompt of rows that have none, given as text or as a .txt file (as
ms-swift reads it). Priority, as ms-swift: the row's own system message, then --system, then
the chat template's default."""
import os
from typing import Optional

from swift_megatron.errors import UserError


def system_prompt(system: Optional[str]) -> Optional[str]:
    """--system as text: a value ending in .txt is a file to read."""
    if system is None or not system.endswith(".txt"):
        return system
    if not os.path.isfile(system):
        raise UserError(f"--system {system}: no such file (a value ending in .txt is read as a "
                        "file)")
    try:
        with open(system, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as exc:
        raise UserError(f"--system {system}: not UTF-8 text ({exc})") from None
