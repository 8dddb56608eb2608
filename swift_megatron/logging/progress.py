"""tqdm progress bars, shown on global rank 0 when its standard output is a terminal (other
ranks, and output into a file or a pipe, iterate silently: a file would get the bars' carriage
returns and cursor-movement escape codes; the `INFO step N` lines say how far a run is).
Log lines are written through the bars (logging/logger.py), so they never share a line."""
import os
import sys
from typing import Iterable, Optional

from tqdm import tqdm


def bars_shown(stream=None) -> bool:
    """Whether this process draws bars: global rank 0, SWIFT_MEGATRON_NO_BAR unset, and `stream`
    (default: standard output) a terminal."""
    stream = sys.stdout if stream is None else stream
    is_terminal = getattr(stream, "isatty", lambda: False)()
    return int(os.environ.get("RANK", "0")) == 0 and not os.environ.get("SWIFT_MEGATRON_NO_BAR") \
        and is_terminal


def progress(iterable: Iterable, desc: str = "", total: Optional[int] = None, **kwargs):
    return tqdm(iterable, desc=desc, total=total, disable=not bars_shown(), file=sys.stdout,
                dynamic_ncols=True, leave=False, **kwargs)
