"""Qwen3.5's config reading (pure, no model): the nested text_config flattened with the top-level
tying, the text-only save's type, the hybrid layer kinds and partial rotary in ModelShape, the
TransformerConfig fields of the gated attention, Gated DeltaNet and shared expert, the layout
check of the Gated DeltaNet heads, and the refusal of ms-swift's Megatron checkpoints. The
vision side: which configs get a vision tower, the M-RoPE sections, the interleaved M-RoPE
against transformers' (megatron-core's contiguous one as the control), and which exported
tower tensors a weight sync leaves out when frozen."""
import pytest
import torch

from swift_megatron.checkpoint.ms_swift_lora import refuse_hybrid
from swift_megatron.errors import UserError
from swift_megatron.model.config import model_shape, transformer_config
from swift_megatron.model.layout import check_layout, num_experts
from swift_megatron.model.text_config import text_config

TEXT = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, max_position_embeddings=512, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                             "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                             "mrope_interleaved": True}, model_type="qwen3_5_text")
MOE = dict(TEXT, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=48)
del MOE["intermediate_size"]


def nested(text, model_type="qwen3_5", tie=True):
    return {"model_type": model_type, "tie_word_embeddings": tie, "text_config": text,
            "vision_config": {"depth": 1}, "dtype": "bfloat16"}


def test_nested_config_flattens_with_the_top_level_tying_and_type():
    flat = text_config(nested(TEXT, tie=True))
    assert flat["model_type"] == "qwen3_5" and flat["tie_word_embeddings"] is True
    assert flat["hidden_size"] == 64 and flat["dtype"] == "bfloat16"
    assert text_config(TEXT)["model_type"] == "qwen3_5"  # a text-only save's qwen3_5_text
    assert text_config({"model_type": "qwen3", "hidden_size": 8}) == {"model_type": "qwen3",
                                                                      "hidden_size": 8}


def test_shape_holds_layer_kinds_partial_rotary_and_zero_centred_norms():
    shape = model_shape(nested(TEXT))
    assert shape.model_type == "qwen3_5" and shape.is_hybrid and shape.zero_centered_norms
    assert shape.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert shape.rotary_percent == 0.25 and shape.rope_theta == 1e7
    assert shape.tie_word_embeddings and shape.qk_layernorm and shape.num_experts is None
    assert not model_shape({**TEXT, "model_type": "qwen3"}).is_hybrid


def test_transformer_config_of_dense_and_moe():
    dense = transformer_config(nested(TEXT), dtype=torch.float32)
    assert dense.attention_output_gate and dense.qk_layernorm
    assert (dense.linear_num_key_heads, dense.linear_num_value_heads,
            dense.linear_key_head_dim, dense.linear_conv_kernel_dim) == (2, 4, 16, 4)
    assert dense.hetereogenous_dist_checkpoint  # linear and full layers differ
    moe = transformer_config(nested(MOE, "qwen3_5_moe"), dtype=torch.float32)
    assert (moe.num_moe_experts, moe.moe_router_topk, moe.moe_ffn_hidden_size) == (8, 2, 32)
    assert moe.moe_shared_expert_intermediate_size == 48 and moe.moe_shared_expert_gate
    assert moe.moe_router_pre_softmax is False  # top-k always renormalised
    assert num_experts(nested(MOE, "qwen3_5_moe")) == 8


def test_bad_layer_types_are_user_errors():
    with pytest.raises(UserError, match="layer_types"):
        model_shape(nested(dict(TEXT, layer_types=["linear_attention"] * 3)))
    with pytest.raises(UserError, match="lacks linear_num_value_heads"):
        model_shape(nested({k: v for k, v in TEXT.items() if k != "linear_num_value_heads"}))


def test_layout_check_covers_the_gated_deltanet_heads():
    check_layout(nested(TEXT), tp=2, pp=2)
    with pytest.raises(UserError, match="linear_num_key_heads=2"):
        check_layout(nested(dict(TEXT, num_attention_heads=8, num_key_value_heads=4)), tp=4, pp=1)


def test_ms_swift_megatron_checkpoints_of_qwen3_5_are_refused():
    with pytest.raises(UserError, match="ms-swift Megatron checkpoints of qwen3_5"):
        refuse_hybrid(nested(TEXT), "/ckpt")
    refuse_hybrid({"model_type": "qwen3"}, "/ckpt")


def test_only_configs_with_a_vision_config_get_the_tower_and_mrope_sections():
    from swift_megatron.model.vision import has_vision

    assert has_vision(nested(TEXT)) and has_vision(nested(MOE, "qwen3_5_moe"))
    assert not has_vision(TEXT) and not has_vision({**TEXT, "model_type": "qwen3_5"})
    assert transformer_config(nested(TEXT), dtype=torch.float32).mrope_section == [11, 11, 10]
    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                       "partial_rotary_factor": 0.25})
    # transformers' default sections when the checkpoint names none
    assert transformer_config(nested(text), dtype=torch.float32).mrope_section == [11, 11, 10]


@pytest.mark.parametrize("head_dim, section", [(32, [2, 1, 1]), (256, [11, 11, 10])])
def test_interleaved_mrope_matches_transformers(monkeypatch, head_dim, section):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import \
        MultimodalRotaryEmbedding
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    from swift_megatron.model.vision import InterleavedMRoPE

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
            "mrope_section": section, "mrope_interleaved": True}
    hf = Qwen3_5TextRotaryEmbedding(Qwen3_5TextConfig(head_dim=head_dim, rope_parameters=rope))
    positions = torch.randint(0, 500, (3, 2, 40), generator=torch.Generator().manual_seed(0))
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions)   # [b, s, rotary dims]

    def angles(cls, ids=positions):
        emb = cls(kv_channels=head_dim, rotary_percent=0.25, rotary_base=1e7)(ids, section)
        return emb.squeeze(2).transpose(0, 1)   # [s, b, 1, d] -> [b, s, d]

    ours = angles(InterleavedMRoPE)
    assert ours.shape == cos.shape
    assert torch.allclose(ours.cos(), cos, atol=1e-6) and torch.allclose(ours.sin(), sin, atol=1e-6)
    assert (angles(MultimodalRotaryEmbedding).cos() - cos).abs().max() > 0.1   # contiguous
    text = positions[:1].expand(3, -1, -1)   # equal axes (text): both are plain RoPE
    assert torch.equal(angles(InterleavedMRoPE, text), angles(MultimodalRotaryEmbedding, text))


@pytest.mark.parametrize("name, part", [
    ("model.visual.blocks.0.attn.qkv.weight", "vit"), ("model.visual.merger.linear_fc1.weight",
                                                       "aligner"),
    ("visual.merger.norm.weight", "aligner"), ("model.language_model.layers.0.mlp.up_proj.weight",
                                               "llm")])
def test_exported_tower_names_are_parts_of_the_vision_side(name, part):
    from swift_megatron.model.vision import vision_part

    assert vision_part(name) == part
