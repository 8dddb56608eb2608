"""Small helpers shared by several test modules."""
import os

from safetensors.torch import load_file


def safetensors_of(model_dir) -> dict:
    """Every tensor of an HF checkpoint directory (single file or shards), by name."""
    tensors = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(model_dir, name)))
    return tensors
