"""Count the calls that would make the host wait for the GPU, on any device (so a CPU test can
check a code path meant to keep the host out of the GPU's way).

On CUDA these synchronise: reading a value (`item()`, `bool(t)`, `int(t)`: aten's
`_local_scalar_dense`), copying to the host (`cpu()`, `numpy()`, `tolist()`) and
the operators whose output size depends on the data (`nonzero`, `masked_select`, `unique`,
`bincount`, `repeat_interleave` without `output_size`, boolean-mask indexing, which calls
`nonzero`). `HostSyncCounter` counts each such call made inside it, forward and backward, by
name. On a CPU the tensors already live on the host, so the count is what the same code would
pay on a GPU, as an upper bound (a `tolist()` of a tensor that is on the host there as well
counts too), less the copies written `.to("cpu")` (megatron's non-blocking count copies), which
look the same as moves between a CPU's own tensors. On a GPU, torch's own check is
`torch.cuda.set_sync_debug_mode`.
"""
import collections
from typing import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
SYNCING_OPERATORS = {
    _aten._local_scalar_dense.default: "item", _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select", _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique", _aten.unique_consecutive.default: "unique",
    _aten.bincount.default: "bincount"}
HOST_COPIES = {torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu",
               torch.Tensor.numpy: "numpy"}


class _Copies(TorchFunctionMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_COPIES:
            self.counts[HOST_COPIES[func]] += 1
        return func(*args, **(kwargs or {}))


class _Operators(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = SYNCING_OPERATORS.get(func)
        if func is _aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            name = "repeat_interleave"
        if name:
            self.counts[name] += 1
        return func(*args, **kwargs)


class HostSyncCounter:
    """`with HostSyncCounter() as syncs: ...` then `syncs.counts` ({name: calls}) and
    `syncs.total`."""

    def __init__(self):
        self.counts: Counter = collections.Counter()
        self._modes = (_Copies(self.counts), _Operators(self.counts))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> "HostSyncCounter":
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
