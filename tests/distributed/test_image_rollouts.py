"""GRPO's image path on the tiny Qwen2.5-VL, Qwen3-VL (interleaved M-RoPE, deepstack) and
Qwen3.5 (with its vision tower; Gated DeltaNet hybrid, interleaved M-RoPE), all in each launch
(workers/image_rollout_checks.py): prompts built from colour-task rows (images loaded, tags
added and expanded), completions sampled by the embedded engine with each prompt's pixels (an
image-less prompt in the same batch), and the trainer's logprobs of those tokens through the
micro-batch path (pixels, grids, 3-D positions; padded and packed; PP=1 and PP=2 with the
vision tower on stage 0) equal the engine's in float32; with the two images' pixels swapped
they do not (the image rows change, the text row does not); a completion that samples the
image token id trains as a plain token (it used to stop the step)."""
import json

import pytest

from swift_megatron.fixtures import build_colour_dataset, build_tiny_model
from tests.distributed.launch import run_workers
from tests.distributed.test_vision_models import QWEN3_5

ATOL = 1e-5
FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    """([model dir of each family], colour dataset)."""
    root = tmp_path_factory.mktemp("image_rollouts")
    return ([build_tiny_model("qwen2_5_vl", str(root / "qwen2_5_vl")),
             build_tiny_model("qwen3_vl", str(root / "qwen3_vl")),
             build_tiny_model("qwen3_5", str(root / "qwen3_5"), images=True, **QWEN3_5)],
            build_colour_dataset(str(root / "colours.jsonl"), num_rows=8))


def check(results):
    assert sorted(results) == sorted(FAMILIES)
    for family, result in results.items():
        print(family, json.dumps(result))
        check_one(result)


def check_one(result):
    assert min(result["completion_lengths"]) > 0
    for layout in ("padded", "packed"):
        got = result[layout]
        assert got["max_abs_diff"] <= ATOL, layout
        assert got["control_swapped_pixels"] > 1e-3, layout
        assert got["text_row_swapped"] == 0.0, layout
        assert got["image_token_in_completion"] <= ATOL, layout


def test_engine_and_trainer_logprobs_agree_with_images(vl, tmp_path):
    check(run_workers("image_rollout_checks.py", 1, tmp_path,
                      ["--hf_dir", *vl[0], "--dataset", vl[1]])[0])


@pytest.mark.slow
def test_pp2_engine_and_trainer_logprobs_agree_with_images(vl, tmp_path):
    results = run_workers("image_rollout_checks.py", 2, tmp_path,
                          ["--hf_dir", *vl[0], "--dataset", vl[1], "--pp", 2])
    check(results[1])   # the last stage holds the logprobs
