"""Load an HF safetensors checkpoint straight into a TP/PP/EP-sharded Megatron model.

Every rank walks its own parameters, finds each one's mapping, and reads only the slices it
owns (no communication; peak memory about one tensor slice). A parameter without a mapping, a
missing HF tensor or a shape mismatch stops with a message naming the tensor.
"""
from typing import List, Sequence, Tuple

import torch

from swift_megatron.bridge.io import HFReader
from swift_megatron.bridge.mapping import Dims, Mapping
from swift_megatron.bridge.position import RankPosition
from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.logging.progress import progress
from swift_megatron.model.grouped_experts import GroupedExperts

logger = get_logger(__name__)


def find_mapping(mappings: List[Mapping], global_name: str) -> Tuple[Mapping, dict]:
    for mapping in mappings:
        index = mapping.match(global_name)
        if index is not None:
            return mapping, index
    raise ValueError(f"no HF mapping for Megatron parameter '{global_name}'")


def bridge_parameters(model: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    """(name, parameter) of every weight the bridge maps: all but those marked `bridge_skip`
    (LoRA adapters, which are no HF weights); grouped experts' weights as one view per expert
    under SequentialMLP's names (model/grouped_experts.py `expert_weights`)."""
    grouped = {prefix: module for prefix, module in model.named_modules()
               if isinstance(module, GroupedExperts)}
    params = []
    for name, param in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        if prefix in grouped:
            params += [(f"{prefix}.{n}", view) for n, view in grouped[prefix].expert_weights(leaf)]
        elif not getattr(param, "bridge_skip", False):
            params.append((name, param))
    return params


@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, hf_dir: str, mappings: List[Mapping], dims: Dims,
                    pos: RankPosition, aliases: Sequence[Tuple[str, str]] = ()) -> None:
    """Copy every bridged parameter's shard from `hf_dir` (names may be stored under the
    reader `aliases`)."""
    reader = HFReader(hf_dir, aliases)
    params = bridge_parameters(model)
    for name, param in progress(params, desc="loading HF weights"):
        global_name = pos.to_global(name)
        mapping, index = find_mapping(mappings, global_name)
        hf_names = mapping.hf_names(index)
        tensor = mapping.load(reader, hf_names, pos.shard(mapping.is_expert), dims)
        if tuple(tensor.shape) != tuple(param.shape):
            raise UserError(f"{hf_dir}: {', '.join(hf_names)} give shape {tuple(tensor.shape)} for "
                            f"{global_name}, expected {tuple(param.shape)}; does config.json "
                            "match the weights?")
        param.copy_(tensor.to(dtype=param.dtype))
    logger.info(f"loaded {len(params)} tensors from {hf_dir}")
