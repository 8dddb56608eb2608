"""A rank-aware stdlib logger: INFO from rank 0, WARNING and above from every rank (prefixed),
written around the progress bars (logging/progress.py), never onto their line."""
import logging
import os
import sys

_ROOT = "swift_megatron"
_configured = False


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank()
        record.rank_prefix = f"[rank{rank}] " if rank else ""
        return rank == 0 or record.levelno >= logging.WARNING


class _BarSafeHandler(logging.StreamHandler):
    """Writes each line through tqdm while a progress bar may be drawn (tqdm.write clears the
    bars of the stream, writes the line and draws them again below it), so a log line never
    lands on a bar's line; plainly otherwise."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm = sys.modules.get("tqdm")   # no bar exists before tqdm is imported
        if tqdm is None or not tqdm.tqdm._instances:
            super().emit(record)
            return
        try:
            tqdm.tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:
            self.handleError(record)


def _configure() -> None:
    global _configured
    root = logging.getLogger(_ROOT)
    handler = _BarSafeHandler(sys.stdout)
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("%(rank_prefix)s%(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(os.environ.get("SWIFT_MEGATRON_LOG_LEVEL", "INFO"))
    root.propagate = False
    _configured = True


def get_logger(name: str = _ROOT) -> logging.Logger:
    if not _configured:
        _configure()
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")
