"""Checks of the paths a command will write to, before anything is loaded: a user's mistake
(an existing file given as a directory) becomes a clear error naming the flag, not an OSError
from deep inside a save."""
import os

from swift_megatron.errors import UserError


def check_output_path(path: str, flag: str) -> None:
    """UserError when `path` (to become a directory) is an existing file, or lies under one."""
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return
        probe = parent
    if not os.path.isdir(probe):
        where = "is" if probe == os.path.abspath(os.path.expanduser(path)) else \
            f"lies under {probe}, which is"
        raise UserError(f"{flag} {path} {where} a file, not a directory: choose a directory")
