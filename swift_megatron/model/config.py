"""Hugging Face config -> megatron-core TransformerConfig and GPTModel arguments.

Read from the model directory alone: no hand-written model config. Supported families and what
distinguishes them (everything else is shared: RMSNorm, SwiGLU, RoPE, GQA, tied or untied
embeddings):

  llama / mistral  optional attention bias; llama3 rope scaling (factor, low/high freq)
  qwen2            q/k/v bias
  qwen3            q/k RMSNorm per head
  qwen3_moe        q/k norm, routed experts (top-k softmax router, norm_topk_prob); the MoE
                   flags (arguments/moe.py: load balancing, aux and z losses, router dtype,
                   token dropping) arrive as overrides (components.py; dense models reject
                   them)
  qwen3_5          hybrid: `layer_types` mixes Gated DeltaNet linear attention (mcore
                   GatedDeltaNet, `linear_*` sizes) and full attention with an output gate,
                   partial rotary (`partial_rotary_factor`) and zero-centred q/k norms; every
                   decoder norm is zero-centred ("1 + w"). The text stack of a
                   Qwen3_5ForConditionalGeneration config (`text_config`) or a text-only save;
                   with a `vision_config`, M-RoPE with interleaved sections (`mrope_section`,
                   transformers' default [11, 11, 10]) and the vision tower (model/vision.py)
  qwen3_5_moe      qwen3_5 with routed experts in every layer (softmax, top-k, always
                   renormalised) plus one shared expert scaled by a sigmoid gate
  qwen2_5_vl       the qwen2 text stack with M-RoPE (contiguous `mrope_section`); the vision
                   tower is transformers' module (model/vision.py)
  qwen3_vl         the qwen3 text stack (`text_config`) with M-RoPE in interleaved sections
                   (transformers' default [24, 20, 20]); the vision tower with deepstack
                   (model/vision.py)

`text_config` flattens a multimodal config to its text stack (the top-level
`tie_word_embeddings` decides tying, as transformers does); every reader of the HF config's
sizes goes through it. Both transformers 4.x config styles (`rope_theta`, `rope_scaling`) and 5.x (`rope_parameters`)
are read. Unsupported model types or features fail with a message listing what is supported.
"""
import dataclasses
import json
import os
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from swift_megatron.arguments.model import SUPPORTED_MODEL_TYPES
from swift_megatron.errors import UserError
from swift_megatron.model.layout import num_experts
from swift_megatron.model.text_config import HYBRID_TYPES, MOE_TYPES, text_config
from swift_megatron.model.vision import DEFAULT_MROPE_SECTION, VISION_TYPES

SUPPORTED = SUPPORTED_MODEL_TYPES
QK_NORM_TYPES = ("qwen3", "qwen3_moe", "qwen3_vl") + HYBRID_TYPES   # per-head q/k RMSNorm
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the model builder needs besides TransformerConfig (one per HF checkpoint)."""

    model_type: str
    vocab_size: int              # the tokenizer's logits, before TP padding
    padded_vocab_size: int       # divisible by TP; padded rows are masked out of every softmax
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: Optional[Dict[str, Any]]  # llama3 parameters, or None
    qk_layernorm: bool
    num_experts: Optional[int]
    torch_dtype: str             # the checkpoint's dtype name
    # hybrid models (qwen3_5*): "linear_attention" / "full_attention" per layer; None: all full
    layer_types: Optional[Tuple[str, ...]] = None
    rotary_percent: float = 1.0  # share of each head's dims that RoPE rotates
    zero_centered_norms: bool = False  # decoder and q/k RMSNorms compute rms(x) * (1 + w)

    @property
    def is_hybrid(self) -> bool:
        return self.layer_types is not None


def load_hf_config(model_dir: str) -> Dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{model_dir}: no config.json (is this a Hugging Face model directory?)")
    with open(path) as f:
        return json.load(f)


def rope_parameters(hf: Mapping) -> Dict[str, Any]:
    """Normalise 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) rope configs to
    one dict with `rope_type` and `rope_theta` (plus the llama3 scaling keys when present)."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return params


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_REQUIRED_MOE = ("num_experts_per_tok", "moe_intermediate_size")


