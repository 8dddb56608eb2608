"""Model flags: which checkpoint to train and in which precision, on which device."""
from dataclasses import dataclass
from typing import Optional

from swift_megatron.arguments.fields import arg, refuse_empty
from swift_megatron.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5",
                         "qwen3_5_moe", "qwen2_5_vl", "qwen3_vl")
# ms-swift's own model_type names of the families above (its --model_type is not the HF one).
MS_SWIFT_MODEL_TYPES = {"qwen2_5": "qwen2", "qwen2_5_math": "qwen2", "qwen2_5_coder": "qwen2",
                        "qwq": "qwen2", "qwen3_thinking": "qwen3", "qwen3_nothinking": "qwen3",
                        "qwen3_moe_thinking": "qwen3_moe", "llama2": "llama", "llama3": "llama",
                        "llama3_1": "llama", "llama3_2": "llama", "llama3_3": "llama"}


@dataclass
class ModelArguments:
    """Model"""

    model: Optional[str] = arg(None, "Local Hugging Face model directory, or a hub id (ModelScope "
                               "by default, Hugging Face with --use_hf true).")
    model_type: Optional[str] = arg(None, "Override the model family read from config.json "
                                    "(llama, mistral, qwen2, qwen3, qwen3_moe, qwen3_5, "
                                    "qwen3_5_moe, qwen2_5_vl, qwen3_vl; ms-swift's names of "
                                    "these, e.g. qwen2_5 or llama3_1, are accepted).")
    torch_dtype: Optional[str] = arg(None, "Training precision. Default: the checkpoint's dtype "
                                     "on CUDA, float32 on CPU.",
                                     choices=["bfloat16", "float16", "float32"])
    bf16: Optional[bool] = arg(None, "true: --torch_dtype bfloat16 (ms-swift / Megatron-LM name).")
    fp16: Optional[bool] = arg(None, "true: --torch_dtype float16 (ms-swift / Megatron-LM name).")
    use_hf: bool = arg(False, "Download hub ids from Hugging Face instead of ModelScope.")
    model_revision: Optional[str] = arg(None, "Hub revision (branch, tag or commit) of --model.")
    attn_impl: Optional[str] = arg(
        None, "transformers' attention implementation for the models transformers runs here: "
        "--reward_model models and the embedded transformers rollout engine (runs without "
        "vLLM). flash_attn means flash_attention_2 (as ms-swift). The Megatron model's attention "
        "is --attention_backend. Default: transformers' choice (sdpa).",
        choices=["sdpa", "eager", "flash_attn", "flash_attention_2", "flash_attention_3"])
    check_model: bool = arg(True, "Before loading, check that a local --model directory is "
                            "complete: config.json readable, every weight shard of the index "
                            "present with a readable safetensors header.")
    freeze_llm: bool = arg(False, "Vision-language models, full training: freeze the language "
                           "model (as ms-swift).")
    freeze_vit: bool = arg(True, "Vision-language models, full training: freeze the vision "
                           "tower, its merger excepted (as ms-swift).")
    freeze_aligner: bool = arg(True, "Vision-language models, full training: freeze the "
                               "aligner, the vision tower's merger (as ms-swift).")
    device: str = arg("auto", "Where to run: auto (CUDA when available, else CPU), cuda or cpu. "
                      "CPU runs Megatron-core through swift_megatron.platform.cpu (dev, CI, demo).",
                      choices=["auto", "cuda", "cpu"])

    def __post_init__(self):
        refuse_empty(self, ("model",))
        if self.model_type in MS_SWIFT_MODEL_TYPES:
            self.model_type = MS_SWIFT_MODEL_TYPES[self.model_type]
        if self.model_type is not None and self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UserError(f"--model_type {self.model_type} is not supported; supported: "
                            f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        self._resolve_precision_flags()

    @property
    def attn_implementation(self) -> Optional[str]:
        """--attn_impl as transformers names it (ms-swift's flash_attn: flash_attention_2)."""
        return "flash_attention_2" if self.attn_impl == "flash_attn" else self.attn_impl

    def _resolve_precision_flags(self) -> None:
        """--bf16 / --fp16 true set --torch_dtype; contradictions are errors."""
        if self.bf16 and self.fp16:
            raise UserError("--bf16 true and --fp16 true contradict each other; pass one")
        wanted = "bfloat16" if self.bf16 else "float16" if self.fp16 else None
        if wanted is None:
            return
        if self.torch_dtype not in (None, wanted):
            flag = "--bf16" if self.bf16 else "--fp16"
            raise UserError(f"{flag} true contradicts --torch_dtype {self.torch_dtype}; pass one")
        self.torch_dtype = wanted
