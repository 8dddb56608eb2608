"""Qwen2.5-VL on Megatron against transformers, with images in the input
(workers/vision_checks.py, on the tiny qwen2_5_vl fixture: real two-block vision tower).

- The bridge loads every tensor (language model and vision tower) and exports it bit for bit,
  from the hub layout (model.layers.*, visual.*) and from transformers' in-memory layout
  (model.language_model.*, model.visual.*).
- float32 logits with one image per sequence, through the trainer's micro-batch path
  (pixel_values, image_grid_thw and 3-D positions in the micro-batch), match transformers at
  TP=1, at TP=2 with sequence parallelism (images merged before the sequence is scattered) and
  at PP=2 (vision tower on the first stage, 3-D positions on both); controls show the
  comparison is sensitive to the M-RoPE positions and to the pixels.
"""
import json

import pytest
from safetensors.torch import load_file, save_file

from swift_megatron.fixtures import build_tiny_model
from tests.distributed.launch import run_workers

ATOL = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny checkpoint, and a copy with transformers' in-memory tensor names."""
    import shutil

    root = tmp_path_factory.mktemp("qwen2_5_vl")
    hub = build_tiny_model("qwen2_5_vl", str(root / "hub"))
    alias = str(root / "in_memory")
    shutil.copytree(hub, alias)
    tensors = load_file(f"{hub}/model.safetensors")
    renamed = {("model." + k if k.startswith("visual.") else
                k.replace("model.", "model.language_model.", 1)): v for k, v in tensors.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    save_file(renamed, f"{alias}/model.safetensors", metadata={"format": "pt"})
    return hub, alias


def check(result):
    print(json.dumps(result["logits"]))
    export = result["export"]
    assert export["mismatched"] == [] and export["missing"] == [] and export["duplicates"] == 0
    assert export["exported"] == 81    # 2 decoder layers x 12 + 3 + 54 vision tensors
    logits = result["logits"]
    assert logits["max_abs_diff"] <= ATOL and logits["argmax_agreement"] == 1.0
    assert logits["control_1d_positions"] > 100 * ATOL
    assert logits["control_other_pixels"] > 100 * ATOL


def test_tp1_matches_transformers_and_loads_both_layouts(checkpoints, tmp_path):
    hub, alias = checkpoints
    result = run_workers("vision_checks.py", 1, tmp_path,
                         ["--hf_dir", hub, "--alias_dir", alias])[0]
    check(result)
    alias_export = result["alias_export"]
    assert alias_export["mismatched"] == [] and alias_export["missing"] == []


@pytest.mark.slow
def test_tp2_sequence_parallel_matches_transformers(checkpoints, tmp_path):
    results = run_workers("vision_checks.py", 2, tmp_path,
                          ["--hf_dir", checkpoints[0], "--tp", 2, "--sp"])
    for result in results:
        check(result)


@pytest.mark.slow
def test_pp2_matches_transformers(checkpoints, tmp_path):
    results = run_workers("vision_checks.py", 2, tmp_path,
                          ["--hf_dir", checkpoints[0], "--pp", 2])
    for result in results:
        check(result)
