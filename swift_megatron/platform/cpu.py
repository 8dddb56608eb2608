"""Make megatron-core run on a CPU machine (development, CI, the demo), over the gloo backend.

megatron-core assumes CUDA in a few dozen places. `activate()` redirects them, once per process,
and is called only when no GPU is used (no CUDA, or `--device cpu`):

- CUDA RNG state (get/set/seed, mcore's tracker helpers) -> the CPU generator. The seed call is
  required: attention forks the "model-parallel-rng" state even with dropout 0.
- `torch.cuda.current_device()` -> "cpu"; `synchronize`, streams and events -> no-ops.
- A global TorchFunctionMode maps `device="cuda"`, `.cuda()` and `.to("cuda")` to the CPU, drops
  `pin_memory=True` (no pinned-memory allocator without an accelerator; megatron's CP RoPE
  slicing asks for it), and
  reports CPU tensor types under their CUDA names (grad clipping and the distributed optimizer
  assert `param.grad.type() == 'torch.cuda.FloatTensor'`).
- The MoE all-to-all dispatcher converts its split sizes to numpy only for CUDA tensors; on the
  CPU they stay tensors and the all-to-all fails (EP > 1): convert CPU tensors as well.

Nothing else in the package knows about these redirections.
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_active_mode = None


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


def _map_device(device):
    return _CPU if _is_cuda(device) else device


class _CudaToCpu(TorchFunctionMode):
    """Route every CUDA device request of megatron-core to the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU) + tuple(args[2:])
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for torch.cuda.Stream / Event on the CPU: everything is already in order."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def __getattr__(self, name):
        # record_event(), wait_stream(), synchronize(), ...: all no-ops returning a null object
        return lambda *args, **kwargs: _NullStream()


def _redirect_rng() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.manual_seed_all = lambda seed: None
    mcore_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def _redirect_cuda_runtime() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullStream
    torch.cuda.current_stream = lambda *a, **k: _NullStream()
    torch.cuda.default_stream = lambda *a, **k: _NullStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.empty_cache = lambda: None
    torch.cuda.memory_allocated = lambda *a, **k: 0
    torch.cuda.max_memory_allocated = lambda *a, **k: 0
    torch.cuda.memory_reserved = lambda *a, **k: 0


def _redirect_moe_dispatcher() -> None:
    from megatron.core.transformer.moe import token_dispatcher

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def activate() -> None:
    """Install the redirections (idempotent). Call before building any megatron-core object."""
    global _active_mode
    if _active_mode is not None:
        return
    _redirect_rng()
    _redirect_cuda_runtime()
    _redirect_moe_dispatcher()
    _active_mode = _CudaToCpu()
    _active_mode.__enter__()


def is_active() -> bool:
    return _active_mode is not None
