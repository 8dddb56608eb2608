"""Curve smoothing for the report's plots: TensorBoard's debiased exponential moving average.

    last = last * weight + (1 - weight) * value;  smoothed = last / (1 - weight ** n)

over the n finite values seen so far (the division removes the pull toward the initial 0, so
the first smoothed point equals the first value). A missing value (None: null in logging.jsonl)
stays None and does not advance the average; a constant series is returned unchanged, as
TensorBoard does. weight 0 returns the values, weight close to 1 smooths hardest.
"""
from typing import List, Optional, Sequence

DEFAULT_WEIGHT = 0.6  # TensorBoard's default smoothing


def ema(values: Sequence[Optional[float]], weight: float = DEFAULT_WEIGHT) -> List[Optional[float]]:
    """The debiased EMA of values, None kept in place; weight in [0, 1)."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    present = [v for v in values if v is not None]
    if present and all(v == present[0] for v in present):
        return list(values)
    last, count, out = 0.0, 0, []
    for value in values:
        if value is None:
            out.append(None)
            continue
        last = last * weight + (1.0 - weight) * value
        count += 1
        out.append(last / (1.0 - weight ** count))
    return out
