"""What LoRA adapts: the adapter settings (`LoraConfig`) and the Megatron parallel linears they
target, named as the Hugging Face projections they hold.

Targets are given in Hugging Face names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,
down_proj; Qwen3.5's Gated DeltaNet in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj; or
all-linear for all of them; MoE experts' and shared experts' gate/up/down included, never the
router, the shared expert's gate, embeddings or lm_head), or by a regular expression
(`target_regex`, ms-swift's --target_regex) that must match the whole HF module name of a
projection (model.layers.3.self_attn.q_proj) or the global Megatron name of its linear
(decoder.layers.3.self_attention.linear_qkv: every projection it holds). The embedding and the
output layer can instead train in full (`modules_to_save`, lora/saved.py). The bridge's family
table says which HF projections each mcore linear
holds and how its weight is laid out over tensor-parallel ranks; `find_targets` reads both from
it, and `split_index` derives from the same mapping where every row (column-parallel) or column
(row-parallel) of each HF projection lives, so LoRA never repeats the bridge's slicing logic.
"""
import dataclasses
import math
import re
from typing import Callable, Dict, List, Optional, Tuple

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from swift_megatron.arguments.freeze import check_regex
from swift_megatron.arguments.lora import saved_module
from swift_megatron.bridge.families.common import attention, dense_mlp, moe_mlp
from swift_megatron.bridge.mapping import (QKV, ColumnParallel, Dims, GatedQKV, GateUp, Mapping,
                                           RowParallel, Segmented, Shard)
from swift_megatron.bridge.position import RankPosition
from swift_megatron.errors import UserError

HF_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ALL_LINEAR = "all-linear"
# mappings of the linears LoRA may adapt
ADAPTABLE = (QKV, GatedQKV, Segmented, GateUp, ColumnParallel, RowParallel)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Adapter shape and targets (`target_regex`, when set, instead of `target_modules`), the
    modules trained in full beside them (Megatron module paths, from any name
    arguments/lora.py's `saved_module` takes); `seed` seeds the initial A matrices."""

    r: int = 8
    lora_alpha: float = 32
    lora_dropout: float = 0.0
    target_modules: Tuple[str, ...] = (ALL_LINEAR,)
    use_rslora: bool = False
    seed: int = 42
    target_regex: Optional[str] = None
    modules_to_save: Tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "modules_to_save",
                           tuple(sorted({saved_module(n) for n in self.modules_to_save})))
        if self.r < 1:
            raise UserError(f"LoRA rank must be >= 1, got {self.r}")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"lora_dropout must be in [0, 1), got {self.lora_dropout}")
        check_regex(self.target_regex, "LoRA target_regex")
        if self.target_regex is None:
            self.projections()  # validates the names

    @property
    def scale(self) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rank-stabilised LoRA."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def projections(self) -> Tuple[str, ...]:
        """The HF projection names targeted (all-linear expanded)."""
        if ALL_LINEAR in self.target_modules:
            return HF_PROJECTIONS
        unknown = [name for name in self.target_modules if name not in HF_PROJECTIONS]
        if unknown or not self.target_modules:
            raise UserError(f"LoRA target_modules {list(self.target_modules)}: "
                            f"{', '.join(unknown) or 'empty'} not supported; use {ALL_LINEAR} or "
                            f"some of {', '.join(HF_PROJECTIONS)}")
        return tuple(name for name in HF_PROJECTIONS if name in self.target_modules)

    @classmethod
    def from_arguments(cls, lora_args, seed: int) -> "LoraConfig":
        """From arguments/lora.py's LoraArguments (the command-line flags)."""
        return cls(r=lora_args.lora_rank, lora_alpha=lora_args.lora_alpha,
                   lora_dropout=lora_args.lora_dropout,
                   target_modules=tuple(lora_args.target_modules),
                   use_rslora=lora_args.use_rslora, seed=seed,
                   target_regex=lora_args.target_regex,
                   modules_to_save=tuple(lora_args.modules_to_save))

    def selector(self) -> Callable[[str, Tuple[str, ...]], Tuple[str, ...]]:
        """(global Megatron module name, its HF projections) -> the projections to adapt."""
        if self.target_regex is None:
            wanted = set(self.projections())
            return lambda mcore, hf: tuple(n for n in hf if n.rsplit(".", 1)[-1] in wanted)
        pattern = re.compile(self.target_regex)
        return lambda mcore, hf: hf if pattern.fullmatch(mcore) else \
            tuple(n for n in hf if pattern.fullmatch(n))


@dataclasses.dataclass(frozen=True)
class LoraTarget:
    """One mcore parallel linear to adapt, and the HF projections it holds."""

    module_name: str              # path in this stage's GPTModel
    mapping: Mapping              # the bridge mapping of its weight
    hf_modules: Tuple[str, ...]   # global HF module name of every projection it holds, in order
    adapted: Tuple[str, ...]      # the subset of hf_modules that gets an adapter
    shard: Shard                  # its place in the (expert-)TP group

    @property
    def split_dim(self) -> int:
        """0: column-parallel (B split like the weight's rows); 1: row-parallel (A split)."""
        return 1 if isinstance(self.mapping, RowParallel) else 0


def default_mappings() -> List[Mapping]:
    """The decoder linears every supported family shares (the bridge's common table)."""
    return attention() + dense_mlp() + moe_mlp()


def _mapping_of(table: List[Mapping], global_name: str):
    for mapping in table:
        index = mapping.match(global_name)
        if index is not None:
            return mapping, index
    return None, None


def find_targets(model: torch.nn.Module, config: LoraConfig,
                 mappings: Optional[List[Mapping]] = None) -> List[LoraTarget]:
    """The linears of this pipeline stage that hold a targeted HF projection."""
    select = config.selector()
    table = mappings if mappings is not None else default_mappings()
    mc = model.config
    pos = RankPosition.of_config(mc, mc.num_moe_experts or 0).for_chunk(model)
    targets = []
    for name, module in model.named_modules():
        if type(module) not in (ColumnParallelLinear, RowParallelLinear):
            continue
        global_name = pos.to_global(f"{name}.weight")
        mapping, index = _mapping_of(table, global_name)
        if not isinstance(mapping, ADAPTABLE):
            continue
        hf = tuple(n.rsplit(".", 1)[0] for n in mapping.hf_names(index))
        adapted = select(global_name[:-len(".weight")], hf)
        if adapted:
            targets.append(LoraTarget(name, mapping, hf, adapted, pos.shard(mapping.is_expert)))
    return targets


def split_index(target: LoraTarget, local_size: int, dims: Dims) -> Dict[str, torch.Tensor]:
    """For every HF projection of the target, where each of its rows (column-parallel; HF weight
    dim 0) or columns (row-parallel; dim 1) lives: value v = rank * local_size + position in that
    rank's fused weight. Computed by the bridge mapping's own gather (`to_hf`) of index shards."""
    shape = (local_size, 1) if target.split_dim == 0 else (1, local_size)
    shards = [torch.arange(rank * local_size, (rank + 1) * local_size).reshape(shape)
              for rank in range(target.shard.size)]
    full = target.mapping.to_hf(shards, list(target.hf_modules), dims)
    return {name: index.reshape(-1) for name, index in full.items()}


def rows_on(index: torch.Tensor, local_size: int, rank: int) -> torch.Tensor:
    """Ascending HF rows/columns of a split index held by `rank`."""
    return torch.nonzero(index // local_size == rank).reshape(-1)
