"""`megatron rlhf` GRPO on the tiny Qwen2.5-VL on CPU with text-only prompts and the embedded
engine: the engine (transformers' whole vision-language model) samples from exactly the
trainer's policy after weight sync, the step updates the language model, and the default
--freeze_vit/--freeze_aligner keep every vision tensor of the export bit for bit; an unfrozen
tower trains without breaking text-only steps; LoRA adapts the language model only. With
images (the colour task of fixtures/dataset.py): the engine's and the trainer's logprobs agree
(padded and packed micro-batches), rewards get the row's `solution`, and a bad image row exits
with status 2 naming the row."""
import json

import pytest
import torch

from swift_megatron.fixtures import build_colour_dataset
from tests.e2e.test_rlhf_e2e import PLUGIN, logged, rlhf
from tests.helpers import safetensors_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tiny_model_dir, math_dataset_path):
    return ["--model", tiny_model_dir("qwen2_5_vl"), "--dataset", math_dataset_path,
            "--external_plugins", PLUGIN, "--reward_funcs", "digit_ratio", "contains_answer",
            "--num_generations", "4", "--global_batch_size", "16", "--micro_batch_size", "4",
            "--max_completion_length", "16", "--report_to", "none", "--logging_steps", "1",
            "--add_version", "false", "--train_iters", "2", "--check_weight_sync", "true"]


def test_text_grpo_trains_the_language_model_only(base, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    rlhf(*base, "--beta", "0.1", "--lr", "1e-3", "--output_dir", out)
    rows = logged(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)  # fp32: engine == trainer
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0 and rows[0]["grad_norm"] > 0
    source, exported = safetensors_of(tiny_model_dir("qwen2_5_vl")), safetensors_of(out / "final_hf")
    assert sorted(exported) == sorted(source)
    vision = [n for n in source if n.startswith("visual.")]
    assert vision and all(torch.equal(exported[n], source[n]) for n in vision)
    assert any(not torch.equal(exported[n], source[n]) for n in source if ".self_attn." in n)


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    return build_colour_dataset(str(tmp_path_factory.mktemp("colours") / "colours.jsonl"), 32)


@pytest.mark.parametrize("padding_free", ["false", "true"])
def test_image_grpo_engine_and_trainer_see_the_same_pixels(base, tiny_model_dir, colours,
                                                           tmp_path, padding_free):
    """The colour task (images, no <image> tags, `solution` for the reward): every step's
    weight-sync check compares the engine's logprobs of sampled completions of image prompts
    with the trainer's (same pixels, 3-D positions), after syncs that skip the frozen tower."""
    out = tmp_path / "img"
    rlhf(*base, "--dataset", colours, "--reward_funcs", "colour_parity",
         "--padding_free", padding_free, "--beta", "0.1", "--lr", "1e-3",
         "--max_completion_length", "4", "--output_dir", out)
    rows = logged(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)
    assert all(0.0 < r["reward/mean"] < 1.0 for r in rows)   # the solution column reached it
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 0
    source, exported = safetensors_of(tiny_model_dir("qwen2_5_vl")), safetensors_of(out / "final_hf")
    assert all(torch.equal(exported[n], source[n]) for n in source if n.startswith("visual."))


def test_the_policy_learns_what_only_the_image_shows(base, tiny_model_dir, tmp_path):
    """GRPO learns the colour task (fill=True: the image is all red or all blue;
    colour_parity rewards an even first token for red, odd for blue) from 0.5 to > 0.85 with the
    tower and aligner unfrozen: a model blind to the image cannot beat the majority colour's
    share (< 0.6 here), so the pixels reach both the engine's sampling and the trainer's
    gradient. Every sync sends the changed tower (the check samples from it after each step)."""
    data = build_colour_dataset(str(tmp_path / "solid" / "colours.jsonl"), 64, fill=True)
    colours = [json.loads(line)["solution"] for line in open(data)]
    blind = max(colours.count("red"), colours.count("blue")) / len(colours)
    out = tmp_path / "learn"
    rlhf(*base, "--dataset", data, "--reward_funcs", "colour_parity", "--freeze_vit", "false",
         "--freeze_aligner", "false", "--beta", "0", "--lr", "2e-2", "--lr_warmup_iters", "0",
         "--num_generations", "16", "--global_batch_size", "128", "--micro_batch_size", "8",
         "--max_completion_length", "1", "--train_iters", "16", "--output_dir", out)
    rows = logged(out)
    rewards = [r["reward/mean"] for r in rows]
    print(f"blind ceiling {blind:.3f}; reward per step {[round(r, 3) for r in rewards]}")
    assert blind < 0.6 and rewards[0] < 0.7
    assert sum(rewards[-3:]) / 3 > 0.85
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)
    source, exported = safetensors_of(tiny_model_dir("qwen2_5_vl")), safetensors_of(out / "final_hf")
    changed = {n for n in source if not torch.equal(exported[n], source[n])}
    assert any(n.startswith("visual.merger.") for n in changed)
    assert any(n.startswith("visual.blocks.") for n in changed)


