"""Which parameters train in full training: ms-swift's freeze and trainable flags (names, meanings
and defaults), applied to the Megatron model by training/freeze.py with the rules of
model/trainable.py."""
import re
from dataclasses import dataclass
from typing import List, Optional

from swift_megatron.arguments.fields import arg
from swift_megatron.errors import UserError

_NAMES = ("Megatron parameter names (embedding.word_embeddings.weight, "
          "decoder.layers.<N>.self_attention.linear_qkv.weight, decoder.final_layernorm.weight, "
          "output_layer.weight, visual.*; <N> the global layer number, the same in every "
          "parallel layout)")


@dataclass
class FreezeArguments:
    """Freezing (full training)"""

    freeze_parameters: List[str] = arg([], "Full training: freeze the parameters whose name "
                                       f"starts with one of these prefixes; {_NAMES}. On a model "
                                       "with tied embeddings embedding.word_embeddings and "
                                       "output_layer name the same matrix.")
    freeze_parameters_regex: Optional[str] = arg(None, "Full training: freeze the parameters "
                                                 "whose name this regular expression matches "
                                                 "(re.search).")
    freeze_parameters_ratio: float = arg(0.0, "Full training: freeze this fraction of the "
                                         "parameters from the bottom up (model order, counted in "
                                         "elements): 1 freezes everything, for "
                                         "--trainable_parameters to choose what trains. Values "
                                         "between 0 and 1 need --pipeline_model_parallel_size 1.")
    trainable_parameters: List[str] = arg([], "Full training: prefixes of parameter names that "
                                          "train although a freeze flag (or --freeze_vit / "
                                          "--freeze_aligner / --freeze_llm) froze them.")
    trainable_parameters_regex: Optional[str] = arg(None, "Full training: parameters whose name "
                                                    "this regular expression matches (re.search) "
                                                    "train although frozen.")

    @property
    def active(self) -> bool:
        """Whether any of the flags asks for something."""
        return bool(self.freeze_parameters or self.freeze_parameters_regex is not None
                    or self.freeze_parameters_ratio or self.trainable_parameters
                    or self.trainable_parameters_regex is not None)

    def __post_init__(self):
        if not 0 <= self.freeze_parameters_ratio <= 1:
            raise UserError(f"--freeze_parameters_ratio must be in [0, 1], got "
                            f"{self.freeze_parameters_ratio}")
        for name in ("freeze_parameters_regex", "trainable_parameters_regex"):
            check_regex(getattr(self, name), f"--{name}")


def check_regex(pattern: Optional[str], flag: str) -> None:
    """UserError naming `flag` when `pattern` is not a valid regular expression."""
    if pattern is None:
        return
    try:
        re.compile(pattern)
    except re.error as e:
        raise UserError(f"{flag} {pattern!r} is not a valid regular expression: {e}") from None
