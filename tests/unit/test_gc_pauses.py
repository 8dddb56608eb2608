"""training/gc_pauses.py: the collector's pauses are counted while the clock is open and only
then, and objects frozen as long-lived leave later collections while new garbage is still
collected."""
import gc
import weakref

import pytest

from swift_megatron.training.gc_pauses import GcClock, freeze_long_lived


class Node:
    pass


def _cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_clock_counts_collections_while_open_only():
    with GcClock() as clock:
        assert clock.seconds == 0.0
        gc.collect()
        inside = clock.seconds
    assert inside > 0
    gc.collect()
    assert clock.seconds == inside
    assert clock._callback not in gc.callbacks


def test_clock_is_removed_on_error():
    with pytest.raises(RuntimeError):
        with GcClock() as clock:
            raise RuntimeError("boom")
    assert clock._callback not in gc.callbacks


def test_freeze_exempts_the_living_and_still_collects_new_garbage(unfrozen):
    tracked = len(gc.get_objects())
    freeze_long_lived()
    assert gc.get_freeze_count() >= tracked - 100   # what was alive is permanent now
    assert len(gc.get_objects()) < 100               # and out of the collector's walks
    dropped = weakref.ref(_cycle())   # garbage made after the freeze
    assert dropped() is not None
    gc.collect()
    assert dropped() is None
