"""Full training with ms-swift's freeze flags (--freeze_parameters, --freeze_parameters_regex,
--freeze_parameters_ratio, --trainable_parameters, --trainable_parameters_regex): each rank sets
`requires_grad` on its parameters by the rules of model/trainable.py, decided on the table of
the whole model (every rank's global names and full sizes, gathered once), so that every rank of
every parallel group freezes the same parameters and the ratio cuts at the same place whatever
the layout.

Call it on the model chunks before DDP wrapping: megatron's DDP then gives a frozen parameter no
gradient buffer, its optimizer no state (nor main copy), and the gradient norm and clipping do
not count it. Collective.
"""
import re
from typing import Callable, List, Sequence, Tuple

import torch
import torch.distributed as dist

from swift_megatron.bridge.position import RankPosition
from swift_megatron.logging import get_logger
from swift_megatron.model.trainable import FreezeRules, trainable_names
from swift_megatron.model.wrappers import unwrap

logger = get_logger(__name__)

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")
Local = List[Tuple[str, torch.nn.Parameter, int]]   # (global name, parameter, full size)


def _pattern(name: str) -> str:
    """The name with its layer and expert numbers blanked (the same for every layer)."""
    return _EXPERT.sub(".local_experts.#.", _LAYER.sub("decoder.layers.#.", name))


def _full_size(param: torch.nn.Parameter, pos: RankPosition) -> int:
    """Elements of the whole parameter (a tensor-parallel shard times its group's size)."""
    expert = not getattr(param, "allreduce", True)
    split = getattr(param, "tensor_model_parallel", False)
    return param.numel() * (pos.shard(expert).size if split else 1)


def local_parameters(chunks: Sequence[torch.nn.Module]) -> Local:
    """This rank's parameters under their global names, in model order."""
    out = []
    for chunk in map(unwrap, chunks):
        config = chunk.config
        pos = RankPosition.current(config.num_layers, config.num_moe_experts or 0).for_chunk(chunk)
        out += [(pos.to_global(n), p, _full_size(p, pos)) for n, p in chunk.named_parameters()]
    return out


def model_order(local_names: Sequence[str]) -> Callable[[str], tuple]:
    """A sort key putting global names in model order: what precedes the layers, the layers by
    number (each in its modules' order, experts by number), then what follows. Every rank holding
    every layer (pipeline size 1: the only case where the order matters, the ratio) computes the
    same key from its own names."""
    first = {}
    for name in local_names:
        first.setdefault(_pattern(name), len(first))
    layers_at = next((first[_pattern(n)] for n in local_names if _LAYER.match(n)), len(first))

    def key(name: str) -> tuple:
        position = first.get(_pattern(name), len(first))
        layer, expert = _LAYER.match(name), _EXPERT.search(name)
        if layer is None:
            return position, 0, 0, -1, name
        number = int(expert.group(1)) if expert else -1
        return layers_at, int(layer.group(1)), position, number, name
    return key


def apply_freeze(chunks: Sequence[torch.nn.Module], rules: FreezeRules) -> int:
    """Set requires_grad on this rank's parameters (module docstring); returns the number of
    trainable elements of the whole model. UserError, on every rank, for a prefix or expression
    that matches nothing or when nothing would train. Collective."""
    local = local_parameters(chunks)
    gathered: List = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [(n, size, p.requires_grad) for n, p, size in local])
    entries = {n: (size, trains) for part in gathered for n, size, trains in part}
    key = model_order([n for n, _, _ in local])
    table = sorted(((n, size) for n, (size, _) in entries.items()), key=lambda e: key(e[0]))
    tied = bool(unwrap(chunks[0]).share_embeddings_and_output_weights)
    trains = trainable_names(table, {n for n, (_, t) in entries.items() if t}, rules, tied)
    for name, param, _ in local:
        param.requires_grad_(name in trains)
    trainable = sum(size for n, size in table if n in trains)
    total = sum(size for _, size in table)
    logger.info(f"freeze flags: {trainable:,} of {total:,} parameters train "
                f"({100 * trainable / total:.1f}%)")
    return trainable
