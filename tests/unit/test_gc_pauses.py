"""training/gc_pauses.py: the collector's pauses are counted while the clock is open and only
then."""
import gc

import pytest

from swift_megatron.training.gc_pauses import GcClock


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
