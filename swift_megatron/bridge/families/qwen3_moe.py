"""Qwen3-MoE: Qwen3 attention (q/k norm) and, in every layer, a softmax top-k router over
routed experts (no shared expert). Experts are stored per expert in the hub format."""
from swift_megatron.bridge.families.common import attention, embeddings, moe_mlp


def mappings(hf: dict):
    return (embeddings(bool(hf.get("tie_word_embeddings", False)))
            + attention(qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
            + moe_mlp())
