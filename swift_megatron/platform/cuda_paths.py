"""Which devices take the code paths swift-megatron picks for CUDA by default that torch can also
run on the CPU: the compiled layer and logprob math (model/compiled.py: Inductor's C++ backend
instead of its Triton one), torch's fused Adam (training/optim.py) and the offloader's device
synchronisation (training/offload.py). A CUDA device always takes them; the CPU takes them
inside `on_cpu()`, so that the CPU test suite runs what a GPU run runs and a GPU-only breakage
of these paths fails CI (tests/unit/test_cuda_paths.py). Not a user setting: on the CPU these
paths are no faster (Inductor spends seconds compiling).

CUDA paths without a CPU equivalent stay covered by tests/gpu alone: torch's varlen flash
attention (model/spec.py), fla's Triton Gated DeltaNet kernels (model/gdn.py), pinned host
buffers and non-blocking copies (training/offload.py) and the device memory counters.
"""
import contextlib
from typing import Iterator

import torch

_ON_CPU = False


def takes_cuda_paths(device: torch.device) -> bool:
    """Whether work on `device` takes the CUDA-default paths (module docstring)."""
    return device.type == "cuda" or (_ON_CPU and device.type == "cpu")


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Inside the block the CPU takes the CUDA-default paths too."""
    global _ON_CPU
    before, _ON_CPU = _ON_CPU, True
    try:
        yield
    finally:
        _ON_CPU = before
