"""Streaming safetensors IO for HF checkpoints: read slices lazily, write sharded files.

`HFReader` opens a single `model.safetensors` or a sharded checkpoint with its index json and
reads only the requested slice of a tensor (safetensors maps the file; nothing else is read).
Its `aliases` ((prefix, alternative) pairs) let one name find a tensor stored under another
prefix (Qwen3.5's `model.language_model.` text stack saved as `model.`). `TensorReader`
reads tensors already in memory the same way.
`HFWriter` takes (name, tensor) pairs one at a time, flushes a shard whenever it reaches
`max_shard_size`, and writes the index json at the end, so peak memory is about one shard.
"""
import json
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from swift_megatron.errors import UserError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HFReader:
    """Lazy, sliced access to the tensors of an HF checkpoint directory."""

    def __init__(self, directory: str, aliases: Sequence[Tuple[str, str]] = ()):
        self.directory = directory
        self.file_of = self._index(directory)
        self.aliases = tuple(aliases)
        self._handles: Dict[str, object] = {}

    @staticmethod
    def _index(directory: str) -> Dict[str, str]:
        index_path = os.path.join(directory, INDEX)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                return dict(json.load(f)["weight_map"])
        single = os.path.join(directory, SINGLE)
        if os.path.isfile(single):
            with safe_open(single, "pt") as f:
                return {name: SINGLE for name in f.keys()}
        raise UserError(f"{directory}: no {SINGLE} or {INDEX} (only safetensors checkpoints "
                        "are supported)")

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def _stored(self, name: str) -> str:
        """The name the tensor is stored under (the first alias present, else `name`)."""
        if name in self.file_of:
            return name
        for prefix, alternative in self.aliases:
            if name.startswith(prefix) and alternative + name[len(prefix):] in self.file_of:
                return alternative + name[len(prefix):]
        return name

    def _handle(self, name: str):
        if name not in self.file_of:
            raise UserError(f"{self.directory}: tensor '{name}' is missing from the checkpoint")
        file = self.file_of[name]
        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.directory, file), "pt")
        return self._handles[file]

    def shape(self, name: str) -> List[int]:
        name = self._stored(name)
        return list(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: Optional[int] = None, start: int = 0,
             stop: Optional[int] = None) -> torch.Tensor:
        """The tensor, or its [start:stop] slice along `dim`."""
        name = self._stored(name)
        sliced = self._handle(name).get_slice(name)
        if dim is None:
            return sliced[:]
        index = [slice(None)] * len(sliced.get_shape())
        index[dim] = slice(start, stop)
        return sliced[tuple(index)]


class TensorReader:
    """Tensors in memory (e.g. read from a PEFT adapter file) read as HFReader reads a checkpoint,
    so that a mapping's `load` takes its slice of them."""

    def __init__(self, tensors: Dict[str, torch.Tensor]):
        self.tensors = tensors

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> List[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str, dim: Optional[int] = None, start: int = 0,
             stop: Optional[int] = None) -> torch.Tensor:
        tensor = self.tensors[name]
        if dim is None:
            return tensor
        stop = tensor.shape[dim] if stop is None else stop
        return tensor.narrow(dim, start, stop - start)


def parse_size(text: str) -> int:
    """'5GB' / '500MB' / '20KB' / '1024' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise UserError(f"--max_shard_size: cannot read size {text!r} (e.g. 5GB, 500MB)")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper().replace("I", "")
    return int(number * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9}[unit])


def _fsync(path: str) -> None:
    """Flush a written file to disk, so the rename that publishes a checkpoint never exposes a
    file the OS has not written yet (megatron's checkpoint writer does the same)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class HFWriter:
    """Write (name, tensor) pairs as safetensors shards plus an index, one shard in memory."""

    def __init__(self, directory: str, max_shard_size: str = "5GB"):
        self.directory = directory
        self.limit = parse_size(max_shard_size)
        self.current: Dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.weight_map: Dict[str, str] = {}
        self.total_bytes = 0
        self._files: List[Tuple[str, List[str]]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.current and self.current_bytes + size > self.limit:
            self._flush()
        self.current[name] = tensor.detach().to("cpu").contiguous()
        self.current_bytes += size
        self.total_bytes += size

    def add_all(self, pairs: Iterable[Tuple[str, torch.Tensor]]) -> None:
        for name, tensor in pairs:
            self.add(name, tensor)

    def _flush(self) -> None:
        number = len(self._files) + 1
        tmp_name = f"shard-{number:05d}.safetensors"
        path = os.path.join(self.directory, tmp_name)
        save_file(self.current, path, metadata={"format": "pt"})
        _fsync(path)
        self._files.append((tmp_name, list(self.current)))
        self.current, self.current_bytes = {}, 0

    def close(self) -> None:
        """Flush the last shard and name the files as transformers does (model-0000i-of-0000n)."""
        if self.current or not self._files:
            self._flush()
        count = len(self._files)
        if count == 1:
            os.replace(os.path.join(self.directory, self._files[0][0]),
                       os.path.join(self.directory, SINGLE))
            return
        for i, (tmp_name, names) in enumerate(self._files, start=1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            os.replace(os.path.join(self.directory, tmp_name), os.path.join(self.directory, final))
            self.weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": dict(sorted(self.weight_map.items()))}
        with open(os.path.join(self.directory, INDEX), "w") as f:
            json.dump(index, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
