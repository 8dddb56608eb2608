"""Model flags: which checkpoint to train and in which precision, on which device."""
from dataclasses import dataclass
from typing import Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError


@dataclass
class ModelArguments:
    """Model"""

    model: Optional[str] = arg(None, "Local Hugging Face model directory, or a hub id (ModelScope "
                               "by default, Hugging Face with --use_hf true).")
    model_type: Optional[str] = arg(None, "Override the model family read from config.json "
                                    "(llama, qwen2, qwen3, qwen3_moe).")
    torch_dtype: Optional[str] = arg(None, "Training precision. Default: the checkpoint's dtype "
                                     "on CUDA, float32 on CPU.",
                                     choices=["bfloat16", "float16", "float32"])
    use_hf: bool = arg(False, "Download hub ids from Hugging Face instead of ModelScope.")
    model_revision: Optional[str] = arg(None, "Hub revision (branch, tag or commit) of --model.")
    device: str = arg("auto", "Where to run: auto (CUDA when available, else CPU), cuda or cpu. "
                      "CPU runs Megatron-core through swift_megatron.platform.cpu (dev, CI, demo).",
                      choices=["auto", "cuda", "cpu"])

    def __post_init__(self):
        if self.model_type is not None and self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"--model_type {self.model_type} is not supported; supported: "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}")


SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
