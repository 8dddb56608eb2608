"""`megatron rlhf` GRPO with images on the tiny Qwen3-VL (qwen3 text stack, interleaved M-RoPE,
deepstack) on CPU with the embedded engine (transformers' whole Qwen3VLForConditionalGeneration),
the colour task, packed micro-batches: with the vision side trained (`--freeze_vit false
--freeze_aligner false`), every sync sends the tower, merger and deepstack mergers, and the
engine's logprobs of sampled completions of image prompts equal the trainer's after every sync
(same pixels, 3-D positions and deepstack features); the export changes all three parts."""
import json

import pytest
import torch

from swift_megatron.fixtures import build_colour_dataset, build_tiny_model
from tests.e2e.test_rlhf_e2e import PLUGIN, logged, rlhf
from tests.helpers import safetensors_of

pytestmark = pytest.mark.slow


def test_image_grpo_trains_the_vision_side_and_engine_matches_trainer(tmp_path):
    model = build_tiny_model("qwen3_vl", str(tmp_path / "model"))
    colours = build_colour_dataset(str(tmp_path / "colours.jsonl"), 32)
    out = tmp_path / "run"
    rlhf("--model", model, "--dataset", colours, "--external_plugins", PLUGIN,
         "--reward_funcs", "colour_parity", "--num_generations", "4",
         "--global_batch_size", "16", "--micro_batch_size", "4", "--max_completion_length", "4",
         "--report_to", "none", "--logging_steps", "1", "--add_version", "false",
         "--train_iters", "2", "--check_weight_sync", "true", "--beta", "0.1", "--lr", "1e-3",
         "--freeze_vit", "false", "--freeze_aligner", "false", "--output_dir", out)
    rows = logged(out)
    print(json.dumps(rows))
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)
    assert all(0.0 < r["reward/mean"] < 1.0 for r in rows)   # the solution column reached it
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 0
    source, exported = safetensors_of(model), safetensors_of(out / "final_hf")
    assert exported.keys() == source.keys()
    changed = {n for n in source if not torch.equal(exported[n], source[n])}
    for part in ("model.visual.blocks.", "model.visual.merger.",
                 "model.visual.deepstack_merger_list.", "model.language_model.layers."):
        assert any(n.startswith(part) for n in changed), part
