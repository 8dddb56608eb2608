"""The weight-sync watchdog (--weight_sync_timeout): a sync that stalls ends the run with an
error naming the step, the bucket and the peer, instead of hanging. A broadcast to a rollout
server whose replicas died or froze never returns on NCCL, and a process stuck in a C call
cannot raise: past the timeout the watchdog's thread prints the message and ends the process
(exit 1; torchrun then stops the other ranks). Nothing is lost that a crash would not lose: the
sync runs after a rollout batch's updates and before its checkpoint.
"""
import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

from swift_megatron.logging import get_logger

logger = get_logger(__name__)


def exit_stalled(message: str) -> None:
    """Print `message` and end the process at once (the stalled thread cannot be unwound)."""
    logger.error(message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class Watchdog:
    """`watch(describe)` runs its block under a deadline of `timeout_s`; past it, `on_stall`
    gets "<describe()> stalled for more than <timeout> s ...". 0 turns it off."""

    def __init__(self, timeout_s: float, on_stall: Callable[[str], None] = exit_stalled):
        self.timeout_s, self.on_stall = timeout_s, on_stall

    @contextlib.contextmanager
    def watch(self, describe: Callable[[], str]) -> Iterator[None]:
        if not self.timeout_s:
            yield
            return
        done = threading.Event()
        started = time.monotonic()
        thread = threading.Thread(target=self._guard, args=(done, describe, started),
                                  name="weight_sync_watchdog", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _guard(self, done: threading.Event, describe: Callable[[], str], started: float) -> None:
        if done.wait(self.timeout_s):
            return
        self.on_stall(f"{describe()} stalled for more than {self.timeout_s:g} s "
                      f"(--weight_sync_timeout; {time.monotonic() - started:.0f} s so far): a "
                      "rollout server or replica may have died or frozen; check its log, or "
                      "raise --weight_sync_timeout for a sync that is only slow")
