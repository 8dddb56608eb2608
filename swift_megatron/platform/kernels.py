"""Whether this machine's Gated DeltaNet kernels (flash-linear-attention, Qwen3.5's linear
attention on CUDA) can train, judged before any model is built and without importing them.

flash-linear-attention 0.6's gated backward (`chunk_bwd_dqkwg`) refuses to run on Hopper GPUs
(compute capability 9.x) with Triton >= 3.4.0 and < 3.7.1, which computes it wrongly there,
unless tilelang is installed (fla then runs tilelang's kernel). torch 2.11 ships Triton 3.6.0,
so without tilelang a Qwen3.5 run on an H100/H200 would fail at its first backward pass, after
the models and the rollout engine were built (measured on an H200: vLLM's install brings
tilelang 0.1.9, with which the same stack trains and matches eager).
"""
import importlib.util
import re
from importlib import metadata
from typing import Optional, Tuple

BROKEN_TRITON = ((3, 4, 0), (3, 7, 1))   # [from, to) on Hopper, fla's own bounds


def version_tuple(text: str) -> Tuple[int, ...]:
    """"3.6.0+git1" -> (3, 6, 0): the leading numeric release parts ("3.5.0rc1": (3, 5, 0))."""
    release = re.match(r"\d+(\.\d+)*", text)
    return tuple(int(part) for part in release.group(0).split(".")) if release else ()


def gated_backward_problem(capability: Optional[Tuple[int, int]], triton: Optional[str],
                           tilelang: bool) -> Optional[str]:
    """The reason fla's gated backward would refuse to run, or None (pure)."""
    if capability is None or capability[0] != 9 or triton is None or tilelang:
        return None
    low, high = BROKEN_TRITON
    if not low <= version_tuple(triton) < high:
        return None
    return (f"flash-linear-attention's Gated DeltaNet backward refuses to run on this Hopper GPU "
            f"(compute capability {capability[0]}.{capability[1]}) with Triton {triton}, which "
            "computes it wrongly there (Triton >= 3.4.0 and < 3.7.1): `pip install tilelang` "
            "(fla then uses its kernel; vLLM's install brings it, and requirements/gdn.txt "
            "lists it) or install Triton >= 3.7.1")


def _installed_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def gdn_kernel_problem() -> Optional[str]:
    """gated_backward_problem for this machine's first GPU, when fla is installed."""
    if importlib.util.find_spec("fla") is None:
        return None   # megatron-core's torch path runs instead
    import torch

    if not torch.cuda.is_available():
        return None
    return gated_backward_problem(torch.cuda.get_device_capability(0),
                                  _installed_version("triton"),
                                  importlib.util.find_spec("tilelang") is not None)
