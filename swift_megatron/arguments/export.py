"""Export flags: HF <-> Megatron conversion, LoRA merge, precision check."""
from dataclasses import dataclass
from typing import Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

_BRIDGE_LATER = "conversion lands with the bridge issue"
_LORA_LATER = "LoRA merge lands with the LoRA issue"


@dataclass
class ExportArguments:
    """Export"""

    to_mcore: bool = arg(False, "Convert the HF --model into a Megatron checkpoint.",
                         not_yet=_BRIDGE_LATER)
    to_hf: bool = arg(False, "Convert --mcore_model (or --mcore_adapter) into an HF checkpoint.",
                      not_yet=_BRIDGE_LATER)
    mcore_model: Optional[str] = arg(None, "Megatron checkpoint directory to convert.")
    mcore_adapter: Optional[str] = arg(None, "Megatron LoRA checkpoint directory to convert/merge.",
                                       not_yet=_LORA_LATER)
    merge_lora: bool = arg(False, "Merge adapters into the base weights.", not_yet=_LORA_LATER)
    test_convert_precision: bool = arg(False, "Run HF and Megatron in float32 on the same inputs, "
                                       "print the logit differences, and fail past "
                                       "--test_convert_precision_atol.", not_yet=_BRIDGE_LATER)
    test_convert_precision_atol: float = arg(1e-4, "Largest accepted absolute logit difference.")
    output_dir: Optional[str] = arg(None, "Where the converted checkpoint is written.")
    exist_ok: bool = arg(False, "Allow writing into an existing --output_dir.")
    max_shard_size: str = arg("5GB", "Largest safetensors shard of an exported HF checkpoint.")

    def __post_init__(self):
        if self.test_convert_precision_atol <= 0:
            raise UserError("--test_convert_precision_atol must be > 0")
