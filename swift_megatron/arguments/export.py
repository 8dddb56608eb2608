"""Export flags: HF <-> Megatron conversion, LoRA adapters (merged or not), precision check."""
from dataclasses import dataclass
from typing import Optional

from swift_megatron.arguments.fields import arg, refuse_empty
from swift_megatron.errors import UserError

DTYPE_CHOICES = ["bfloat16", "float16", "float32"]


@dataclass
class ExportArguments:
    """Export"""

    to_mcore: bool = arg(False, "Write a Megatron model directory (loaded in the layout of the "
                         "parallel flags; any layout can load it later) from --model or "
                         "--mcore_model, with --adapters / --mcore_adapter merged or kept.")
    to_hf: bool = arg(False, "Write an HF checkpoint from --mcore_model, or from a base model "
                      "with --adapters / --mcore_adapter merged (or only the adapter in PEFT "
                      "format: --merge_lora false).")
    mcore_model: Optional[str] = arg(None, "A Megatron checkpoint of the full model: our model "
                                     "directory (--to_mcore true, or a --save directory), or an "
                                     "ms-swift Megatron checkpoint (iter_*/ + "
                                     "latest_checkpointed_iteration.txt). Its weights win over "
                                     "--model's.")
    mcore_adapter: Optional[str] = arg(None, "A LoRA checkpoint: ours (a --save iteration "
                                       "directory of a --train_type lora run) or ms-swift's. The "
                                       "base weights come from --mcore_model, --model, or else "
                                       "the checkpoint.")
    merge_lora: Optional[bool] = arg(None, "Merge the adapter into the base weights. Default: "
                                     "true with --to_hf, false with --to_mcore (as ms-swift). "
                                     "Without --to_hf/--to_mcore, --merge_lora true writes "
                                     "--model + --adapters as a merged HF checkpoint.")
    test_convert_precision: bool = arg(False, "Run transformers and Megatron on the same random "
                                       "tokens, print the max/mean absolute logit difference and "
                                       "argmax agreement, and fail past "
                                       "--test_convert_precision_atol. Checks --model alone, or "
                                       "what --to_mcore / --to_hf wrote.")
    test_convert_dtype: str = arg("float32", "dtype both models run in for the precision check.",
                                  choices=DTYPE_CHOICES)
    test_convert_precision_atol: float = arg(1e-4, "Largest accepted absolute logit difference.")
    output_dir: Optional[str] = arg(None, "Where the conversion is written. Default (as "
                                    "ms-swift): <checkpoint>-mcore / <checkpoint>-hf beside the "
                                    "adapter or Megatron checkpoint, else ./<model name>-mcore|hf.")
    exist_ok: bool = arg(False, "Replace an existing non-empty --output_dir.")
    max_shard_size: str = arg("5GB", "Largest safetensors shard of an exported HF checkpoint.")
    dry_run: bool = arg(False, "Check the flags, input paths, model family (from a local "
                        "config.json), layout and world size and the output directory, print "
                        "what the command would read and write, and exit without loading "
                        "weights or downloading anything.")

    def __post_init__(self):
        refuse_empty(self, ("output_dir", "mcore_model", "mcore_adapter"))
        if self.test_convert_precision_atol <= 0:
            raise UserError("--test_convert_precision_atol must be > 0")
