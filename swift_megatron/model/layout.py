"""Checks of a parallel layout against a model's shape (pure; reads an HF config dict).

Megatron splits attention heads and KV groups over TP, layers over PP and experts over EP; a
layout that does not divide the model fails deep inside model construction, so it is checked
up front with a message that names the flag and the values that work.
"""
from typing import Mapping, Optional

from swift_megatron.errors import UserError
from swift_megatron.model.text_config import text_config


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def num_experts(hf_config: Mapping) -> Optional[int]:
    hf_config = text_config(hf_config)
    return hf_config.get("num_experts") or hf_config.get("num_local_experts") or None


def check_layout(hf_config: Mapping, tp: int, pp: int, ep: int = 1, etp: int = 1,
                 vpp: int = 1) -> None:
    """Raise UserError when TP/PP/EP/ETP do not divide the model's heads (Gated DeltaNet's
    too), layers or experts, or PP x VPP (the interleaved schedule's model chunks) its layers,
    or when the first chunk lacks a layer that takes deepstack features (Qwen3-VL)."""
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
    if layers and layers % pp:
        raise UserError(f"pipeline_model_parallel_size={pp} does not divide num_hidden_layers="
                        f"{layers}: use one of {_divisors(layers)}")
    if layers and vpp > 1 and layers % (pp * vpp):
        raise UserError(f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = "
                        f"{pp} x {vpp} does not divide num_hidden_layers={layers}: each stage "
                        f"holds {vpp} chunks of equal size; use a virtual_pipeline_model_"
                        f"parallel_size with {pp} x it among {_divisors(layers)}")
    if layers and deepstack > layers // (pp * vpp):
        raise UserError(f"the vision tower's deepstack features go into decoder layers "
                        f"1..{deepstack}, which the first pipeline stage (its first model chunk) "
                        f"must hold; with pipeline_model_parallel_size={pp} x virtual_pipeline_"
                        f"model_parallel_size={vpp} it holds {layers // (pp * vpp)} of "
                        f"{layers}: use a smaller layout")
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
