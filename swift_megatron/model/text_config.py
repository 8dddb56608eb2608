"""The text stack's view of a Hugging Face config (pure; no torch).

A multimodal checkpoint (Qwen3_5ForConditionalGeneration) nests the language model's sizes
under `text_config`; a text-only save of the same model says model_type `qwen3_5_text`.
`text_config` gives every reader of sizes (model config, layout checks, memory estimate, dry
run) one flat dict with the family's name.
"""
from typing import Any, Dict, Mapping

HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe")   # Gated DeltaNet + full attention
MOE_TYPES = ("qwen3_moe", "qwen3_5_moe")
_TEXT_ONLY_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def text_config(hf: Mapping) -> Dict[str, Any]:
    """A multimodal config's `text_config` with the top-level model_type and
    tie_word_embeddings (which decide, as in transformers' ConditionalGeneration classes) and
    dtype; a text-only save's `qwen3_5_text` type read as `qwen3_5`. Flat configs come back as
    they are (a copy)."""
    flat = dict(hf)
    if isinstance(hf.get("text_config"), Mapping):
        flat = dict(hf["text_config"])
        flat["model_type"] = hf.get("model_type", flat.get("model_type"))
        flat["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))
        for key in ("torch_dtype", "dtype"):
            if hf.get(key) is not None:
                flat.setdefault(key, hf[key])
    flat["model_type"] = _TEXT_ONLY_TYPES.get(flat.get("model_type"), flat.get("model_type"))
    return flat
