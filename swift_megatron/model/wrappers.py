"""The GPTModel inside the wrappers megatron puts around it for training (DistributedDataParallel,
Float16Module): what the bridge, checkpoints, the vision tower cache and the training step read
their attributes from."""
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def unwrap(module: "torch.nn.Module") -> "torch.nn.Module":
    """The GPTModel inside DDP / Float16 wrappers."""
    while hasattr(module, "module"):
        module = module.module
    return module
