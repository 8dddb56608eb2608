"""Vision-language models on Megatron against transformers, with images in the input
(workers/vision_checks.py): the tiny qwen2_5_vl fixture (real two-block vision tower), the tiny
qwen3_vl fixture (qwen3 text stack, interleaved M-RoPE, two-block tower feeding deepstack into
decoder layers 0 and 1) and the tiny qwen3_5 / qwen3_5_moe fixtures
(Qwen3_5ForConditionalGeneration: Gated DeltaNet hybrid text stack with interleaved M-RoPE,
one-block Qwen3_5VisionModel), in one launch per layout.

- The bridge loads every tensor (language model and vision tower) and exports it bit for bit,
  from the layout transformers saves and from the other prefix style (Qwen2.5-VL: hub
  model.layers.* / visual.* and in-memory model.language_model.* / model.visual.*; Qwen3-VL and
  Qwen3.5: model.language_model.* / model.visual.* and model.* / visual.*); Qwen3.5's mtp.* is
  copied through, not mapped.
- float32 logits with one image per sequence, through the trainer's micro-batch path
  (pixel_values, image_grid_thw and 3-D positions in the micro-batch), match transformers at
  TP=1, at TP=2 with sequence parallelism (images merged before the sequence is scattered) and
  at PP=2 (vision tower on the first stage, 3-D positions on both); controls show the
  comparison is sensitive to the M-RoPE positions, to the pixels, (Qwen3-VL, Qwen3.5) to the
  interleaving of the M-RoPE sections and (Qwen3-VL) to the deepstack features (with sequence
  parallelism each rank adds those of its own chunk; at PP=2 both deepstack layers are on the
  first stage).
- The vision tower's gradients (tower, merger, deepstack mergers) of sum(logits^2) equal
  transformers' on every rank of the first stage (relative to the largest gradient); with
  sequence parallelism a rank's deepstack rows cover its own chunk only, so their gradients are
  summed over TP (Qwen3-VL; without that sum: 0.18 and 0.50 on the two ranks).
- With the tower frozen and its outputs cached (model/vision_cache.py), two passes run it once
  (on each rank of the first stage) and give the same logits bit for bit, in every layout.
"""
import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from swift_megatron.fixtures import build_tiny_model
from tests.distributed.launch import run_workers

ATOL = 1e-5
# Qwen3.5 with 8 rotary dims of head_dim 32 (4 frequencies: t, h, w, t) so that every axis
# and the interleaving show in the logits
QWEN3_5 = dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.25,
                                             "mrope_section": [2, 1, 1]})
RENAMES = {  # the other prefix style of each family
    "qwen2_5_vl": (("visual.", "model.visual."), ("model.", "model.language_model.")),
    "qwen3_5": (("model.visual.", "visual."), ("model.language_model.", "model.")),
    "qwen3_vl": (("model.visual.", "visual."), ("model.language_model.", "model.")),
}


def _renamed(name: str, renames) -> str:
    for old, new in renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _with_other_prefixes(hub: str, alias: str, renames) -> None:
    shutil.copytree(hub, alias)
    tensors = load_file(f"{hub}/model.safetensors")
    renamed = {_renamed(k, renames): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, f"{alias}/model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{model_type: (checkpoint, copy in the other prefix style, tensor count)}."""
    root = tmp_path_factory.mktemp("vision_models")
    out = {}
    for family, overrides in (("qwen2_5_vl", {}), ("qwen3_vl", {}), ("qwen3_5", QWEN3_5),
                              ("qwen3_5_moe", QWEN3_5)):
        hub = build_tiny_model(family, str(root / family), images=True, **overrides)
        alias = str(root / f"{family}_alias")
        _with_other_prefixes(hub, alias, RENAMES[family.replace("_moe", "")])
        out[family] = (hub, alias, len(load_file(f"{hub}/model.safetensors")))
    return out


def check(result, total: int, family: str):
    print(family, json.dumps(result["logits"]), "vision grads", result["vision_grad_rel_diff"])
    export = result["export"]
    assert export["mismatched"] == [] and export["missing"] == [] and export["duplicates"] == 0
    assert export["exported"] + export["passthrough"] == total
    assert export["passthrough"] == (2 if family.startswith("qwen3_5") else 0)   # mtp.*
    if family == "qwen2_5_vl":
        assert export["exported"] == 81    # 2 decoder layers x 12 + 3 + 54 vision tensors
    if family == "qwen3_vl":   # 4 layers x 11 + 3 + 45 vision (12 of them deepstack mergers)
        assert export["exported"] == 92
    if result["vision_grad_rel_diff"] is not None:   # the first stage: it holds the tower
        assert result["vision_grad_rel_diff"] <= ATOL
    logits = result["logits"]
    assert logits["max_abs_diff"] <= ATOL and logits["argmax_agreement"] == 1.0
    # a frozen tower's cached outputs (model/vision_cache.py): one run for two passes, the
    # same logits bit for bit
    assert logits["cached_tower"] == 0.0 and result["cached_tower_runs"] in (None, 1)
    assert logits["control_1d_positions"] > 100 * ATOL
    assert logits["control_other_pixels"] > 100 * ATOL
    if family.startswith("qwen3"):
        assert logits["control_contiguous_mrope"] > 100 * ATOL
    if family == "qwen3_vl":
        assert logits["control_no_deepstack"] > 100 * ATOL


def launch(checkpoints, families, tmp_path, nproc, *args, aliases=False):
    extra = ["--alias_dir", *(checkpoints[f][1] for f in families)] if aliases else []
    results = run_workers("vision_checks.py", nproc, tmp_path,
                          ["--hf_dir", *(checkpoints[f][0] for f in families), *extra, *args])
    for result in results:
        for family in families:
            check(result[family], checkpoints[family][2], family)
    return results


def test_tp1_matches_transformers_and_loads_both_layouts(checkpoints, tmp_path):
    families = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")
    result = launch(checkpoints, families, tmp_path, 1, aliases=True)[0]
    for family in families:
        alias_export = result[family]["alias_export"]
        assert alias_export["mismatched"] == [] and alias_export["missing"] == []


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_transformers(checkpoints, tmp_path):
    launch(checkpoints, ("qwen2_5_vl", "qwen3_vl", "qwen3_5"), tmp_path, 2, "--tp", 2, "--sp")


@pytest.mark.slow
def test_pp2_matches_transformers(checkpoints, tmp_path):
    launch(checkpoints, ("qwen2_5_vl", "qwen3_vl", "qwen3_5"), tmp_path, 2, "--pp", 2)
