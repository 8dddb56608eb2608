"""Children forked while a checkpoint is written die with the process that forked them:
megatron's torch_dist writer forks one copy of the trainer per writer (about 520 MB each), and
a trainer killed during a shard write left them running, or waiting, with PPID 1. Standard
library only (cheap to import, testable without megatron)."""
import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_saving = [False]   # read by the at-fork hook in the children megatron's writer forks
_forker = [0]       # the pid of the process forking


def _remember_forker() -> None:
    _forker[0] = os.getpid()


def _die_with_parent() -> None:
    """In a child forked while a checkpoint is written: be killed when the forking process
    dies (Linux's parent-death signal), or exit now if it already has."""
    if not _saving[0] or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != _forker[0]:   # the parent died before the request took
        os._exit(1)


os.register_at_fork(before=_remember_forker, after_in_child=_die_with_parent)


@contextlib.contextmanager
def writer_children_die_with_us():
    """Inside the block, children forked by this (long-lived, main) thread die with it."""
    _saving[0] = True
    try:
        yield
    finally:
        _saving[0] = False
