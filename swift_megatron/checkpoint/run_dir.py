"""A run directory (--output_dir, --save) belongs to one run.

- While a run is alive its global rank 0 holds an exclusive lock (`flock`) on
  `DIR/.swift_megatron.lock`: a second run into the same directory is refused instead of
  interleaving its logs and checkpoints. The kernel releases the lock when the process ends,
  however it ends (kill -9 included), so the file a dead run leaves behind blocks nothing.
- A directory that holds another run's logs or checkpoints is refused unless this run resumes
  from it (`--load DIR`, or `--mcore_model DIR --finetune false`, as ms-swift): a new run into a
  finished run's directory would append to its logs and leave its checkpoints beside the new
  ones. The error says what to do instead.
- Under the lock, the staging directories dead processes left there (a killed save) are
  removed (paths.py `sweep_dir`).

`check_run_dir` (preflight, before anything loads) only tries the lock; `claim_run_dir` (the
trainer's rank 0) takes it and keeps it until `RunLock.release` or the process ends.
"""
import fcntl
import os
import re
import socket
from typing import Iterable, List, Optional, Tuple

from swift_megatron.checkpoint.ms_swift import LATEST
from swift_megatron.errors import UserError
from swift_megatron.paths import sweep_dir

LOCK_FILE = ".swift_megatron.lock"
BEST_FILE = "best_checkpoint.json"   # {"step", "reward"}: the save --save_total_limit keeps
# what makes a directory another run's: its checkpoints, final model and (non-empty) logs; not the
# args.json or empty logs of a run that stopped before logging a step (a fixed rerun may go there)
RUN_FILES = (LATEST, BEST_FILE, "final_hf", "final_adapter")
RUN_LOGS = ("logging.jsonl", "completions.jsonl")
RUN_DIRS = re.compile(r"iter_\d{7}|checkpoint-\d+(-merged)?")


def output_base(output_dir: Optional[str], model: Optional[str]) -> str:
    """--output_dir, by default megatron_output/<model name> (as ms-swift)."""
    return output_dir or os.path.join("megatron_output",
                                      os.path.basename(os.path.normpath(model or "model")))


def run_dirs(output_dir: Optional[str], save: Optional[str]) -> List[Tuple[str, str]]:
    """The (flag, directory) pairs a run writes: its output directory (None: not known yet)
    and --save's when that is another directory."""
    pairs = [("--output_dir", output_dir)] if output_dir else []
    if save and not (output_dir and os.path.realpath(save) == os.path.realpath(output_dir)):
        pairs.append(("--save", save))
    return pairs


def run_files(directory: str) -> List[str]:
    """What in `directory` makes it another run's (sorted; empty for a new directory)."""
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(n for n in names if n in RUN_FILES or RUN_DIRS.fullmatch(n) or
                  (n in RUN_LOGS and os.path.getsize(os.path.join(directory, n)) > 0))


def resumes(directory: str, resume_dir: Optional[str]) -> bool:
    """Whether the checkpoint this run resumes (an iter_* directory) lies in `directory`."""
    if resume_dir is None:
        return False
    parent = os.path.dirname(os.path.abspath(resume_dir))
    return os.path.realpath(parent) == os.path.realpath(directory)


def _refusal(directory: str, flag: str, found: List[str]) -> UserError:
    first = sorted(found, key=lambda n: (n != "logging.jsonl", not n.startswith("iter_")))
    shown = ", ".join(first[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    version = ", or --add_version true (each run in a new v<N>-<time> subdirectory)" \
        if flag == "--output_dir" else ""
    then = f"--load {directory} to resume that run" if LATEST in found else \
        "remove them (that run saved no checkpoint to resume)"
    return UserError(f"{flag} {directory} holds another run ({shown}): pass a new {flag}"
                     f"{version}, or {then}")


def _check_contents(directory: str, flag: str, resume_dirs: Iterable[Optional[str]]) -> None:
    found = run_files(directory)
    if found and not any(resumes(directory, d) for d in resume_dirs):
        raise _refusal(directory, flag, found)


def _in_use(handle, directory: str, flag: str) -> UserError:
    handle.seek(0)
    holder = handle.read().strip() or "another process"
    handle.close()
    return UserError(f"{flag} {directory} is in use by a run that is still going ({holder}): "
                     f"wait for it to end, or pass another {flag}")


class RunLock:
    """The locks this process holds on its run directories (released when it ends)."""

    def __init__(self):
        self.files = []

    def take(self, directory: str, flag: str) -> None:
        """Lock `directory` (UserError naming the holder when another live process has it)."""
        handle = open(os.path.join(directory, LOCK_FILE), "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(handle, directory, flag) from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self.files.append(handle)

    def release(self) -> None:
        for handle in self.files:
            handle.close()   # closing the file drops its lock
        self.files = []


def check_run_dir(directory: str, flag: str, resume_dirs: Iterable[Optional[str]]) -> None:
    """UserError when a live run holds `directory` or it holds a run that this one does not
    resume from. Nothing is written: an existing lock file is tried and let go at once."""
    lock_file = os.path.join(directory, LOCK_FILE)
    if os.path.isfile(lock_file):
        with open(lock_file) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _in_use(handle, directory, flag) from None
    _check_contents(directory, flag, list(resume_dirs))


def claim_run_dir(lock: RunLock, directory: str, flag: str,
                  resume_dirs: Iterable[Optional[str]]) -> None:
    """Create `directory`, lock it into `lock`, check what it holds and sweep what dead
    processes staged there (global rank 0). UserError when it cannot be created or is taken
    (`lock` then holds nothing)."""
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {directory} cannot be created ({exc.strerror}): choose a "
                        "writable directory") from None
    try:
        lock.take(directory, flag)
        _check_contents(directory, flag, list(resume_dirs))
    except UserError:
        lock.release()
        raise
    sweep_dir(directory)
