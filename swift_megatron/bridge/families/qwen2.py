"""Qwen2 / Qwen2.5: the Llama layout with biases on q, k and v."""
from swift_megatron.bridge.families.common import attention, dense_mlp, embeddings


def mappings(hf: dict):
    return (embeddings(bool(hf.get("tie_word_embeddings", False))) + attention(qkv_bias=True)
            + dense_mlp())
