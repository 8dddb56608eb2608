"""LoRA flags: adapter shape, targets, modules trained in full beside the adapters, and adapters
to load."""
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.arguments.freeze import check_regex
from swift_megatron.errors import UserError

# the modules --modules_to_save may train in full (Megatron module paths), and the names that
# select them: ms-swift's Megatron names, the Hugging Face ones, and ms-swift's all-embedding
EMBEDDING, OUTPUT_LAYER = "embedding.word_embeddings", "output_layer"
_SAVED_NAMES = {"word_embeddings": EMBEDDING, "embed_tokens": EMBEDDING, "all-embedding": EMBEDDING,
                "output_layer": OUTPUT_LAYER, "lm_head": OUTPUT_LAYER}


def saved_module(name: str) -> str:
    """The Megatron module a --modules_to_save name (or a PEFT modules_to_save entry) selects, by
    its last component: word_embeddings / embed_tokens / all-embedding -> the word embedding,
    output_layer / lm_head -> the output layer. UserError for anything else."""
    module = _SAVED_NAMES.get(name.rsplit(".", 1)[-1])
    if module is None:
        raise UserError(f"modules_to_save {name!r}: only the word embedding (word_embeddings, "
                        "embed_tokens or all-embedding) and the output layer (output_layer or "
                        "lm_head) can train in full beside the adapters")
    return module


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
    target_regex: Optional[str] = arg(None, "Adapt the linears whose whole name this "
                                      "regular expression matches (re.fullmatch, as peft): the HF "
                                      "module name (model.layers.3.self_attn.q_proj) or the "
                                      "Megatron one (decoder.layers.3.self_attention.linear_qkv: "
                                      "all the projections it holds); --target_modules is then "
                                      "ignored (as ms-swift).")
    modules_to_save: List[str] = arg([], "Modules trained in full beside the adapters, saved in "
                                     "the adapter as peft's modules_to_save: word_embeddings (or "
                                     "embed_tokens, all-embedding) and output_layer (or lm_head).")
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
        check_regex(self.target_regex, "--target_regex")
        for name in self.modules_to_save:
            saved_module(name)
