"""Qwen3.5-MoE: the qwen3_5 hybrid text stack with, in every layer, routed experts (stored per
expert in the hub format) plus one shared expert whose output a sigmoid gate scales; the vision
tower as qwen3_5's."""
from typing import List

from swift_megatron.bridge.families.common import L, layer_prefix, moe_mlp
from swift_megatron.bridge.families.qwen3_5 import (DECODER, LOAD_ALIASES, PASSTHROUGH, mixers,
                                                    tower)
from swift_megatron.bridge.mapping import GateUp, Mapping, Replicated, RowParallel

__all__ = ["LOAD_ALIASES", "PASSTHROUGH", "mappings"]


def shared_expert(model: str) -> List[Mapping]:
    H, M = layer_prefix(model) + "mlp.", L + "mlp.shared_experts."
    return [
        GateUp(M + "linear_fc1.weight", H + "shared_expert.gate_proj.weight",
               H + "shared_expert.up_proj.weight"),
        RowParallel(M + "linear_fc2.weight", H + "shared_expert.down_proj.weight"),
        Replicated(M + "gate_weight", H + "shared_expert_gate.weight"),
    ]


def mappings(hf: dict) -> List[Mapping]:
    return mixers(hf) + moe_mlp(DECODER) + shared_expert(DECODER) + tower(hf)
