"""Qwen3-VL (dense): the qwen3 text stack (per-head q/k RMSNorm, no q/k/v bias) plus
transformers' vision tower, merger and deepstack mergers, which the Megatron model holds
unchanged as `visual` (model/vision.py): every vision tensor maps one to one, replicated
over TP.

Checkpoints: the hub checkpoints and transformers' `save_pretrained` hold the text stack under
`model.language_model.` and the tower under `model.visual.`; exports use these prefixes.
Checkpoints with the text stack under `model.` or the tower under `visual.` (Qwen2-VL's older
layout) load too (LOAD_ALIASES).
"""
from typing import List

from swift_megatron.bridge.families.common import attention, dense_mlp, embeddings, vision
from swift_megatron.bridge.mapping import Mapping
from swift_megatron.model.text_config import text_config

DECODER = "model.language_model."
VISION = "model.visual."
LOAD_ALIASES = ((DECODER, "model."), (VISION, "visual."))


def mappings(hf: dict) -> List[Mapping]:
    text = text_config(hf)
    return (embeddings(bool(text.get("tie_word_embeddings", False)), DECODER)
            + attention(qkv_bias=bool(text.get("attention_bias", False)), qk_norm=True,
                        model=DECODER)
            + dense_mlp(DECODER) + vision(hf, VISION))