def test_a_bad_image_row_exits_2_naming_the_row(base, colours, tmp_path):
    data = tmp_path / "bad.jsonl"
    good = open(colours).readline()
    data.write_text(good + json.dumps({"messages": [{"role": "user", "content": "Colour?"}],
                                       "images": [str(tmp_path / "missing.png")]}) + "\n")
    proc = rlhf(*base, "--dataset", data, "--output_dir", tmp_path / "o", check=False)
    output = proc.stderr + proc.stdout
    assert proc.returncode == 2 and "row 2: image" in output and "does not exist" in output
    assert "Traceback" not in output


def test_unfrozen_vision_tower_trains_on_text_without_changing(base, tiny_model_dir, tmp_path):
    """--freeze_vit false --freeze_aligner false with text-only batches: the step runs, the
    tower's gradient is zero, so (without weight decay, which would shrink it) it is exported
    unchanged."""
    out = tmp_path / "unfrozen"
    rlhf(*base, "--freeze_vit", "false", "--freeze_aligner", "false", "--beta", "0",
         "--lr", "1e-3", "--weight_decay", "0", "--train_iters", "1", "--output_dir", out)
    source, exported = safetensors_of(tiny_model_dir("qwen2_5_vl")), safetensors_of(out / "final_hf")
    assert all(torch.equal(exported[n], source[n]) for n in source if n.startswith("visual."))
    assert logged(out)[0]["grad_norm"] > 0


def test_lora_adapts_the_language_model_only(base, tiny_model_dir, tmp_path):
    out = tmp_path / "lora"
    rlhf(*base, "--train_type", "lora", "--lora_rank", "4", "--lora_alpha", "8", "--beta", "0",
         "--lr", "5e-3", "--lora_dropout", "0", "--train_iters", "1", "--output_dir", out)
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in logged(out))
    source, merged = safetensors_of(tiny_model_dir("qwen2_5_vl")), safetensors_of(out / "final_hf")
    changed = {k for k in source if not torch.equal(source[k], merged[k])}
    assert changed and not any(k.startswith("visual.") for k in changed)


def test_lora_llm_adapts_the_language_model_and_trains_the_vision_side(base, tiny_model_dir,
                                                                       colours, tmp_path):
    """--tuner_type lora_llm (ms-swift's name and meaning) with images: LoRA on the language
    model, the vision tower and merger trained in full (at --vit_lr / --aligner_lr) and sent
    with every sync (the check after step 2 samples from the updated tower); beta > 0 gets a
    frozen reference (disabling the adapters would leave the trained tower); the HF copies are
    merged models only (an adapter alone would lack the tower); --load resumes the run, and
    --mcore_model refuses its checkpoint."""
    from swift_megatron.checkpoint.sources import mcore_source
    from swift_megatron.errors import UserError

    out = tmp_path / "lora_llm"
    flags = [*base, "--dataset", colours, "--reward_funcs", "colour_parity", "--tuner_type",
             "lora_llm", "--lora_rank", "4", "--lora_alpha", "8", "--lora_dropout", "0", "--lr",
             "5e-3", "--vit_lr", "1e-2", "--aligner_lr", "1e-2", "--beta", "0.1",
             "--max_completion_length", "4"]
    rlhf(*flags, "--output_dir", out)
    rows = logged(out)
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0
    source, merged = safetensors_of(tiny_model_dir("qwen2_5_vl")), safetensors_of(out / "final_hf")
    changed = {n for n in source if not torch.equal(merged[n], source[n])}
    for prefix in ("visual.merger.", "visual.blocks.", "model.layers.0.self_attn."):
        assert any(n.startswith(prefix) for n in changed), prefix
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")) == \
        ["checkpoint-2-merged"]
    assert not (out / "final_adapter").exists()
    with pytest.raises(UserError, match="is a --train_type lora_llm checkpoint, which only --load"):
        mcore_source(str(out))   # its state dict holds adapters: not a plain model
    resumed = tmp_path / "lora_llm_resumed"   # --load: adapters and the trained tower come back
    rlhf(*flags, "--load", out, "--train_iters", "3", "--output_dir", resumed)
    assert [r["step"] for r in logged(resumed)] == [3]
    assert logged(resumed)[0]["sync/logprob_abs_diff_mean"] < 1e-5
