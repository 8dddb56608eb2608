"""Helper processes that must not outlive the process that started them."""
import signal
import sys


def die_with_parent() -> None:
    """Ask Linux to SIGKILL the calling process when its parent dies (even by `kill -9`); a
    no-op elsewhere. Run it first thing in a child process (a multiprocessing initializer)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def start_manager():
    """A multiprocessing SyncManager (spawned) whose server process dies with this process."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
    manager.start(initializer=die_with_parent)
    return manager
