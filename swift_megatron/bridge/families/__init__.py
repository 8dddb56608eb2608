"""One module per HF model_type: the table of Megatron <-> HF weight mappings, and optional
module attributes: PASSTHROUGH, the prefixes of checkpoint tensors outside the Megatron model
that an exported checkpoint copies from its source unchanged; LOAD_ALIASES, (prefix,
alternative) pairs of other names a checkpoint may store the table's tensors under."""
from typing import List, Tuple

from swift_megatron.bridge.families import (llama, qwen2, qwen2_5_vl, qwen3, qwen3_5, qwen3_5_moe,
                                           qwen3_moe, qwen3_vl)
from swift_megatron.bridge.mapping import Mapping
from swift_megatron.errors import UserError

FAMILIES = {"llama": llama, "mistral": llama, "qwen2": qwen2, "qwen3": qwen3,
            "qwen3_moe": qwen3_moe, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe,
            "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl}


def mappings_for(model_type: str, hf_config: dict) -> List[Mapping]:
    if model_type not in FAMILIES:
        raise UserError(f"model_type '{model_type}' has no weight mapping; supported: "
                        f"{', '.join(FAMILIES)}")
    return FAMILIES[model_type].mappings(hf_config)


def passthrough_for(model_type: str) -> Tuple[str, ...]:
    """Name prefixes of the checkpoint tensors an export copies from the source checkpoint."""
    return getattr(FAMILIES.get(model_type), "PASSTHROUGH", ())


def aliases_for(model_type: str) -> Tuple[Tuple[str, str], ...]:
    """(prefix, alternative) pairs the loader also looks under."""
    return getattr(FAMILIES.get(model_type), "LOAD_ALIASES", ())
