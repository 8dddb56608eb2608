"""Qwen2.5-VL config reading (M-RoPE sections, q/k/v bias, both transformers config styles) and
ms-swift's freezing of the vision tower, aligner and language model (model/vision.py)."""
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
