"""Kernel and packing flags of ms-swift's Megatron mode. `--padding_free` packs a micro-batch's
sequences back to back (THD) and `--attention_backend` picks the attention kernel of packed
batches (model/spec.py); `--moe_grouped_gemm` and `--moe_token_dispatcher_type` choose how MoE
layers run their experts (model/grouped_experts.py) and move their tokens
(model/moe_dispatch.py). The fusion flags select Transformer Engine kernels, which
swift-megatron does not use, so they are accepted and have no effect: a run that sets one says
so once (arguments/parser.py `notices`)."""
from dataclasses import dataclass

from swift_megatron.arguments.fields import arg

_TE_FUSION = "a Transformer Engine fusion; swift-megatron does not use Transformer Engine"


@dataclass
class KernelArguments:
    """Kernels and packing (ms-swift names)"""

    attention_backend: str = arg("flash", "Attention kernel of packed micro-batches: flash or "
                                 "auto use torch's flash-attention varlen kernel on CUDA; fused, "
                                 "unfused and local run scaled_dot_product_attention one "
                                 "sequence at a time (what CPUs always do). Padded micro-batches "
                                 "use scaled_dot_product_attention, which picks its own kernel.",
                                 choices=["flash", "fused", "unfused", "local", "auto"])
    padding_free: bool = arg(True, "Pack each micro-batch's sequences back to back without "
                             "padding (megatron's THD format): no compute on padding tokens. "
                             "false: right-pad them to the longest.")
    gradient_accumulation_fusion: bool = arg(True, "Fused weight-gradient accumulation.",
                                             no_effect=_TE_FUSION)
    cross_entropy_loss_fusion: bool = arg(True, "Fused cross entropy.",
                                          no_effect="logprobs come from our own vocab-parallel "
                                                    "log-softmax")
    moe_permute_fusion: bool = arg(False, "Fused MoE token permutation.", no_effect=_TE_FUSION)
    moe_grouped_gemm: bool = arg(True, "MoE: each layer's local experts as one grouped GEMM per "
                                 "projection (torch's grouped matrix multiply) instead of two "
                                 "GEMMs per expert launched one by one (false: megatron-core's "
                                 "SequentialMLP). LoRA on the experts' projections runs them "
                                 "one by one either way.")
    moe_token_dispatcher_type: str = arg(
        "alltoall", "MoE token dispatcher: alltoall (the tokens permuted on the device, "
        "all-to-all between expert-parallel ranks). allgather without expert parallelism, "
        "where both move the same tokens (all of them over expert-TP) and alltoall's code "
        "runs; with EP megatron-core's allgather dispatcher needs micro-batches of one length "
        "on every rank and is refused.", choices=["allgather", "alltoall", "flex"],
        not_yet={"flex": "the flex dispatcher runs DeepEP's or HybridEP's kernels, which are "
                         "not installed with swift-megatron: use alltoall (the default)"})
