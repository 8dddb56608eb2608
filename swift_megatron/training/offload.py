"""Move the training state to host memory while a colocated vLLM engine generates
(`--offload_model`, `--offload_optimizer`), and back; without --offload_model the gradients
alone are freed (`grad_dropper`).

    offloaders = [model_offloader(policy.chunks), optimizer_offloader(policy.optimizer)]
    for o in offloaders: o.offload()
    ...  # engine.wake_up(); generate; engine.sleep()
    for o in offloaders: o.reload()

Works on whole tensor storages: each storage is copied to host memory (pinned on CUDA; the host
buffers are reused from one offload to the next) and resized to 0 bytes, which frees the device
memory while every view of it (parameters inside Megatron DDP's contiguous param buffer,
optimizer shards that alias them) stays a valid tensor object; `reload()` restores the bytes,
bit for bit; after a block that only read them (a frozen model's forward pass,
`resident(read_only=True)`) offloading again frees the device memory without copying the bytes
back, the host copy still holding them. Storages are de-duplicated, and one already at 0 bytes
(offloaded by the other offloader, e.g. fp32 training where the optimizer's main params are the
model's) is left to its owner. Gradients are not kept: Megatron DDP's grad buffers are freed and
come back zeroed, as every optimizer step starts from zeroed grads. The tensors are collected at
each `offload()` (the optimizer's state appears at its first step).
On the CPU the same code runs (host to host); it frees nothing there but keeps the path tested.
On a CUDA machine, tensors already in host memory stay where they are (with
--optimizer_cpu_offload the Adam state and main params live there; copying them would only
double their host memory).
"""
import contextlib
from typing import Callable, ContextManager, Iterable, Iterator, List, Optional, Sequence

import torch

from swift_megatron.logging import get_logger
from swift_megatron.platform.cuda_paths import takes_cuda_paths
from swift_megatron.training.optim import torch_optimizers

logger = get_logger(__name__)
Tensors = Callable[[], Iterable[torch.Tensor]]


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),))


def _on_host_already(storage: torch.UntypedStorage) -> bool:
    """Host memory on a CUDA machine (e.g. the state --optimizer_cpu_offload keeps there):
    nothing to move. Without CUDA everything is host memory and moves, to keep the path tested."""
    return storage.device.type == "cpu" and torch.cuda.is_available()


def _unique_storages(tensors: Iterable[torch.Tensor], seen: set) -> List[torch.UntypedStorage]:
    """Distinct non-empty storages of `tensors` that can move, in order (skipping those in
    `seen`)."""
    found = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if storage.nbytes() and key not in seen and not _on_host_already(storage):
            seen.add(key)
            found.append(storage)
    return found


def _synchronize(storages: Sequence[torch.UntypedStorage]) -> None:
    """Wait for the work queued on the storages' devices (copies to or from the host buffers, the
    last kernels reading a storage about to be freed) where the CUDA paths are taken
    (platform/cuda_paths.py; on the CPU, in the tests, torch.cpu.synchronize)."""
    for device in {s.device for s in storages if takes_cuda_paths(s.device)}:
        torch.get_device_module(device).synchronize(device)


