"""LoRA flags: adapter shape, targets, and adapters to load."""
from dataclasses import dataclass
from typing import List

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError


@dataclass
class LoraArguments:
    """LoRA"""

    lora_rank: int = arg(8, "Adapter rank r.")
    lora_alpha: int = arg(32, "Adapter scale numerator: scale = lora_alpha / r "
                          "(or / sqrt(r) with --use_rslora).")
    lora_dropout: float = arg(0.05, "Dropout on the adapter input.")
    target_modules: List[str] = arg(["all-linear"], "HF module names to adapt (q_proj, k_proj, "
                                    "v_proj, o_proj, gate_proj, up_proj, down_proj; Qwen3.5's "
                                    "in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj) or "
                                    "all-linear.")
    use_rslora: bool = arg(False, "Rank-stabilised LoRA scaling.")
    adapters: List[str] = arg([], "A LoRA adapter to load: a PEFT adapter directory, or a LoRA "
                              "checkpoint (ours or ms-swift's); continue training it "
                              "(--train_type lora), or merge it (`megatron export --merge_lora "
                              "true`).")

    def __post_init__(self):
        if len(self.adapters) > 1:
            raise UserError(f"--adapters takes one adapter directory, got {len(self.adapters)}")
        if self.lora_rank < 1:
            raise UserError(f"--lora_rank must be >= 1, got {self.lora_rank}")
        if self.lora_alpha <= 0:
            raise UserError(f"--lora_alpha must be > 0 (the adapters' scale is lora_alpha / "
                            f"lora_rank), got {self.lora_alpha}")
        if not 0 <= self.lora_dropout < 1:
            raise UserError(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
