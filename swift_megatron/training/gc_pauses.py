"""Python's cyclic garbage collector in the rollout loop: the seconds of its pauses, logged per
rollout batch as `perf/gc_pause_s`.

A full (generation-2) collection walks every object the collector tracks: with torch, vLLM,
transformers and megatron-core imported, about 460k objects and 0.4 s on a CI CPU. vLLM freezes
the heap it starts with (gc.freeze after the engine's start-up and warm-up, in the trainer's
process in colocate mode), so such walks are rare; the metric shows what the collector still
costs, and whether a slow rollout batch was the collector's doing (docs/gpu.md).
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
