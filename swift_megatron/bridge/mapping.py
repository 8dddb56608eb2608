"""Mapping classes: how one Megatron parameter relates to one or more HF tensors, and how it is
split over tensor-parallel ranks. They own every TP/ETP scatter (load) and gather (export); the
per-family tables (bridge/families/) only list which class maps which names.

Names are patterns with `{layer}` and `{expert}` placeholders, in GLOBAL numbering (the bridge
translates pipeline-stage-local layers and EP-local experts). `load` builds this rank's shard
from the HF checkpoint, reading only the rows/columns it owns; `to_hf` turns the list of all
ranks' shards (in rank order) back into full HF tensors.

    Replicated      same tensor on every rank (norms, router)
    ColumnParallel  split along dim 0
    RowParallel     split along dim 1
    VocabParallel   split along dim 0 after padding the vocab to a multiple of TP
    QKV             q, k, v fused per query group: [q of group 0, k0, v0, q of group 1, ...]
    GateUp          gate and up fused per rank: [gate shard; up shard]
    GatedQKV        HF q_proj holding per head [q; gate] (Qwen3.5) plus k, v, fused per query
                    group as [q heads | gate heads | k | v]
    Segmented       HF tensors made of named segments (Gated DeltaNet's in_proj_qkv = [q; k; v],
                    in_proj_z, in_proj_b, in_proj_a); each rank holds its chunk of every segment,
                    concatenated in order ([q_r, k_r, v_r, z_r, b_r, a_r] for mcore's in_proj)
"""
import abc
import dataclasses
import re
from typing import Dict, List, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class Shard:
    """This rank's place in the group a parameter is split over (TP, or ETP for experts)."""

    rank: int = 0
    size: int = 1


@dataclasses.dataclass(frozen=True)
class Dims:
    """Model dimensions the fused layouts need."""

    num_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    # Gated DeltaNet (hybrid models; 0 elsewhere): key dim Kh * Dk, value dim Vh * Dv, Vh
    linear_qk_dim: int = 0
    linear_v_dim: int = 0
    linear_v_heads: int = 0


def _chunk(full: int, shard: Shard):
    if full % shard.size:
        raise ValueError(f"dimension {full} does not split over {shard.size} ranks")
    step = full // shard.size
    return shard.rank * step, (shard.rank + 1) * step


class Mapping(abc.ABC):
    """Base: an mcore name pattern and the HF name patterns it maps to."""

    gathered = True  # whether export gathers shards over the (E)TP group

    def __init__(self, mcore: str, *hf: str, export: bool = True):
        self.mcore = mcore
        self.hf = list(hf)
        self.export = export  # False: a copy of another tensor (tied output layer)
        pattern = re.escape(mcore).replace(r"\{layer\}", r"(?P<layer>\d+)")
        self._regex = re.compile(pattern.replace(r"\{expert\}", r"(?P<expert>\d+)") + "$")

    @property
    def is_expert(self) -> bool:
        return "{expert}" in self.mcore

    def match(self, mcore_name: str):
        found = self._regex.match(mcore_name)
        return None if found is None else {k: int(v) for k, v in found.groupdict().items()}

    def hf_names(self, index: Dict[str, int]) -> List[str]:
        return [name.format(**index) for name in self.hf]

    @abc.abstractmethod
    def load(self, reader, names: List[str], shard: Shard, dims: Dims) -> torch.Tensor:
        """This rank's shard, read from the HF checkpoint (only the rows/columns it owns)."""

    @abc.abstractmethod
    def to_hf(self, shards: Sequence[torch.Tensor], names: List[str],
              dims: Dims) -> Dict[str, torch.Tensor]:
        """Full HF tensors from every rank's shard (in rank order)."""


class Replicated(Mapping):
    gathered = False

    def load(self, reader, names, shard, dims):
        return reader.read(names[0])

    def to_hf(self, shards, names, dims):
        return {names[0]: shards[0]}


class _Split(Mapping):
    dim = 0

    def load(self, reader, names, shard, dims):
        start, stop = _chunk(reader.shape(names[0])[self.dim], shard)
        return reader.read(names[0], self.dim, start, stop)

    def to_hf(self, shards, names, dims):
        return {names[0]: torch.cat(list(shards), dim=self.dim)}


class ColumnParallel(_Split):
    dim = 0


class RowParallel(_Split):
    dim = 1


class VocabParallel(Mapping):
    """Embedding / output rows, padded from vocab_size to padded_vocab_size (zeros)."""

    def load(self, reader, names, shard, dims):
        start, stop = _chunk(dims.padded_vocab_size, shard)
        rows = reader.read(names[0], 0, min(start, dims.vocab_size), min(stop, dims.vocab_size))
        if rows.shape[0] == stop - start:
            return rows
        padded = rows.new_zeros((stop - start,) + tuple(rows.shape[1:]))
        padded[:rows.shape[0]] = rows
        return padded

    def to_hf(self, shards, names, dims):
        return {names[0]: torch.cat(list(shards), dim=0)[:dims.vocab_size]}


