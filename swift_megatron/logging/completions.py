"""The completions log: one JSON line per sampled completion in `{output_dir}/completions.jsonl`,
appended and flushed on every call, so a run's samples, rewards and advantages can be read
while it trains (`jq`, pandas.read_json(lines=True)).

A line reads `{"step", "prompt_id", "prompt", "completion", "reward", "rewards": {func: value},
"advantage", "length", "truncated", ...}`: step, prompt and completion are required, known keys
come in that order and any other keys follow as given. Non-finite numbers (a reward function
that returned None is NaN in the reward table) are written as null.
"""
import os
from typing import Any, Dict, List, Mapping, Sequence

from swift_megatron.logging.metrics import dumps

COMPLETIONS_FILE = "completions.jsonl"
REQUIRED_KEYS = ("prompt", "completion")
KEY_ORDER = ("step", "prompt_id", "prompt", "completion", "reward", "rewards", "advantage",
             "length", "truncated")


def completion_record(step: int, row: Mapping[str, Any], index: int = 0) -> Dict[str, Any]:
    """One line's content: `step` first, then the known keys in KEY_ORDER, then the rest."""
    missing = [key for key in REQUIRED_KEYS if key not in row]
    if missing:
        raise ValueError(f"completion row {index} lacks {missing} (has {sorted(row)})")
    if "step" in row and row["step"] != step:
        raise ValueError(f"completion row {index} has step {row['step']}, logged at step {step}")
    merged = {**row, "step": step}
    known = [key for key in KEY_ORDER if key in merged]
    return {key: merged[key] for key in known + [key for key in row if key not in KEY_ORDER]}


class CompletionsLogger:
    """Appends rows to `{output_dir}/completions.jsonl`; a no-op when `enabled` is False."""

    def __init__(self, output_dir: str, enabled: bool = True):
        self.enabled = enabled
        self.path = os.path.join(output_dir, COMPLETIONS_FILE)
        self._file = None
        if enabled:
            os.makedirs(output_dir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Write one line per row (all rows are checked before any is written)."""
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError("CompletionsLogger.log called after close()")
        lines: List[str] = [dumps(completion_record(step, row, i)) for i, row in enumerate(rows)]
        self._file.write("".join(line + "\n" for line in lines))
        self._file.flush()

    def close(self) -> None:
        """Close the file; later calls do nothing."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "CompletionsLogger":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
