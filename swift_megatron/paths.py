"""The paths a command writes to.

- `check_output_path`: before anything loads, a user's mistake (an existing file given as a
  directory) becomes a clear error naming the flag, not an OSError from deep inside a save.
- Staging directories for outputs published by renaming: `<target>.tmp-<pid>` is written, then
  renamed onto `target`. A process that dies mid-write leaves its staging directory behind; the
  next write to the same target removes those of processes no longer alive (on this host).
"""
import os
import re
import shutil
from typing import List

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


def staging_dir(target: str) -> str:
    return f"{os.path.abspath(target)}.tmp-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's live process
        return True
    return True


def sweep_stale(target: str) -> List[str]:
    """Remove `target`'s staging directories left by dead processes; returns their paths."""
    target = os.path.abspath(target)
    parent, name = os.path.dirname(target), os.path.basename(target)
    pattern = re.compile(re.escape(name) + r"\.tmp-(\d+)")
    removed = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        match = pattern.fullmatch(entry)
        if match and int(match.group(1)) != os.getpid() and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            removed.append(os.path.join(parent, entry))
    return removed
