"""The helpers of ms-swift's `swift.utils` that plugin files use: `get_logger` and `to_device`.

Torch is imported only when a tensor has to move (this module is loaded with every plugin)."""
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, Optional

from swift_megatron.logging import get_logger as _get_logger


def get_logger(log_file: Optional[str] = None, log_level: Optional[int] = None,
               file_mode: str = "w") -> logging.Logger:
    """The logger of plugin code (swift_megatron.plugins: rank 0 prints INFO); `log_file` adds a
    file handler, `log_level` sets its level, as ms-swift's get_logger does."""
    logger = _get_logger("plugins")
    if log_level is not None:
        logger.setLevel(log_level)
    if log_file is not None:
        path = os.path.abspath(log_file)
        if not any(getattr(h, "baseFilename", None) == path for h in logger.handlers):
            logger.addHandler(logging.FileHandler(path, mode=file_mode))
    return logger


def to_device(data: Any, device: Any, non_blocking: bool = False) -> Any:
    """`data` with every tensor in it (nested in dicts, lists and tuples) moved to `device`."""
    if isinstance(data, Mapping):
        return type(data)({k: to_device(v, device, non_blocking) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(to_device(v, device, non_blocking) for v in data)
    torch = sys.modules.get("torch")  # a tensor exists only if torch was imported
    if torch is not None and isinstance(data, torch.Tensor):
        return data.to(device=device, non_blocking=non_blocking)
    return data
