"""Checks of a parallel layout against a model's shape (pure; reads an HF config dict).

Megatron splits attention heads and KV groups over TP, layers over PP and experts over EP; a
layout that does not divide the model fails deep inside model construction, so it is checked
up front with a message that names the flag and the values that work.
"""
import dataclasses
from typing import List, Mapping, Optional, Tuple

from swift_megatron.errors import UserError
from swift_megatron.model.text_config import text_config

_FIRST, _LAST = "--decoder_first_pipeline_num_layers", "--decoder_last_pipeline_num_layers"


@dataclasses.dataclass(frozen=True)
class PipelineSplit:
    """How the decoder layers are cut over PP stages x VPP model chunks, as megatron-core cuts
    them (transformer_layer.get_transformer_layer_offset): the first and last stages hold
    `first` / `last` layers when given (--decoder_first/last_pipeline_num_layers), the other
    stages an equal share of the rest; each stage's layers are cut into `vpp` equal chunks, and
    chunk v of stage p holds the layers after those of (v, p-1), in the order (v, p)."""

    num_layers: int
    pp: int = 1
    vpp: int = 1
    first: Optional[int] = None
    last: Optional[int] = None

    @property
    def uneven(self) -> bool:
        return self.first is not None or self.last is not None

    def stage_layers(self) -> List[int]:
        """Layers of each pipeline stage (UserError when the split is not one megatron makes)."""
        self.check()
        given = {0: self.first, self.pp - 1: self.last} if self.pp > 1 else {}
        given = {p: n for p, n in given.items() if n is not None}
        middle = (self.num_layers - sum(given.values())) // max(self.pp - len(given), 1)
        return [given.get(p, middle) for p in range(self.pp)]

    def fullest(self) -> int:
        """Layers of the pipeline stage that holds the most."""
        return max(self.stage_layers())

    def chunk(self, pp_rank: int, vp_stage: int = 0) -> Tuple[int, int]:
        """(global number of the chunk's first layer, its number of layers)."""
        per_chunk = [n // self.vpp for n in self.stage_layers()]
        offset = vp_stage * sum(per_chunk) + sum(per_chunk[:pp_rank])
        return offset, per_chunk[pp_rank]

    def owner(self, layer: int) -> Tuple[int, int]:
        """(pipeline stage, model chunk) holding global layer `layer`."""
        for vp_stage in range(self.vpp):
            for pp_rank in range(self.pp):
                offset, count = self.chunk(pp_rank, vp_stage)
                if offset <= layer < offset + count:
                    return pp_rank, vp_stage
        raise ValueError(f"layer {layer} is not among the {self.num_layers} layers")

    def check(self) -> None:
        """megatron-core's rules (TransformerConfig's), as UserErrors naming the flags."""
        layers, pp, vpp = self.num_layers, self.pp, self.vpp
        if not self.uneven:
            if layers % pp:
                raise UserError(f"pipeline_model_parallel_size={pp} does not divide "
                                f"num_hidden_layers={layers}: use one of {_divisors(layers)}, or "
                                f"split unevenly with {_FIRST} / {_LAST}")
            if layers % (pp * vpp):
                raise UserError(f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_"
                                f"size = {pp} x {vpp} does not divide num_hidden_layers={layers}: "
                                f"each stage holds {vpp} chunks of equal size; use a virtual_"
                                f"pipeline_model_parallel_size with {pp} x it among "
                                f"{_divisors(layers)}")
            return
        self._check_uneven()

    def _check_uneven(self) -> None:
        layers, pp, vpp = self.num_layers, self.pp, self.vpp
        if pp == 1:
            raise UserError(f"{_FIRST} / {_LAST} need --pipeline_model_parallel_size > 1")
        given = [(flag, n) for flag, n in ((_FIRST, self.first), (_LAST, self.last))
                 if n is not None]
        for flag, n in given:
            if n < 1 or n % vpp:
                raise UserError(f"{flag} {n} must be >= 1" + (
                    f" and a multiple of --virtual_pipeline_model_parallel_size {vpp} (each "
                    f"chunk of the stage holds an equal share)" if vpp > 1 else ""))
        rest, stages = layers - sum(n for _, n in given), pp - len(given)
        named = " + ".join(f"{flag} {n}" for flag, n in given)
        if rest < 0 or bool(rest) != bool(stages):
            raise UserError(f"{named} leave {rest} of num_hidden_layers={layers} for "
                            f"{stages} other pipeline stages: each stage needs layers")
        if stages and rest % (stages * vpp):
            unit = f"{stages} x {vpp} (stages x chunks)" if vpp > 1 else str(stages)
            raise UserError(f"{named} leave {rest} of num_hidden_layers={layers} for the {stages} "
                            f"middle pipeline stages, which must hold equal shares: a multiple "
                            f"of {unit}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def num_experts(hf_config: Mapping) -> Optional[int]:
    hf_config = text_config(hf_config)
    return hf_config.get("num_experts") or hf_config.get("num_local_experts") or None


def check_layout(hf_config: Mapping, tp: int, pp: int, ep: int = 1, etp: int = 1,
                 vpp: int = 1, first: Optional[int] = None, last: Optional[int] = None) -> None:
    """Raise UserError when TP/PP/EP/ETP do not divide the model's heads (Gated DeltaNet's
    too), layers or experts, or the layers do not split over PP x VPP (the interleaved
    schedule's model chunks; `first` / `last`: the uneven split's first / last stage), or
    when the first chunk lacks a layer that takes deepstack features (Qwen3-VL)."""
    deepstack = len((hf_config.get("vision_config") or {}).get("deepstack_visual_indexes") or [])
    hf_config = text_config(hf_config)
    heads = hf_config.get("num_attention_heads")
    kv_heads = hf_config.get("num_key_value_heads") or heads
    layers = hf_config.get("num_hidden_layers")
    if heads and heads % tp:
        raise UserError(f"tensor_model_parallel_size={tp} does not divide num_attention_heads="
                        f"{heads}: use one of {_divisors(heads)}")
    if kv_heads and kv_heads % tp:
        raise UserError(f"tensor_model_parallel_size={tp} does not divide num_key_value_heads="
                        f"{kv_heads}: use one of {_divisors(kv_heads)}")
    for key in ("linear_num_key_heads", "linear_num_value_heads"):
        linear = hf_config.get(key) if hf_config.get("layer_types") else None
        if linear and linear % tp:
            raise UserError(f"tensor_model_parallel_size={tp} does not divide {key}={linear} "
                            f"(Gated DeltaNet heads): use one of {_divisors(linear)}")
    split = PipelineSplit(layers, pp, vpp, first, last) if layers else None
    if split is not None:
        split.check()
    if split is not None and deepstack > split.chunk(0)[1]:
        raise UserError(f"the vision tower's deepstack features go into decoder layers "
                        f"1..{deepstack}, which the first pipeline stage (its first model chunk) "
                        f"must hold; with pipeline_model_parallel_size={pp} x virtual_pipeline_"
                        f"model_parallel_size={vpp} it holds {split.chunk(0)[1]} of "
                        f"{layers}: use a smaller layout (or a larger {_FIRST})")
    experts = num_experts(hf_config)
    if experts is None and ep > 1:
        raise UserError("expert_model_parallel_size > 1 needs a MoE model; this model has no "
                        "experts")
    moe_ffn = hf_config.get("moe_intermediate_size")
    if moe_ffn and moe_ffn % etp:
        raise UserError(f"expert_tensor_parallel_size={etp} does not divide "
                        f"moe_intermediate_size={moe_ffn}: use one of {_divisors(moe_ffn)}")


def check_expert_groups(world_size: int, pp: int, ep: int, etp: int) -> None:
    """megatron-core forms the expert groups over the ranks of a pipeline stage: the world size
    must be a multiple of ETP x EP x PP (its expert data-parallel size is the quotient)."""
    if ep > 1 and world_size % (etp * ep * pp):
        raise UserError(f"world_size={world_size} is not divisible by expert_tensor_parallel_size "
                        f"x expert_model_parallel_size x pipeline_model_parallel_size = {etp} x "
                        f"{ep} x {pp}: megatron-core splits each stage's ranks into expert groups")
