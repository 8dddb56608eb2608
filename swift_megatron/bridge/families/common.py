"""Building blocks of the family tables: the Megatron <-> HF names every decoder-only family
shares (embeddings, attention, dense SwiGLU MLP, routed experts), in export order, and the
vision tower of vision-language families. `model` is
the HF prefix of the decoder ("model." for causal LMs, "model.language_model." for the text
stack of a multimodal checkpoint)."""
from typing import List

import torch

from swift_megatron.bridge.mapping import (QKV, GateUp, Mapping, Replicated, RowParallel,
                                           VocabParallel)
from swift_megatron.model.vision import VISUAL, vision_tower

L = "decoder.layers.{layer}."   # Megatron layer prefix
MODEL = "model."                # HF decoder prefix of causal LMs


def layer_prefix(model: str = MODEL) -> str:
    """The HF prefix of a decoder layer."""
    return model + "layers.{layer}."


def embeddings(tied: bool, model: str = MODEL) -> List[Mapping]:
    """Input embedding, final norm and output layer. A tied output layer exists in Megatron only
    on the last pipeline stage (a copy of the embedding): it loads from the embedding and is not
    exported, as HF omits lm_head for tied models."""
    return [
        VocabParallel("embedding.word_embeddings.weight", model + "embed_tokens.weight"),
        Replicated("decoder.final_layernorm.weight", model + "norm.weight"),
        VocabParallel("output_layer.weight", model + "embed_tokens.weight", export=False) if tied
        else VocabParallel("output_layer.weight", "lm_head.weight"),
    ]


def attention(qkv_bias: bool = False, qk_norm: bool = False, model: str = MODEL) -> List[Mapping]:
    """Pre-attention norm, fused QKV (+ bias), per-head q/k norms, output projection."""
    H = layer_prefix(model)
    q, k, v = (H + f"self_attn.{p}_proj" for p in "qkv")
    table = [
        Replicated(L + "input_layernorm.weight", H + "input_layernorm.weight"),
        QKV(L + "self_attention.linear_qkv.weight", q + ".weight", k + ".weight", v + ".weight"),
    ]
    if qkv_bias:
        table.append(QKV(L + "self_attention.linear_qkv.bias", q + ".bias", k + ".bias", v + ".bias"))
    if qk_norm:
        table += [Replicated(L + "self_attention.q_layernorm.weight", H + "self_attn.q_norm.weight"),
                  Replicated(L + "self_attention.k_layernorm.weight", H + "self_attn.k_norm.weight")]
    table.append(RowParallel(L + "self_attention.linear_proj.weight", H + "self_attn.o_proj.weight"))
    return table


def dense_mlp(model: str = MODEL) -> List[Mapping]:
    H = layer_prefix(model)
    return [
        Replicated(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
        GateUp(L + "mlp.linear_fc1.weight", H + "mlp.gate_proj.weight", H + "mlp.up_proj.weight"),
        RowParallel(L + "mlp.linear_fc2.weight", H + "mlp.down_proj.weight"),
    ]


def moe_mlp(model: str = MODEL) -> List[Mapping]:
    """Router plus routed experts, stored per expert in the HF (hub) format vLLM loads."""
    H = layer_prefix(model)
    expert, hf_expert = L + "mlp.experts.local_experts.{expert}.", H + "mlp.experts.{expert}."
    return [
        Replicated(L + "pre_mlp_layernorm.weight", H + "post_attention_layernorm.weight"),
        Replicated(L + "mlp.router.weight", H + "mlp.gate.weight"),
        GateUp(expert + "linear_fc1.weight", hf_expert + "gate_proj.weight",
               hf_expert + "up_proj.weight"),
        RowParallel(expert + "linear_fc2.weight", hf_expert + "down_proj.weight"),
    ]


def vision(hf: dict, prefix: str) -> List[Mapping]:
    """One replicated mapping per parameter of the transformers vision tower (held unchanged as
    `visual` in the Megatron model; names read off a meta-device build), stored under `prefix`
    in the checkpoint."""
    with torch.device("meta"):
        names = [name for name, _ in vision_tower(hf).named_parameters()]
    return [Replicated(f"{VISUAL}.{name}", prefix + name) for name in names]
