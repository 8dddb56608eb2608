"""The paths a command writes to, and what happens when a write fails.

- `check_output_path`: before anything loads, a user's mistake (an existing file given as a
  directory, a directory that cannot be created or written: read-only, no permission) becomes a
  clear error naming the flag, not an OSError from deep inside a save.
- Staging directories for outputs published by renaming: `<target>.tmp-<pid>` is written, then
  renamed onto `target`. A process that dies mid-write leaves its staging directory behind; the
  next write to the same target (or a run starting in that directory: `sweep_dir`) removes those
  of processes no longer alive (on this host).
- `removed_if_failed`: a staging directory whose write failed is removed, and a failure the disk
  caused (no space, the file size limit, read-only, no permission) becomes one WriteFailed
  naming the target, the cause and what was kept. torch's checkpoint writer reports a full disk
  as "unexpected pos 704 vs 598": when no error names the cause, the disk is asked (free space,
  inodes, `ulimit -f`) before the partial files are removed.
"""
import contextlib
import errno
import os
import re
import resource
import shutil
import tempfile
from typing import Iterator, List, Optional, Sequence, Union

from swift_megatron.errors import UserError, WriteFailed

CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
          errno.EFBIG: "file too large", errno.EROFS: "read-only file system",
          errno.EACCES: "permission denied", errno.EPERM: "permission denied"}
# how safetensors (Rust) and torch (C++) spell those errors in their messages
CAUSE_TEXTS = {"No space left on device": errno.ENOSPC, "StorageFull": errno.ENOSPC,
               "os error 28": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
               "os error 122": errno.EDQUOT, "File too large": errno.EFBIG,
               "FileTooLarge": errno.EFBIG, "os error 27": errno.EFBIG,
               "Read-only file system": errno.EROFS, "ReadOnlyFilesystem": errno.EROFS,
               "os error 30": errno.EROFS, "Permission denied": errno.EACCES,
               "os error 13": errno.EACCES}
LOW_SPACE = 16 << 20   # bytes: a write that failed with less free space than this ran out of it
STAGING = re.compile(r"(.+)\.tmp-(\d+)")


def _nearest_existing(path: str) -> str:
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    return probe


def check_output_path(path: str, flag: str) -> None:
    """UserError when `path` (to become a directory) is an existing file, lies under one, or
    cannot be created or written (checked by creating and removing an empty directory)."""
    full, probe = os.path.abspath(os.path.expanduser(path)), _nearest_existing(path)
    if not os.path.isdir(probe):
        where = "is" if probe == full else f"lies under {probe}, which is"
        raise UserError(f"{flag} {path} {where} a file, not a directory: choose a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".swift_megatron-probe-", dir=probe))
    except OSError as exc:
        verb = "written to" if probe == full else f"created: {probe} takes no new files"
        raise UserError(f"{flag} {path} cannot be {verb} "
                        f"({CAUSES.get(exc.errno, exc.strerror)}): choose a writable "
                        "directory") from None


# ---- staging directories -------------------------------------------------------------------

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


def _sweep(parent: str, name: Optional[str]) -> List[str]:
    """Remove the staging directories in `parent` (of target `name`, or of any target) left by
    dead processes; returns their paths."""
    removed = []
    for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        match = STAGING.fullmatch(entry)
        if not match or name not in (None, match.group(1)):
            continue
        pid = int(match.group(2))
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
            removed.append(os.path.join(parent, entry))
    return removed


def sweep_stale(target: str) -> List[str]:
    """Remove `target`'s staging directories left by dead processes; returns their paths."""
    target = os.path.abspath(target)
    return _sweep(os.path.dirname(target), os.path.basename(target))


def sweep_dir(directory: str) -> List[str]:
    """Remove every staging directory in `directory` that a dead process left."""
    return _sweep(os.path.abspath(directory), None)


# ---- failed writes -------------------------------------------------------------------------

def _chain(exc: BaseException) -> Iterator[BaseException]:
    """exc, the exceptions it came from, and those torch's CheckpointException holds per rank."""
    todo, seen = [exc], set()
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        todo += [f[0] if isinstance(f, tuple) else f for f in
                 (failures.values() if isinstance(failures, dict) else ())]
        todo += [current.__cause__, current.__context__]


def _named_cause(exc: BaseException) -> Optional[str]:
    """The cause an error names: an OSError's errno, or its text (safetensors, torch)."""
    for error in _chain(exc):
        if isinstance(error, OSError) and error.errno in CAUSES:
            return CAUSES[error.errno]
        found = [code for text, code in CAUSE_TEXTS.items() if text in str(error)]
        if found:
            return CAUSES[found[0]]
    return None


def _largest_file(directory: str) -> int:
    sizes = [os.path.getsize(os.path.join(root, name))
             for root, _, names in os.walk(directory) for name in names
             if os.path.isfile(os.path.join(root, name))]
    return max(sizes, default=0)


def _probed_cause(directory: str) -> Optional[str]:
    """What the disk says about a write into `directory` that failed without naming why."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and _largest_file(directory) >= limit:
        return f"file too large: this process may write files of at most {limit} bytes " \
               "(ulimit -f)"
    disk = os.statvfs(_nearest_existing(directory))
    if disk.f_bavail * disk.f_frsize < LOW_SPACE:
        return f"no space left on device ({disk.f_bavail * disk.f_frsize} bytes free)"
    if disk.f_files and not disk.f_favail:
        return "no free inodes left on device"
    return None


def write_failure_cause(exc: BaseException, directory: str) -> Optional[str]:
    """The disk's part in `exc`, raised while writing into `directory`, with the error's first
    line (None: not the disk's)."""
    if isinstance(exc, WriteFailed):
        return exc.cause
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit, UserError)):
        return None   # (torch's CheckpointException is a BaseException too)
    cause = _named_cause(exc) or _probed_cause(directory)
    return cause and f"{cause} ({_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        exc = first[0] if isinstance(first, tuple) else first
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def kept_as_before(target: str) -> str:
    """What a failed write of `target` kept (computed before writing)."""
    return f"{target} is as it was" if os.path.exists(target) else \
        f"nothing was written at {target}"


@contextlib.contextmanager
def removed_if_failed(staging: Union[str, Sequence[str]], target: str, kept: str,
                      remove: bool = True):
    """Run the body that writes `staging` (a directory, or several, to become `target`). When
    it fails, remove them (if `remove`: on the rank that owns them); a failure of the disk
    becomes WriteFailed naming the target, the cause and `kept` (what is still there, e.g.
    the last good checkpoint)."""
    paths = [staging] if isinstance(staging, str) else list(staging)
    try:
        yield
    except BaseException as exc:
        cause = write_failure_cause(exc, paths[0])
        for path in paths if remove else ():
            shutil.rmtree(path, ignore_errors=True)
        if cause is None:
            raise
        raise WriteFailed(f"could not write {target}: {cause}. Removed the partial "
                          f"{' and '.join(paths)}; {kept}", cause) from None
