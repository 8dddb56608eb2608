"""A rank-aware stdlib logger: INFO from rank 0, WARNING and above from every rank (prefixed)."""
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


def _configure() -> None:
    global _configured
    root = logging.getLogger(_ROOT)
    handler = logging.StreamHandler(sys.stdout)
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
