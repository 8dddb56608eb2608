"""Export flags: HF <-> Megatron conversion, LoRA merge, precision check."""
from dataclasses import dataclass
from typing import Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError



@dataclass
class ExportArguments:
    """Export"""

    to_mcore: bool = arg(False, "Convert the HF --model into a Megatron model directory (loaded "
                         "in the layout of the parallel flags; any layout can load it later).")
    to_hf: bool = arg(False, "Convert --mcore_model (or --mcore_adapter) into an HF checkpoint.")
    mcore_model: Optional[str] = arg(None, "Megatron model directory to convert (written by "
                                     "--to_mcore true or by a training run).")
    mcore_adapter: Optional[str] = arg(None, "A LoRA training checkpoint (a --save iteration "
                                       "directory): with --merge_lora true --to_hf true, written "
                                       "as a merged HF checkpoint.")
    merge_lora: bool = arg(False, "Merge LoRA adapters into the base weights: --adapters PEFT_DIR "
                           "onto --model, or the adapters of --mcore_adapter.")
    test_convert_precision: bool = arg(False, "Run transformers and Megatron in float32 on the "
                                       "same random tokens, print the max/mean absolute logit "
                                       "difference and argmax agreement, and fail past "
                                       "--test_convert_precision_atol. Checks --model alone, or "
                                       "what --to_mcore / --to_hf wrote.")
    test_convert_precision_atol: float = arg(1e-4, "Largest accepted absolute logit difference.")
    output_dir: Optional[str] = arg(None, "Where the converted checkpoint is written.")
    exist_ok: bool = arg(False, "Replace an existing non-empty --output_dir.")
    max_shard_size: str = arg("5GB", "Largest safetensors shard of an exported HF checkpoint.")

    def __post_init__(self):
        if self.test_convert_precision_atol <= 0:
            raise UserError("--test_convert_precision_atol must be > 0")