class Offloader:
    """Offload / reload the storages of `keep()` tensors (bytes preserved) and of `drop()`
    tensors (freed, zeroed on reload)."""

    def __init__(self, name: str, keep: Tensors, drop: Optional[Tensors] = None):
        self.name, self._keep_fn, self._drop_fn = name, keep, drop or (lambda: [])
        self._kept: List[torch.UntypedStorage] = []
        self._dropped: List[tuple] = []            # (storage, nbytes)
        self._host: List[torch.Tensor] = []        # host copies, reused across offloads

    @property
    def offloaded(self) -> bool:
        return bool(self._kept or self._dropped)

    def offload(self, copy: bool = True) -> int:
        """Move to host memory; returns the bytes freed on the device. `copy=False`: nothing
        wrote the kept storages since the last offload (`resident(read_only=True)`), so the host
        buffers still hold their bytes and the device memory is freed without copying back."""
        if self.offloaded:
            return 0
        seen: set = set()
        self._dropped = [(s, s.nbytes()) for s in _unique_storages(self._drop_fn(), seen)]
        self._kept = _unique_storages(self._keep_fn(), seen)
        if copy or not self._host_matches(self._kept):
            for index, storage in enumerate(self._kept):
                host = self._host_buffer(index, storage)
                host.copy_(_byte_view(storage), non_blocking=host.is_pinned())
        _synchronize(self._kept + [s for s, _ in self._dropped])   # no kernel still reads them
        freed = sum(s.nbytes() for s in self._kept) + sum(n for _, n in self._dropped)
        for storage in self._kept + [s for s, _ in self._dropped]:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        logger.debug(f"offloaded {self.name}: {freed / 2**20:.1f} MiB")
        return freed

    def _host_matches(self, storages: Sequence[torch.UntypedStorage]) -> bool:
        return len(self._host) == len(storages) and all(
            host.numel() == storage.nbytes() for host, storage in zip(self._host, storages))

    def _host_buffer(self, index: int, storage: torch.UntypedStorage) -> torch.Tensor:
        if index < len(self._host) and self._host[index].numel() == storage.nbytes():
            return self._host[index]
        pin = storage.device.type == "cuda"
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
        self._host[index:index + 1] = [host]
        return host

    @contextlib.contextmanager
    def resident(self, read_only: bool = False) -> Iterator[None]:
        """For a model that lives in host memory between uses (--offload_teacher_model,
        --offload_ref_model): back on the device inside the block, offloaded again after it. A
        no-op when not offloaded (so blocks nest). `read_only`: the block writes none of the
        kept tensors (a forward pass, a save), so offloading after it copies nothing back."""
        if not self.offloaded:
            yield
            return
        self.reload()
        try:
            yield
        finally:
            self.offload(copy=not read_only)

    def reload(self) -> None:
        """Restore the kept bytes and zeroed memory for the dropped storages."""
        for storage, host in zip(self._kept, self._host):
            storage.resize_(host.numel())
            _byte_view(storage).copy_(host, non_blocking=host.is_pinned())
        for storage, nbytes in self._dropped:
            storage.resize_(nbytes)
            _byte_view(storage).zero_()
        _synchronize(self._kept + [s for s, _ in self._dropped])
        self._kept, self._dropped = [], []


def _grad_buffers(chunk: torch.nn.Module) -> List[torch.Tensor]:
    """Megatron DDP's contiguous grad buffers of a chunk (none for an unwrapped module; DDP's
    `buffers` attribute is its list of param-and-grad buffers)."""
    buffers = getattr(chunk, "buffers", None)
    if not isinstance(buffers, list):
        return []
    buffers = buffers + list(getattr(chunk, "expert_parallel_buffers", []))
    return [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]


def _all_grad_buffers(chunks: Sequence[torch.nn.Module]) -> Iterator[torch.Tensor]:
    for chunk in chunks:
        yield from _grad_buffers(chunk)


def model_offloader(chunks: Sequence[torch.nn.Module]) -> Offloader:
    """Parameters and module buffers of the model chunks (DDP-wrapped or not) kept, DDP grad
    buffers dropped."""
    def keep():
        for chunk in chunks:
            yield from (p.data for p in chunk.parameters())
            yield from torch.nn.Module.buffers(chunk)

    return Offloader("model", keep, lambda: _all_grad_buffers(chunks))


def grad_dropper(chunks: Sequence[torch.nn.Module]) -> Offloader:
    """Megatron DDP's grad buffers freed (and zeroed on reload), nothing copied: what every
    colocated generation does without --offload_model, since no gradient outlives an optimizer
    step (4 bytes per trainable parameter back to the engine at no cost but a memset)."""
    return Offloader("gradients", lambda: [], lambda: _all_grad_buffers(chunks))


def resident(offloader: Optional[Offloader], read_only: bool = False) -> ContextManager:
    """`offloader.resident(read_only)`, or a block with nothing to move for a model kept on the
    device."""
    return offloader.resident(read_only) if offloader is not None else contextlib.nullcontext()


def optimizer_offloader(optimizer) -> Offloader:
    """Optimizer state (Adam moments, step) and main params kept."""
    def keep():
        for opt in torch_optimizers(optimizer):
            for per_param in opt.state.values():
                yield from (t for t in per_param.values() if isinstance(t, torch.Tensor))
            for group in opt.param_groups:
                yield from group["params"]

    return Offloader("optimizer", keep)
