"""Curve smoothing for the report's plots: a centred moving average that does not lag.

The smoothed value at a point is the mean of the finite values within `h` points on both sides,
h = round(weight / (1 - weight)) (the mean age of an exponential moving average of that weight:
0.6 -> 2, 0.9 -> 9). Near either end the window shrinks symmetrically (at the k-th point from an
end, k points each side), so the curve stays centred there too: the first and last smoothed
points are the first and last values, where an EMA would still trail far behind a moving
series. A missing value (None: null in logging.jsonl) stays None and is skipped by the windows.
weight 0 returns the values; the closer to 1, the wider the window.
"""
from typing import List, Optional, Sequence

DEFAULT_WEIGHT = 0.6


def half_width(weight: float) -> int:
    """Points on each side of the centred window for a smoothing weight in [0, 1)."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    return int(weight / (1.0 - weight) + 0.5 + 1e-9)   # half up (0.6: 1.4999... -> 2)


def smooth(values: Sequence[Optional[float]], weight: float = DEFAULT_WEIGHT
           ) -> List[Optional[float]]:
    """The centred moving average of values (module docstring), None kept in place."""
    h = half_width(weight)
    present = [v for v in values if v is not None]
    smoothed = []
    for i in range(len(present)):
        k = min(h, i, len(present) - 1 - i)
        window = present[i - k:i + k + 1]
        smoothed.append(sum(window) / len(window))
    it = iter(smoothed)
    return [None if v is None else next(it) for v in values]
