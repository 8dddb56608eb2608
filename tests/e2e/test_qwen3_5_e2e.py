"""`megatron rlhf` GRPO on the tiny Qwen3.5 (hybrid Gated DeltaNet) model on CPU with the embedded
engine, full (dense and MoE; packed micro-batches, the default) and LoRA (padded): the engine samples from
exactly the trainer's policy (weight sync), the first step's KL is 0 and the step updates; the
final HF export keeps the vision tower (frozen by default) and MTP tensors of the source bit for
bit; LoRA adapts the Gated DeltaNet projections too, only adapted linears change, and peft
reproduces the merged export from the adapter; a Qwen3.5 teacher of another size scores the
LoRA run's completions (ms-swift's opd_rl.sh pair). With images (the colour task, packed
micro-batches): the engine's and the trainer's logprobs of image prompts agree after every
sync, and rewards get the row's `solution`."""
import json

import pytest
import torch

from swift_megatron.fixtures import build_colour_dataset, build_tiny_model
from tests.e2e.test_rlhf_e2e import PLUGIN, logged, rlhf
from tests.helpers import safetensors_of

pytestmark = pytest.mark.slow
UNTOUCHED = ("model.visual.", "mtp.")   # the frozen vision tower, the MTP head (copied through)


@pytest.fixture(scope="module")
def base(tiny_model_dir, math_dataset_path):
    return ["--model", tiny_model_dir("qwen3_5"), "--dataset", math_dataset_path,
            "--external_plugins", PLUGIN, "--reward_funcs", "digit_ratio", "contains_answer",
            "--num_generations", "4", "--global_batch_size", "16", "--micro_batch_size", "4",
            "--max_completion_length", "16", "--report_to", "none", "--logging_steps", "1",
            "--add_version", "false", "--train_iters", "2", "--check_weight_sync", "true"]


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_full_grpo_trains_and_exports_the_untouched_parts(base, tiny_model_dir, tmp_path, family):
    out = tmp_path / "run"
    rlhf(*base, "--model", tiny_model_dir(family), "--beta", "0.1", "--lr", "1e-3",
         "--output_dir", out)
    rows = logged(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)  # fp32: engine == trainer
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0 and rows[0]["grad_norm"] > 0
    source, exported = safetensors_of(tiny_model_dir(family)), safetensors_of(out / "final_hf")
    assert sorted(exported) == sorted(source)
    outside = [n for n in source if n.startswith(UNTOUCHED)]
    assert outside and all(torch.equal(exported[n], source[n]) for n in outside)
    trained = [n for n in source if not n.startswith(UNTOUCHED)
               and not torch.equal(exported[n], source[n])]
    assert any(".linear_attn." in n for n in trained) and any(".self_attn." in n for n in trained)


def test_lora_grpo_adapts_gated_deltanet_and_peft_reproduces_the_merge(base, tiny_model_dir,
                                                                        tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    out = tmp_path / "lora"
    teacher = build_tiny_model("qwen3_5", str(tmp_path / "teacher"), seed=1, hidden_size=64,
                               num_hidden_layers=4)
    # --lora_dropout 0: the sync check's trainer forward applies LoRA dropout (0.05 by default)
    rlhf(*base, "--train_type", "lora", "--lora_rank", "4", "--lora_alpha", "8", "--beta", "0.04",
         "--lr", "5e-3", "--lora_dropout", "0", "--padding_free", "false",
         "--teacher_model", teacher, "--output_dir", out)
    rows = logged(out)
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)
    assert all(r["teacher_kl"] > 0 for r in rows)   # another model scored the completions
    with open(out / "final_adapter" / "adapter_config.json") as f:
        targets = json.load(f)["target_modules"]
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj"} <= set(targets)
    model = tiny_model_dir("qwen3_5")
    source, merged = safetensors_of(model), safetensors_of(out / "final_hf")
    changed = {k for k in source if not torch.equal(source[k], merged[k])}
    from swift_megatron.lora import HF_PROJECTIONS

    assert changed and all(k.rsplit(".", 2)[-2] in HF_PROJECTIONS for k in changed)
    assert any(k.endswith("linear_attn.in_proj_qkv.weight") for k in changed)
    tokens = torch.tensor([[5, 60, 200, 17, 3, 99]])
    peft_model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(model),
                                           out / "final_adapter").eval()
    merged_model = AutoModelForImageTextToText.from_pretrained(out / "final_hf").eval()
    with torch.no_grad():
        diff = (peft_model(input_ids=tokens).logits - merged_model(input_ids=tokens).logits)
    assert diff.abs().max().item() < 1e-5


def test_image_grpo_engine_and_trainer_see_the_same_pixels(base, tmp_path):
    """The colour task (images, `solution` for the reward) on Qwen3.5 with its vision tower:
    every step's weight-sync check compares the engine's logprobs of sampled completions of
    image prompts with the trainer's (same pixels, 3-D interleaved M-RoPE positions)."""
    model = build_tiny_model("qwen3_5", str(tmp_path / "model"), images=True)
    colours = build_colour_dataset(str(tmp_path / "colours.jsonl"), 32)
    out = tmp_path / "img"
    rlhf(*base, "--model", model, "--dataset", colours, "--reward_funcs", "colour_parity",
         "--beta", "0.1", "--lr", "1e-3", "--max_completion_length", "4", "--output_dir", out)
    rows = logged(out)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)
    assert all(0.0 < r["reward/mean"] < 1.0 for r in rows)   # the solution column reached it
    assert rows[0]["grad_norm"] > 0 and rows[1]["kl"] > 0
    source, exported = safetensors_of(model), safetensors_of(out / "final_hf")
    assert all(torch.equal(exported[n], source[n]) for n in source if n.startswith(UNTOUCHED))
