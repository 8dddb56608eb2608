"""Qwen2.5-VL config reading (M-RoPE sections, q/k/v bias, both transformers config styles) and
ms-swift's freezing of the vision tower, aligner and language model (model/vision.py), and
weight syncs without the frozen vision parts (rlhf/grpo/components.py `sync_filter`)."""
import pytest
import torch

from swift_megatron.errors import UserError
from swift_megatron.fixtures import tiny_hf_config
from swift_megatron.model.config import model_shape, transformer_config
from swift_megatron.model.vision import freeze, mrope_positions


def test_nested_config_gives_mrope_sections_and_qkv_bias():
    hf = tiny_hf_config("qwen2_5_vl").to_dict()
    config = transformer_config(hf, dtype=torch.float32)
    assert config.mrope_section == [2, 3, 3] and config.add_qkv_bias
    assert (config.num_layers, config.hidden_size, config.kv_channels) == (4, 64, 16)
    assert model_shape(hf).model_type == "qwen2_5_vl" and model_shape(hf).vocab_size == 508


def test_flat_4x_config_with_mrope_rope_type():
    hf = dict(tiny_hf_config("qwen2_5_vl").to_dict()["text_config"], model_type="qwen2_5_vl",
              rope_parameters=None, rope_theta=1e6,
              rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]})
    config = transformer_config(hf, dtype=torch.float32)
    assert config.mrope_section == [16, 24, 24]
    assert model_shape(hf).rope_theta == 1e6


def test_missing_mrope_section_is_refused():
    hf = tiny_hf_config("qwen2_5_vl").to_dict()
    hf["text_config"]["rope_parameters"].pop("mrope_section")
    with pytest.raises(UserError, match="mrope_section"):
        transformer_config(hf, dtype=torch.float32)


def test_text_positions_are_broadcast_to_three_axes():
    positions = torch.arange(6).view(2, 3)
    assert mrope_positions(positions).shape == (3, 2, 3)
    assert torch.equal(mrope_positions(positions)[2], positions)
    three = torch.zeros(3, 2, 3, dtype=torch.long)
    assert mrope_positions(three) is three


def _toy():
    model = torch.nn.Module()
    model.visual = torch.nn.Module()
    model.visual.blocks = torch.nn.Linear(2, 2)
    model.visual.merger = torch.nn.Linear(2, 2)
    model.decoder = torch.nn.Linear(2, 2)
    return model


@pytest.mark.parametrize("llm,vit,aligner", [(False, True, True), (True, False, True),
                                             (True, True, False), (False, False, False)])
def test_freeze_as_ms_swift(llm, vit, aligner):
    model = _toy()
    freeze(model, freeze_llm=llm, freeze_vit=vit, freeze_aligner=aligner)
    trainable = {n.split(".")[-2] for n, p in model.named_parameters() if p.requires_grad}
    expected = {name for name, frozen in (("decoder", llm), ("blocks", vit), ("merger", aligner))
                if not frozen}
    assert trainable == expected


@pytest.mark.parametrize("vit,aligner,train_type,sleep_level,sent", [
    (True, True, "full", 0, {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}),
    (False, True, "full", 0, {"model.layers.0.mlp.up_proj.weight", "lm_head.weight",
                              "visual.blocks.0.attn.qkv.weight"}),
    (False, False, "full", 0, None), (True, True, "full", 2, None),
    (False, False, "lora", 0, {"model.layers.0.mlp.up_proj.weight", "lm_head.weight"}),
    (True, True, "lora_llm", 0, None)])   # lora_llm trains the whole vision side
def test_weight_syncs_skip_the_frozen_vision_parts(vit, aligner, train_type, sleep_level, sent):
    """After the first sync only trained tensors go to the engine; all of them when nothing is
    frozen or when colocated vLLM discards its weights (--sleep_level 2)."""
    from types import SimpleNamespace

    from swift_megatron.rlhf.grpo.components import sync_filter

    args = SimpleNamespace(model=SimpleNamespace(freeze_vit=vit, freeze_aligner=aligner),
                           training=SimpleNamespace(train_type=train_type),
                           rollout=SimpleNamespace(sleep_level=sleep_level))
    policy = SimpleNamespace(hf_config={"model_type": "qwen2_5_vl"})
    keep = sync_filter(args, policy)
    names = {"model.layers.0.mlp.up_proj.weight", "lm_head.weight",
             "visual.blocks.0.attn.qkv.weight", "visual.merger.mlp.0.weight"}
    assert (keep is None) if sent is None else ({n for n in names if keep(n)} == sent)
    assert sync_filter(args, SimpleNamespace(hf_config={"model_type": "qwen2"})) is None