class QKV(Mapping):
    """q/k/v projections (weights or biases) fused per query group, groups split over TP."""

    def load(self, reader, names, shard, dims):
        groups_start, groups_stop = _chunk(dims.num_query_groups, shard)
        q_per_group = dims.num_heads // dims.num_query_groups
        parts = []
        for name, heads in zip(names, (q_per_group, 1, 1)):
            rows = heads * dims.head_dim
            part = reader.read(name, 0, groups_start * rows, groups_stop * rows)
            parts.append(part.reshape(groups_stop - groups_start, rows, *part.shape[1:]))
        fused = torch.cat(parts, dim=1)
        return fused.reshape(-1, *fused.shape[2:])

    def to_hf(self, shards, names, dims):
        full = torch.cat(list(shards), dim=0)
        q_rows = dims.num_heads // dims.num_query_groups * dims.head_dim
        grouped = full.reshape(dims.num_query_groups, q_rows + 2 * dims.head_dim, *full.shape[1:])
        q, k, v = torch.split(grouped, [q_rows, dims.head_dim, dims.head_dim], dim=1)
        return {name: t.reshape(-1, *full.shape[1:]).contiguous()
                for name, t in zip(names, (q, k, v))}


class GateUp(Mapping):
    """SwiGLU gate and up projections; each rank holds [its gate rows; its up rows]."""

    def load(self, reader, names, shard, dims):
        start, stop = _chunk(reader.shape(names[0])[0], shard)
        return torch.cat([reader.read(name, 0, start, stop) for name in names], dim=0)

    def to_hf(self, shards, names, dims):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return {names[0]: torch.cat([h[0] for h in halves], dim=0),
                names[1]: torch.cat([h[1] for h in halves], dim=0)}


class GatedQKV(Mapping):
    """Gated attention's q (with its output gate), k and v fused per query group, groups split
    over TP. HF's q_proj rows are per head [q (head_dim); gate (head_dim)]; mcore's linear_qkv
    rows per group are [q of its heads | gate of its heads | k | v]."""

    def load(self, reader, names, shard, dims):
        groups_start, groups_stop = _chunk(dims.num_query_groups, shard)
        groups, per_group = groups_stop - groups_start, dims.num_heads // dims.num_query_groups
        rows = 2 * per_group * dims.head_dim
        qg = reader.read(names[0], 0, groups_start * rows, groups_stop * rows)
        tail = tuple(qg.shape[1:])
        qg = qg.reshape(groups, per_group, 2, dims.head_dim, *tail)
        parts = [qg[:, :, 0].reshape(groups, per_group * dims.head_dim, *tail),
                 qg[:, :, 1].reshape(groups, per_group * dims.head_dim, *tail)]
        for name in names[1:]:
            part = reader.read(name, 0, groups_start * dims.head_dim, groups_stop * dims.head_dim)
            parts.append(part.reshape(groups, dims.head_dim, *tail))
        return torch.cat(parts, dim=1).reshape(-1, *tail)

    def to_hf(self, shards, names, dims):
        full = torch.cat(list(shards), dim=0)
        tail, hd = tuple(full.shape[1:]), dims.head_dim
        per_group = dims.num_heads // dims.num_query_groups
        grouped = full.reshape(dims.num_query_groups, 2 * per_group * hd + 2 * hd, *tail)
        q, gate, k, v = torch.split(grouped, [per_group * hd, per_group * hd, hd, hd], dim=1)
        shape = (dims.num_query_groups, per_group, 1, hd) + tail
        qg = torch.cat([q.reshape(shape), gate.reshape(shape)], dim=2)
        return {names[0]: qg.reshape(-1, *tail).contiguous(),
                names[1]: k.reshape(-1, *tail).contiguous(),
                names[2]: v.reshape(-1, *tail).contiguous()}


class Segmented(Mapping):
    """A column-parallel parameter whose rows are segments of one or more HF tensors.

    `segments` lists (HF name index, Dims field giving the segment's rows) in HF order; the HF
    tensor `i` is the concatenation of its segments. Each rank holds its 1/TP chunk of every
    segment, concatenated in the order listed."""

    def __init__(self, mcore: str, *hf: str, segments, export: bool = True):
        super().__init__(mcore, *hf, export=export)
        self.segments = list(segments)

    def _layout(self, dims):
        """[(hf index, row offset in that tensor, rows)] of every segment."""
        offsets, layout = [0] * len(self.hf), []
        for index, field in self.segments:
            rows = getattr(dims, field)
            layout.append((index, offsets[index], rows))
            offsets[index] += rows
        return layout

    def load(self, reader, names, shard, dims):
        parts = []
        for index, offset, rows in self._layout(dims):
            start, stop = _chunk(rows, shard)
            parts.append(reader.read(names[index], 0, offset + start, offset + stop))
        return torch.cat(parts, dim=0)

    def to_hf(self, shards, names, dims):
        layout = self._layout(dims)
        sizes = [rows // len(shards) for _, _, rows in layout]
        pieces = [torch.split(shard, sizes, dim=0) for shard in shards]
        out = {}
        for i, name in enumerate(names):
            out[name] = torch.cat([torch.cat([p[j] for p in pieces], dim=0)
                                   for j, (index, _, _) in enumerate(layout) if index == i], dim=0)
        return out