_REQUIRED_HYBRID = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads")


def _required(model_type: str) -> Tuple[str, ...]:
    required = _REQUIRED
    if model_type in MOE_TYPES:
        required += _REQUIRED_MOE
    if model_type == "qwen3_5_moe":  # no dense MLP anywhere: no intermediate_size
        required = tuple(k for k in required if k != "intermediate_size")
    if model_type in HYBRID_TYPES:
        required += _REQUIRED_HYBRID
    return required


def _check_hybrid(hf: Mapping) -> None:
    kinds = set(hf["layer_types"])
    if len(hf["layer_types"]) != hf["num_hidden_layers"] or \
            not kinds <= {"linear_attention", "full_attention"}:
        raise UserError(f"config.json layer_types {hf['layer_types']} must list "
                        f"num_hidden_layers={hf['num_hidden_layers']} entries, each "
                        "linear_attention or full_attention")


def _check_supported(hf: Mapping, model_type: str) -> None:
    if model_type not in SUPPORTED:
        raise UserError(f"model_type '{model_type}' is not supported; supported: "
                        f"{', '.join(SUPPORTED)}")
    required = _required(model_type)
    missing = [key for key in required if hf.get(key) is None]
    if missing:
        raise UserError(f"config.json lacks {', '.join(missing)} (needed for a {model_type} "
                        f"model); is the checkpoint complete?")
    rope = rope_parameters(hf)
    if model_type == "qwen2_5_vl":
        if not rope.get("mrope_section"):
            raise UserError("qwen2_5_vl config.json lacks rope mrope_section")
        rope["rope_type"] = "default"   # 4.x checkpoints say "mrope"
    if rope["rope_type"] not in ("default", "llama3"):
        raise UserError(f"rope type '{rope['rope_type']}' is not supported (default, llama3)")
    if hf.get("sliding_window") and hf.get("use_sliding_window", model_type == "mistral"):
        raise UserError("sliding-window attention is not supported; use a checkpoint without "
                        "sliding_window")
    if hf.get("hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act '{hf.get('hidden_act')}' is not supported (silu)")
    if model_type == "qwen3_moe" and hf.get("mlp_only_layers"):
        raise UserError("qwen3_moe with dense mlp_only_layers is not supported")
    if model_type == "qwen3_moe" and hf.get("decoder_sparse_step", 1) != 1:
        raise UserError("qwen3_moe with decoder_sparse_step != 1 is not supported")
    if model_type in HYBRID_TYPES:
        _check_hybrid(hf)


def _rotary_percent(hf: Mapping, rope: Mapping) -> float:
    return float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))


def model_shape(hf: Mapping, tp: int = 1, model_type: Optional[str] = None) -> ModelShape:
    hf = text_config(hf)
    model_type = model_type or hf.get("model_type")
    _check_supported(hf, model_type)
    rope = rope_parameters(hf)
    vocab = hf["vocab_size"]
    experts = num_experts(hf) if model_type in MOE_TYPES else None
    hybrid = model_type in HYBRID_TYPES
    return ModelShape(
        model_type=model_type, vocab_size=vocab, padded_vocab_size=-(-vocab // tp) * tp,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope if rope["rope_type"] == "llama3" else None,
        qk_layernorm=model_type in QK_NORM_TYPES, num_experts=experts,
        torch_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "float32"),
        layer_types=tuple(hf["layer_types"]) if hybrid else None,
        rotary_percent=_rotary_percent(hf, rope), zero_centered_norms=hybrid)


def _qkv_bias(hf: Mapping, model_type: str) -> bool:
    if model_type in ("qwen2", "qwen2_5_vl"):
        return True
    return bool(hf.get("attention_bias", False))


