"""tqdm progress bars shown on global rank 0 only (other ranks iterate silently)."""
import os
import sys
from typing import Iterable, Optional

from tqdm import tqdm


def progress(iterable: Iterable, desc: str = "", total: Optional[int] = None, **kwargs):
    disable = int(os.environ.get("RANK", "0")) != 0 or os.environ.get("SWIFT_MEGATRON_NO_BAR")
    return tqdm(iterable, desc=desc, total=total, disable=bool(disable), file=sys.stdout,
                dynamic_ncols=True, leave=False, **kwargs)
