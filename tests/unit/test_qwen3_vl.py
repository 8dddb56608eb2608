"""Qwen3-VL config reading (interleaved M-RoPE sections, q/k norms), its aligner (merger and
deepstack mergers, as ms-swift), and deepstack under full activation recomputation: the
recomputed layers get the deepstack features again (model/vision.py), so gradients equal those
without recomputation."""
import pytest
import torch

from swift_megatron.fixtures import build_tiny_model, tiny_hf_config
from swift_megatron.model.config import model_shape, transformer_config
from swift_megatron.model.vision import (deepstack_indexes, has_vision, takes_images,
                                         vision_part)


def test_nested_config_gives_interleaved_sections_and_qk_norms():
    hf = tiny_hf_config("qwen3_vl").to_dict()
    config = transformer_config(hf, dtype=torch.float32)
    assert config.mrope_section == [4, 2, 2] and config.qk_layernorm
    assert not config.add_qkv_bias and (config.num_layers, config.kv_channels) == (4, 16)
    assert model_shape(hf).model_type == "qwen3_vl" and not model_shape(hf).tie_word_embeddings
    assert has_vision(hf) and takes_images("/nowhere", hf)
    assert deepstack_indexes(hf) == [0, 1]


def test_missing_mrope_section_takes_transformers_default():
    hf = tiny_hf_config("qwen3_vl", head_dim=128).to_dict()
    hf["text_config"]["rope_parameters"].pop("mrope_section")
    assert transformer_config(hf, dtype=torch.float32).mrope_section == [24, 20, 20]


def test_hub_4x_config_style():
    """transformers 4.57's save (the hub checkpoints): rope_scaling + rope_theta in text_config,
    tying at the top level."""
    text = dict(tiny_hf_config("qwen3_vl").to_dict()["text_config"], rope_parameters=None,
                rope_theta=5e6, rope_scaling={"rope_type": "default", "mrope_interleaved": True,
                                              "mrope_section": [4, 2, 2]})
    hf = dict(tiny_hf_config("qwen3_vl").to_dict(), text_config=text, tie_word_embeddings=True)
    assert transformer_config(hf, dtype=torch.float32).mrope_section == [4, 2, 2]
    shape = model_shape(hf)
    assert shape.rope_theta == 5e6 and shape.tie_word_embeddings and shape.qk_layernorm


def test_deepstack_layers_off_the_first_stage_are_refused():
    """Deepstack into layers 1..3 with only 2 layers on the first stage (PP=2 of 4): refused
    by the layout check (before launching) and by the model where it registers its hooks."""
    from types import SimpleNamespace

    from swift_megatron.errors import UserError
    from swift_megatron.model.vision import VisionGPTModel
    from swift_megatron.model.layout import check_layout

    hf = tiny_hf_config("qwen3_vl", vision_config=dict(depth=3, deepstack_visual_indexes=[0, 1, 2]))
    check_layout(hf.to_dict(), tp=1, pp=1)
    with pytest.raises(UserError, match=r"decoder layers 1..3.*holds 2 of 4"):
        check_layout(hf.to_dict(), tp=1, pp=2)
    with pytest.raises(UserError, match=r"decoder layers 1..2.*holds 1 of 4"):
        check_layout(tiny_hf_config("qwen3_vl").to_dict(), tp=1, pp=2, vpp=2)

    stage = SimpleNamespace(decoder=SimpleNamespace(
        layers=[SimpleNamespace(layer_number=n) for n in (1, 2)]))
    with pytest.raises(UserError, match="deepstack features go into decoder layers 1..3"):
        VisionGPTModel._hook_deepstack(stage, 3)


def test_deepstack_mergers_are_the_aligner():
    assert vision_part("visual.deepstack_merger_list.0.linear_fc1.weight") == "aligner"
    assert vision_part("model.visual.deepstack_merger_list.1.norm.bias") == "aligner"
    assert vision_part("model.visual.merger.norm.bias") == "aligner"
    assert vision_part("model.visual.blocks.0.attn.qkv.weight") == "vit"
    assert vision_part("model.language_model.layers.0.mlp.up_proj.weight") == "llm"


@pytest.fixture
def cpu_state():
    from swift_megatron.parallel.state import ParallelState

    yield ParallelState.initialize(device="cpu", seed=0)
    ParallelState.destroy()


def _grads(model, batch, recompute: bool):
    config = model.config
    config.recompute_granularity, config.recompute_method, config.recompute_num_layers = \
        ("full", "uniform", 1) if recompute else (None, None, None)
    model.zero_grad(set_to_none=True)
    model(batch["ids"], batch["positions"], None, pixel_values=batch["pixels"],
          image_grid_thw=batch["grid"]).square().sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_deepstack_under_full_recompute_gives_the_same_gradients(cpu_state, tmp_path):
    from swift_megatron.checkpoint.loaded_model import load_mcore_model
    from swift_megatron.model.config import load_hf_config
    from tests.distributed.workers.vision_checks import inputs

    hf_dir = build_tiny_model("qwen3_vl", str(tmp_path / "qwen3_vl"))
    hf_config = load_hf_config(hf_dir)
    loaded = load_mcore_model(hf_config, "qwen3_vl", torch.float32, cpu_state, hf_dir=hf_dir)
    model = loaded.model.train()
    ids, pixels, grid, _ = inputs(hf_config)
    from swift_megatron.data.images import mrope_position_ids

    positions = mrope_position_ids(hf_config, ids, hf_config["image_token_id"], grid)
    batch = dict(ids=ids, positions=positions, pixels=pixels, grid=grid)
    plain, recomputed = _grads(model, batch, False), _grads(model, batch, True)
    assert plain.keys() == recomputed.keys()
    deepstack = [n for n in plain if "deepstack_merger_list" in n]
    assert len(deepstack) == 12 and all(plain[n].abs().max() > 0 for n in deepstack)
    worst = max(float((plain[n] - recomputed[n]).abs().max()) for n in plain)
    assert worst <= 1e-6


@pytest.mark.parametrize("vit,aligner,sent", [
    (True, True, {"model.language_model.layers.0.mlp.up_proj.weight"}),
    (True, False, {"model.language_model.layers.0.mlp.up_proj.weight",
                   "model.visual.merger.linear_fc1.weight",
                   "model.visual.deepstack_merger_list.0.linear_fc1.weight"}),
    (False, True, {"model.language_model.layers.0.mlp.up_proj.weight",
                   "model.visual.blocks.0.attn.qkv.weight"})])
def test_weight_syncs_leave_out_frozen_deepstack_mergers(vit, aligner, sent):
    """Later syncs send the deepstack mergers exactly when the aligner trains."""
    from types import SimpleNamespace

    from swift_megatron.rlhf.grpo.components import sync_filter

    args = SimpleNamespace(model=SimpleNamespace(freeze_vit=vit, freeze_aligner=aligner),
                           training=SimpleNamespace(train_type="full"),
                           rollout=SimpleNamespace(sleep_level=0))
    keep = sync_filter(args, SimpleNamespace(hf_config={"model_type": "qwen3_vl"}))
    names = {"model.language_model.layers.0.mlp.up_proj.weight",
             "model.visual.blocks.0.attn.qkv.weight", "model.visual.merger.linear_fc1.weight",
             "model.visual.deepstack_merger_list.0.linear_fc1.weight"}
    assert {n for n in names if keep(n)} == sent
