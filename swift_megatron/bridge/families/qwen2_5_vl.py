"""Qwen2.5-VL: the qwen2 text stack (q/k/v biases) plus transformers' vision tower and merger,
which the Megatron model holds unchanged as `visual` (model/vision.py): every vision tensor
maps one to one, replicated over TP.

Checkpoints: exports use the hub layout that transformers 5.x `save_pretrained` writes and vLLM
loads (`model.layers.*`, `model.embed_tokens`, `model.norm`, `lm_head`, `visual.*`); checkpoints
holding the in-memory layout (`model.language_model.*`, `model.visual.*`) load too
(LOAD_ALIASES).
"""
from typing import List

from swift_megatron.bridge.families.common import attention, dense_mlp, embeddings, vision
from swift_megatron.bridge.mapping import Mapping

LOAD_ALIASES = (("model.", "model.language_model."), ("visual.", "model.visual."))


def mappings(hf: dict) -> List[Mapping]:
    return (embeddings(bool(hf.get("tie_word_embeddings", False))) + attention(qkv_bias=True)
            + dense_mlp() + vision(hf, "visual."))
