"""Where this rank sits for the bridge: its TP and expert-TP shards, and how a model chunk's
local layer numbers and EP-local expert numbers translate to global ones.

Layers are cut into PP x VPP chunks as megatron cuts them (model/layout.py `PipelineSplit`:
equal chunks, or a first / last stage of its own size with --decoder_first/last_pipeline_
num_layers); chunk c of stage p holds the layers after those of chunk (c, p - 1) (megatron's
interleaved assignment). `RankPosition.current` describes a stage's first chunk; `for_chunk(model)`
any chunk."""
import dataclasses
import re
from typing import Optional

from megatron.core import parallel_state as mpu

from swift_megatron.bridge.mapping import Shard
from swift_megatron.model.layout import PipelineSplit

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"\.local_experts\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class RankPosition:
    tp: Shard
    etp: Shard
    pp_rank: int
    pp_size: int
    ep_rank: int
    ep_size: int
    split: PipelineSplit
    experts_per_rank: int
    layer_offset: int  # global number of the chunk's first layer

    @classmethod
    def current(cls, num_layers: int, num_experts: int = 0, first: Optional[int] = None,
                last: Optional[int] = None) -> "RankPosition":
        """This rank's position; `first` / `last`: the layers of the first / last pipeline stage
        when split unevenly (TransformerConfig.num_layers_in_first/last_pipeline_stage)."""
        pp, ep = mpu.get_pipeline_model_parallel_world_size(), mpu.get_expert_model_parallel_world_size()
        split = PipelineSplit(num_layers, pp, mpu.get_virtual_pipeline_model_parallel_world_size()
                              or 1, first, last)
        pp_rank = mpu.get_pipeline_model_parallel_rank()
        return cls(
            tp=Shard(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size()),
            etp=Shard(mpu.get_expert_tensor_parallel_rank(),
                      mpu.get_expert_tensor_parallel_world_size()),
            pp_rank=pp_rank, pp_size=pp,
            ep_rank=mpu.get_expert_model_parallel_rank(), ep_size=ep,
            split=split, experts_per_rank=(num_experts or 0) // ep,
            layer_offset=split.chunk(pp_rank)[0])

    @classmethod
    def of_config(cls, config, num_experts: int = 0) -> "RankPosition":
        """This rank's position in a model built with TransformerConfig `config`."""
        return cls.current(config.num_layers, num_experts,
                           getattr(config, "num_layers_in_first_pipeline_stage", None),
                           getattr(config, "num_layers_in_last_pipeline_stage", None))

    def for_chunk(self, model) -> "RankPosition":
        """The position of a model chunk (a GPTModel built with `vp_stage`, or not)."""
        stage = getattr(model, "vp_stage", None) or 0
        return dataclasses.replace(self, layer_offset=self.split.chunk(self.pp_rank, stage)[0])

    def shard(self, is_expert: bool) -> Shard:
        return self.etp if is_expert else self.tp

    def to_global(self, name: str) -> str:
        """Stage-local layer and EP-local expert numbers -> global numbers."""
        name = _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + self.layer_offset}.", name)
        return _EXPERT.sub(lambda m: f".local_experts.{int(m.group(1)) + self.ep_rank * self.experts_per_rank}.", name)

    def owner_stage(self, global_name: str) -> int:
        """The pipeline stage holding a global name (embedding first, head last)."""
        layer = _LAYER.match(global_name)
        if layer:
            return self.split.owner(int(layer.group(1)))[0]
        return 0 if global_name.startswith("embedding.") else self.pp_size - 1

    def owner_ep(self, global_name: str) -> int:
        expert = _EXPERT.search(global_name)
        return int(expert.group(1)) // self.experts_per_rank if expert else 0
