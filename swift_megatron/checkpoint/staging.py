"""Staging directories for outputs published by renaming: `<target>.tmp-<pid>` is written, then
renamed onto `target`. A process that dies mid-write leaves its staging directory behind; the next
write to the same target removes those of processes no longer alive (on this host)."""
import os
import re
import shutil
from typing import List


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
