"""Qwen3 (dense): the Llama layout with per-head RMSNorm on queries and keys, no q/k/v bias."""
from swift_megatron.bridge.families.common import attention, dense_mlp, embeddings


def mappings(hf: dict):
    return (embeddings(bool(hf.get("tie_word_embeddings", False)))
            + attention(qkv_bias=bool(hf.get("attention_bias", False)), qk_norm=True)
            + dense_mlp())