def _moe_kwargs(hf: Mapping, model_type: str, ep: int, etp: int) -> Dict[str, Any]:
    kwargs = dict(
        num_moe_experts=num_experts(hf), moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        # HF softmaxes over all experts, takes the top-k and renormalises when norm_topk_prob:
        # the same as mcore's softmax over the top-k logits (pre_softmax=False).
        moe_router_pre_softmax=not hf.get("norm_topk_prob", True),
        moe_router_score_function="softmax", moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=True,
        moe_permute_fusion=False, moe_router_fusion=False,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    if model_type == "qwen3_5_moe":  # always renormalised top-k; a sigmoid-gated shared expert
        kwargs.update(moe_router_pre_softmax=False,
                      moe_shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
                      moe_shared_expert_gate=True)
    return kwargs


def _hybrid_kwargs(hf: Mapping) -> Dict[str, Any]:
    """Gated DeltaNet sizes and the full-attention layers' output gate (qwen3_5*); layers of
    two kinds are saved per layer in distributed checkpoints (as megatron's own hybrid does)."""
    return dict(attention_output_gate=True, hetereogenous_dist_checkpoint=True,
                linear_conv_kernel_dim=hf["linear_conv_kernel_dim"],
                linear_key_head_dim=hf["linear_key_head_dim"],
                linear_value_head_dim=hf["linear_value_head_dim"],
                linear_num_key_heads=hf["linear_num_key_heads"],
                linear_num_value_heads=hf["linear_num_value_heads"])


def transformer_config(hf: Mapping, *, dtype: torch.dtype, tp: int = 1, pp: int = 1,
                       ep: int = 1, etp: int = 1, cp: int = 1, vpp: int = 1,
                       sequence_parallel: bool = False,
                       use_cpu_initialization: bool = False,
                       model_type: Optional[str] = None, **overrides) -> TransformerConfig:
    """The TransformerConfig of an HF checkpoint for a given parallel layout and dtype."""
    hf = text_config(hf)
    model_type = model_type or hf.get("model_type")
    _check_supported(hf, model_type)
    heads = hf["num_attention_heads"]
    kwargs = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf.get("intermediate_size") or hf["moe_intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=_qkv_bias(hf, model_type),
        qk_layernorm=model_type in QK_NORM_TYPES,
        hidden_dropout=0.0, attention_dropout=float(hf.get("attention_dropout", 0.0)),
        init_method_std=hf.get("initializer_range", 0.02),
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp, sequence_parallel=sequence_parallel, variable_seq_lengths=True,
        use_cpu_initialization=use_cpu_initialization,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False, attention_softmax_in_fp32=True,
        deallocate_pipeline_outputs=True,
        # mcore rejects variable_seq_lengths with its default allgather dispatcher, dense or not.
        moe_token_dispatcher_type="alltoall", cuda_graph_scope=[])
    if vpp > 1:
        # The interleaved schedule sends activations forward and gradients backward in one
        # call. At PP = 2 both go to the same peer, and a batched send/recv (batch_p2p_comm,
        # and the shape handshake of variable_seq_lengths, always batched) pairs the two
        # directions' messages by order, so they cross (observed on gloo: wrong activations,
        # or a deadlock). Individual send/recv keep the directions on separate groups, and
        # the trainer gives the schedule micro-batches of one shape (rlhf/grpo/batch.py,
        # `length`), so no handshake is needed.
        kwargs.update(virtual_pipeline_model_parallel_size=vpp, variable_seq_lengths=False,
                      batch_p2p_comm=False)
    if model_type in MOE_TYPES:
        kwargs.update(_moe_kwargs(hf, model_type, ep, etp))
    if model_type in HYBRID_TYPES:
        kwargs.update(_hybrid_kwargs(hf))
    if model_type in VISION_TYPES:   # M-RoPE, used when a vision tower is built (model/vision.py)
        kwargs.update(mrope_section=list(rope_parameters(hf).get("mrope_section")
                                         or DEFAULT_MROPE_SECTION[model_type]))
    _check_moe_overrides(overrides, model_type)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def _check_moe_overrides(overrides: Mapping, model_type: str) -> None:
    """Token dropping only exists in MoE layers: asking it of a dense model is a mistake."""
    if overrides.get("moe_expert_capacity_factor") is not None and model_type not in MOE_TYPES:
        raise UserError(f"--moe_expert_capacity_factor applies to MoE models; this {model_type} "
                        "model has no experts (drop the flag)")
