"""Export: yield (hf_name, full tensor) pairs from a TP/PP/EP-sharded Megatron model.

THE single path used by `megatron export --to_hf`, weight sync to rollout engines and LoRA
merge. Every rank iterates the same global sequence and receives every full tensor, one at a
time: the owning stage gathers the shards over its (expert-)TP group and converts them to HF
layout, experts are broadcast over the EP group, then everything over the PP group.

The sequence and the HF shapes come from an export plan built once per model (one
all_gather_object of names and shapes), so ranks that do not own a tensor can allocate it.
A stage's model is given as `parts`: (model chunk, its RankPosition) pairs, one per chunk of the
interleaved schedule.
"""
import dataclasses
import re
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from swift_megatron.bridge.load import bridge_parameters, find_mapping
from swift_megatron.bridge.mapping import Dims, Mapping
from swift_megatron.bridge.position import RankPosition



@dataclasses.dataclass(frozen=True)
class PlanItem:
    global_name: str
    stage: int
    ep_owner: int
    outputs: Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]  # (hf name, shape, dtype)


def _order_key(name: str, table: List[Mapping]) -> tuple:
    layer = re.search(r"decoder\.layers\.(\d+)\.", name)
    expert = re.search(r"local_experts\.(\d+)\.", name)
    position = next(i for i, m in enumerate(table) if m.match(name) is not None)
    group = 1 if layer else (0 if name.startswith("embedding.") else 2)
    return (group, int(layer.group(1)) if layer else 0, position, int(expert.group(1)) if expert else -1)


Parts = List[Tuple[torch.nn.Module, RankPosition]]


def _global_parameters(parts: Parts) -> Dict[str, torch.nn.Parameter]:
    """{global name: parameter} of every chunk of this stage."""
    return {pos.to_global(n): p for model, pos in parts for n, p in bridge_parameters(model)}


def _local_plan(parts: Parts, mappings: List[Mapping], dims: Dims) -> Dict[str, PlanItem]:
    """Plan items for the tensors this rank owns (TP rank 0 of its group describes them)."""
    items, pos = {}, parts[0][1]
    for global_name, param in _global_parameters(parts).items():
        mapping, index = find_mapping(mappings, global_name)
        if not mapping.export:
            continue
        shard = pos.shard(mapping.is_expert)
        count = shard.size if mapping.gathered else 1
        meta = [torch.empty(param.shape, dtype=param.dtype, device="meta")] * count
        hf = mapping.to_hf(meta, mapping.hf_names(index), dims)
        items[global_name] = PlanItem(global_name, pos.pp_rank, pos.ep_rank if mapping.is_expert else 0,
                                      tuple((n, tuple(t.shape), t.dtype) for n, t in hf.items()))
    return items


def build_plan(parts: Parts, mappings: List[Mapping], dims: Dims) -> List[PlanItem]:
    """The global export sequence (identical on every rank)."""
    local = _local_plan(parts, mappings, dims)
    gathered: List[Optional[Dict[str, PlanItem]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged = {}
    for part in gathered:
        merged.update(part)
    return [merged[name] for name in sorted(merged, key=lambda n: _order_key(n, mappings))]


def _gather_shards(param: torch.Tensor, mapping: Mapping) -> List[torch.Tensor]:
    group = (mpu.get_expert_tensor_parallel_group() if mapping.is_expert
             else mpu.get_tensor_model_parallel_group())
    size = dist.get_world_size(group)
    if not mapping.gathered or size == 1:
        return [param.detach()]
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return shards


def _export_value(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard as exported: what the parameter's `bridge_export` callable gives when it
    has one (a LoRA-adapted weight: W + scale * B A, computed out of place), else the parameter."""
    export = getattr(param, "bridge_export", None)
    return param if export is None else export()


def _broadcast(tensors: Dict[str, torch.Tensor], group, src_index: int) -> None:
    src = dist.get_process_group_ranks(group)[src_index]
    for tensor in tensors.values():
        dist.broadcast(tensor, src=src, group=group)


def _materialize(item: PlanItem, params: Dict[str, torch.Tensor], mappings: List[Mapping],
                 dims: Dims, pos: RankPosition, device) -> Dict[str, torch.Tensor]:
    mapping, index = find_mapping(mappings, item.global_name)
    in_stage = item.stage == pos.pp_rank
    if item.global_name in params:
        tensors = mapping.to_hf(_gather_shards(_export_value(params[item.global_name]), mapping),
                                mapping.hf_names(index), dims)
    else:
        tensors = {n: torch.empty(shape, dtype=dtype, device=device) for n, shape, dtype in item.outputs}
    if in_stage and mapping.is_expert and pos.ep_size > 1:
        _broadcast(tensors, mpu.get_expert_model_parallel_group(), item.ep_owner)
    if pos.pp_size > 1:
        _broadcast(tensors, mpu.get_pipeline_model_parallel_group(), item.stage)
    return tensors


@torch.no_grad()
def export_hf_weights(parts: Parts, mappings: List[Mapping], dims: Dims,
                      plan: Optional[List[PlanItem]] = None) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield every HF tensor, full size, on every rank, in a fixed global order."""
    plan = plan if plan is not None else build_plan(parts, mappings, dims)
    params, pos = _global_parameters(parts), parts[0][1]
    device = next(parts[0][0].parameters()).device
    for item in plan:
        yield from _materialize(item, params, mappings, dims, pos, device).items()
