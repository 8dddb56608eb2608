"""Python's cyclic garbage collector in the rollout loop: its pauses counted, and the objects that
live for the whole run kept out of its full collections.

A full (generation-2) collection walks every object the collector tracks. With torch, vLLM,
transformers and megatron-core imported that is about 460k objects and 0.4 s on a CI CPU, more
once an engine, a model and compiled graphs exist, and it lands in whichever phase allocates
when the collector's thresholds are crossed (seen on an H200 as rollout phases 0.4-0.7 s slower
than their neighbours). `freeze_long_lived` (gc.collect, then gc.freeze) after the first rollout
batch moves everything alive then to the permanent generation, so later collections walk only
what the run made since; garbage made later is still collected. `GcClock` sums the seconds the
collector ran, through gc.callbacks, for the `perf/gc_pause_s` metric.
"""
import gc
import time
from typing import Optional


class GcClock:
    """Seconds spent in cyclic garbage collections while the context is open."""

    def __init__(self):
        self.seconds = 0.0
        self._began: Optional[float] = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.seconds += time.perf_counter() - self._began
            self._began = None

    def __enter__(self) -> "GcClock":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def freeze_long_lived() -> None:
    """Collect once, then exempt every surviving object from later collections."""
    gc.collect()
    gc.freeze()
