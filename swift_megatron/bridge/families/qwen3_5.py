"""Qwen3.5 (dense, and MoE through `qwen3_5_moe`): the text stack of the hybrid model.

Linear-attention layers are megatron-core's GatedDeltaNet: HF's in_proj_qkv ([q; k; v]),
in_proj_z, in_proj_b and in_proj_a form one column-parallel `in_proj` holding, per TP rank, its
chunk of q, k, v, z, b and a; the depthwise conv1d holds its chunk of q, k and v; A_log and
dt_bias split by value head; the gated output norm is replicated. Full-attention layers fuse
HF's per-head [q; gate] q_proj with k and v per query group (GatedQKV). Every decoder norm is
zero-centred in both HF and Megatron (ZeroCenteredRMSNorm), so norms map unchanged.

A Qwen3_5ForConditionalGeneration config (with `vision_config`) adds the vision tower, held
unchanged by the Megatron model as `visual` (model/vision.py): every vision tensor maps one to
one, replicated over TP.

Checkpoints: transformers saves the text stack under `model.language_model.` and the tower
under `model.visual.`, from Qwen3_5ForConditionalGeneration and from a text-only
Qwen3_5ForCausalLM alike (model_type `qwen3_5_text`, no tower); exports use these prefixes.
Checkpoints with the text stack under `model.` (other tools' text-only saves) or the tower
under `visual.` load too (LOAD_ALIASES).
The multi-token-prediction head (`mtp.`) is not part of the Megatron model: `PASSTHROUGH`
names it so that writing an HF checkpoint copies it from the source checkpoint unchanged.
"""
from typing import List

from swift_megatron.bridge.families.common import (L, attention, dense_mlp, embeddings,
                                                   layer_prefix, vision)
from swift_megatron.bridge.mapping import (ColumnParallel, GatedQKV, Mapping, Replicated,
                                           RowParallel, Segmented)

from swift_megatron.model.vision import has_vision

PASSTHROUGH = ("mtp.",)
DECODER = "model.language_model."
VISION = "model.visual."
LOAD_ALIASES = ((DECODER, "model."), (VISION, "visual."))


def gated_attention(model: str) -> List[Mapping]:
    """Full-attention layers: GatedQKV, zero-centred q/k norms, output projection."""
    H = layer_prefix(model)
    table = attention(qk_norm=True, model=model)
    qkv = next(i for i, m in enumerate(table) if m.mcore.endswith("linear_qkv.weight"))
    table[qkv] = GatedQKV(L + "self_attention.linear_qkv.weight",
                          *(H + f"self_attn.{p}_proj.weight" for p in "qkv"))
    return table


def gated_delta_net(model: str) -> List[Mapping]:
    """Linear-attention layers (mcore GatedDeltaNet <- HF linear_attn)."""
    H, M = layer_prefix(model) + "linear_attn.", L + "self_attention."
    in_proj = [(0, "linear_qk_dim"), (0, "linear_qk_dim"), (0, "linear_v_dim"),
               (1, "linear_v_dim"), (2, "linear_v_heads"), (3, "linear_v_heads")]
    return [
        Segmented(M + "in_proj.weight", H + "in_proj_qkv.weight", H + "in_proj_z.weight",
                  H + "in_proj_b.weight", H + "in_proj_a.weight", segments=in_proj),
        Segmented(M + "conv1d.weight", H + "conv1d.weight", segments=in_proj[:3]),
        ColumnParallel(M + "dt_bias", H + "dt_bias"),
        ColumnParallel(M + "A_log", H + "A_log"),
        Replicated(M + "out_norm.weight", H + "norm.weight"),
        RowParallel(M + "out_proj.weight", H + "out_proj.weight"),
    ]


def mixers(hf: dict) -> List[Mapping]:
    """Embeddings plus both kinds of token mixer (each matches only its own layers' names)."""
    tied = bool(hf.get("tie_word_embeddings", False))
    return embeddings(tied, DECODER) + gated_attention(DECODER) + gated_delta_net(DECODER)


def tower(hf: dict) -> List[Mapping]:
    """The vision tower's tensors, when the config has one."""
    return vision(hf, VISION) if has_vision(hf) else []


def mappings(hf: dict) -> List[Mapping]:
    return mixers(hf) + dense_mlp(DECODER) + tower(hf)
