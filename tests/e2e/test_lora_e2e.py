"""LoRA GRPO through the CLI: a few steps train only adapters and the embedding
(--modules_to_save, tied to the output layer), the weight syncs hold them (--check_weight_sync),
the PEFT adapter it writes loads in peft and reproduces the merged HF export, and both merge
commands give that same merged checkpoint bit for bit."""
import os

import pytest
import torch

from tests.distributed.launch import REPO, run_cli_together
from tests.helpers import safetensors_of

pytestmark = pytest.mark.slow
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")


def megatron(*argv, check=True):
    proc = run_cli_together([(argv, {})])[0]
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def run(tiny_model_dir, math_dataset_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_run")
    model = tiny_model_dir("qwen3")
    megatron("rlhf", "--model", model, "--dataset", math_dataset_path, "--train_type", "lora",
             "--lora_rank", 4, "--lora_alpha", 8, "--external_plugins", PLUGIN,
             "--reward_funcs", "digit_ratio", "--num_generations", 4, "--global_batch_size", 16,
             "--micro_batch_size", 4, "--max_completion_length", 16, "--train_iters", 2,
             "--beta", 0.04, "--lr", 5e-3, "--report_to", "none", "--add_version", "false",
             "--modules_to_save", "embed_tokens", "--check_weight_sync", "true",
             "--save", root / "ckpt", "--output_dir", root / "out")
    return model, root


def test_only_adapters_and_the_embedding_trained_and_peft_loads_them(run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, root = run
    merged = safetensors_of(root / "out" / "final_hf")
    base = safetensors_of(model)
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert "model.embed_tokens.weight" in changed   # trained in full (tied: also the head)
    assert all(k.endswith("_proj.weight") for k in changed - {"model.embed_tokens.weight"})
    tokens = torch.tensor([[5, 60, 200, 17, 3, 99]])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model),
                                           root / "out" / "final_adapter").eval()
    merged_model = AutoModelForCausalLM.from_pretrained(root / "out" / "final_hf").eval()
    with torch.no_grad():
        diff = (peft_model(tokens).logits - merged_model(tokens).logits).abs().max().item()
    assert diff < 1e-5


def test_checkpoint_holds_adapter_and_merged_copies(run):
    """--save_safetensors (default): checkpoint-2 is the PEFT adapter, checkpoint-2-merged the
    merged model (--merge_lora defaults to it); the final outputs are hard links to them."""
    _, root = run
    ckpt, out = root / "ckpt", root / "out"
    assert os.path.isfile(ckpt / "checkpoint-2" / "adapter_model.safetensors")
    assert os.path.samefile(ckpt / "checkpoint-2" / "adapter_model.safetensors",
                            out / "final_adapter" / "adapter_model.safetensors")
    assert os.path.samefile(ckpt / "checkpoint-2-merged" / "model.safetensors",
                            out / "final_hf" / "model.safetensors")


def test_merge_commands_equal_the_trained_export(run, tmp_path):
    model, root = run
    expected = safetensors_of(root / "out" / "final_hf")
    megatron("export", "--mcore_adapter", root / "ckpt" / "iter_0000002", "--merge_lora", "true",
             "--to_hf", "true", "--output_dir", tmp_path / "from_ckpt")
    megatron("export", "--model", model, "--adapters", root / "out" / "final_adapter",
             "--merge_lora", "true", "--output_dir", tmp_path / "from_peft")
    for out in ("from_ckpt", "from_peft"):
        got = safetensors_of(tmp_path / out)
        assert set(got) == set(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected), out


def test_bad_adapter_is_a_user_error(run, tmp_path):
    model, _ = run
    proc = megatron("export", "--model", model, "--adapters", tmp_path, "--merge_lora", "true",
                    "--output_dir", tmp_path / "out", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
