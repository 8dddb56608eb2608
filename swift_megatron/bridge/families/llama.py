"""Llama 2 / 3 / 3.x and Mistral (without sliding window): RMSNorm, SwiGLU, RoPE (llama3
scaling is applied to the rotary frequencies in model/build.py), optional attention bias."""
from swift_megatron.bridge.families.common import attention, dense_mlp, embeddings


def mappings(hf: dict):
    return (embeddings(bool(hf.get("tie_word_embeddings", False)))
            + attention(qkv_bias=bool(hf.get("attention_bias", False))) + dense_mlp())
