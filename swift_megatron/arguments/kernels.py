"""Kernel and packing flags of ms-swift's Megatron mode. `--padding_free` packs a micro-batch's
sequences back to back (THD) and `--attention_backend` picks the attention kernel of packed
batches (model/spec.py); `--moe_grouped_gemm` and `--moe_token_dispatcher_type` choose how MoE
layers run their experts (model/grouped_experts.py) and move their tokens
(model/moe_dispatch.py). The fusion flags select Transformer Engine or megatron-core kernels that
swift-megatron's layer spec does not use, so they are accepted and have no effect: a dry run names
the ones it was given (arguments/parser.py `notices`)."""
from dataclasses import dataclass
from typing import Optional

from swift_megatron.arguments.fields import arg

_TE_FUSION = "a Transformer Engine fusion; swift-megatron does not use Transformer Engine"
_SDPA = ("attention runs in torch's scaled_dot_product_attention or flash-attention kernels, "
         "not megatron-core's unfused softmax")
_NO_BIAS = ("the supported models' output projections have no bias and no hidden dropout: "
            "there is nothing to fuse")


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
    masked_softmax_fusion: bool = arg(True, "megatron-core's fused masked softmax.",
                                      no_effect=_SDPA)
    bias_dropout_fusion: bool = arg(True, "megatron-core's fused bias + dropout + add.",
                                    no_effect=_NO_BIAS)
    bias_activation_fusion: bool = arg(True, "megatron-core's fused bias + activation.",
                                       no_effect="the MLP's SwiGLU is swift-megatron's own "
                                                 "kernel (compiled on CUDA)")
    apply_rope_fusion: bool = arg(False, "megatron-core's fused rotary embedding.",
                                  no_effect=_TE_FUSION)
    cross_entropy_fusion_impl: str = arg("native", "Implementation of the fused cross entropy.",
                                         choices=["native", "te"],
                                         no_effect="logprobs come from our own vocab-parallel "
                                                   "log-softmax")
    attention_softmax_in_fp32: bool = arg(True, "Attention softmax in float32.",
                                          no_effect="scaled_dot_product_attention and "
                                                    "flash-attention compute the softmax in "
                                                    "float32 always")
    apply_query_key_layer_scaling: Optional[bool] = arg(
        None, "Scale Q.K by the layer number (an fp16 overflow guard of the unfused softmax).",
        no_effect=_SDPA)
