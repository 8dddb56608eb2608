"""Read a run's logs for the report: `{output_dir}/logging.jsonl` into per-step records and per-key
series, tolerant of what a killed or still-running run leaves behind.

- A line that is not valid JSON (the half-written last line of a killed run, or a damaged line)
  is skipped and counted, never fatal.
- A resumed run appends to the same file and may log a step again: the last record of a step
  wins and records come back sorted by step.
- Values are numbers or null (logging.jsonl writes non-finite values as null); a key missing
  from a record is simply absent there (no point), a null is a point without a value.
"""
import json
import math
import os
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from swift_megatron.logging.metrics import METRICS_FILE

RESERVED = ("step", "time")


@dataclass
class MetricLog:
    """The records of logging.jsonl by step (sorted), and how many lines could not be read."""

    path: str
    records: List[dict] = field(default_factory=list)
    bad_lines: int = 0

    def keys(self) -> List[str]:
        """Every metric key logged at least once, in first-seen order."""
        seen: Dict[str, None] = {}
        for record in self.records:
            seen.update((key, None) for key in record if key not in RESERVED)
        return list(seen)

    def series(self, key: str) -> Tuple[List[int], List[Optional[float]]]:
        """(steps, values) of the records that have key; None where it was logged as null."""
        rows = [(r["step"], r[key]) for r in self.records if key in r]
        return [s for s, _ in rows], [v for _, v in rows]


def metrics_path(output_dir: str) -> str:
    return os.path.join(output_dir, METRICS_FILE)


def json_lines(path: str) -> Iterator[Tuple[int, Optional[dict]]]:
    """(line number, parsed object or None when the line is not a JSON object), blank lines
    skipped."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                value = None
            yield number, value if isinstance(value, dict) else None


def clean_value(value) -> Optional[float]:
    """A logged value as a float, None for null / non-finite; anything else is not a metric."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(value)
    return float(value) if math.isfinite(value) else None


def clean_record(raw: dict) -> Optional[dict]:
    """step (int), time (float or None) and the numeric/null metrics; None without a step."""
    step = raw.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        return None
    try:
        stamp = clean_value(raw.get("time"))
    except TypeError:
        stamp = None
    record = {"step": step, "time": stamp}
    for key, value in raw.items():
        if key in RESERVED:
            continue
        try:
            record[key] = clean_value(value)
        except TypeError:
            continue
    return record


def read_metric_log(path: str) -> MetricLog:
    """Parse logging.jsonl (see the module docstring for what is tolerated)."""
    by_step: Dict[int, dict] = {}
    bad = 0
    for _, raw in json_lines(path):
        record = clean_record(raw) if raw is not None else None
        if record is None:
            bad += 1
            continue
        by_step[record["step"]] = record
    return MetricLog(path, [by_step[s] for s in sorted(by_step)], bad)


def finite(values: List[Optional[float]]) -> List[float]:
    return [v for v in values if v is not None]


def plottable(values: List[Optional[float]]) -> bool:
    """Whether a series says more as a curve than as a value: two or more distinct finite
    values (a metric logged once, or that never changed, is written out instead)."""
    present = finite(values)
    return any(v != present[0] for v in present[1:])


def wall_time_s(log: MetricLog) -> Optional[float]:
    """Seconds from the start of the first logged step (its `time` minus its time/* phases) to
    the last logged step; None without timestamps."""
    timed = [r for r in log.records if r["time"] is not None]
    if not timed:
        return None
    first = timed[0]
    phases = sum(v for k, v in first.items() if k.startswith("time/") and v is not None)
    return timed[-1]["time"] - first["time"] + phases
