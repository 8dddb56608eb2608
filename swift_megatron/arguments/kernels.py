"""Kernel and packing flags of ms-swift's Megatron mode. They select Transformer Engine fusions
and attention backends, which swift-megatron does not use (attention is torch's
scaled_dot_product_attention, which picks the flash / memory-efficient kernel itself; logprobs
come from our vocab-parallel log-softmax), so they are accepted and have no effect: a run that
sets one says so once (arguments/parser.py `notices`)."""
from dataclasses import dataclass

from swift_megatron.arguments.fields import arg

_TE_FUSION = "a Transformer Engine fusion; swift-megatron does not use Transformer Engine"


@dataclass
class KernelArguments:
    """Kernels and packing (ms-swift names)"""

    attention_backend: str = arg("flash", "Transformer Engine attention backend.",
                                 no_effect="attention runs through torch's "
                                           "scaled_dot_product_attention, which picks the flash or "
                                           "memory-efficient kernel itself")
    padding_free: bool = arg(True, "Pack the micro-batch's sequences without padding.",
                             no_effect="sequences are right-padded per micro-batch (packing: "
                                       "issue 10)")
    gradient_accumulation_fusion: bool = arg(True, "Fused weight-gradient accumulation.",
                                             no_effect=_TE_FUSION)
    cross_entropy_loss_fusion: bool = arg(True, "Fused cross entropy.",
                                          no_effect="logprobs come from our own vocab-parallel "
                                                    "log-softmax")
    moe_permute_fusion: bool = arg(False, "Fused MoE token permutation.", no_effect=_TE_FUSION)
