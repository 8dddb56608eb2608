"""swift_megatron.fixtures: the committed tokenizer, the four tiny model families, the math dataset."""
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.helpers import safetensors_of
from swift_megatron.fixtures import (FAMILIES, build_math_dataset, build_tiny_model, build_tokenizer,
                                     load_tokenizer, tiny_hf_config)
from swift_megatron.fixtures.tokenizer import TOKENIZER_DIR, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 504
PAD_ID, IM_START_ID, EOS_ID = 497, 498, 499
MODEL_TYPES = {family: family for family in FAMILIES}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _logits(model_dir, input_ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(input_ids).logits


# ---------------------------------------------------------------- tokenizer

def test_tokenizer_vocab_and_special_tokens(tok):
    assert len(tok) == VOCAB and 400 <= len(tok) < 1024
    assert (tok.pad_token, tok.pad_token_id) == ("<|endoftext|>", PAD_ID)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", EOS_ID)
    assert tok.bos_token is None
    assert tok.convert_tokens_to_ids("<|im_start|>") == IM_START_ID
    tags = ["<think>", "</think>", "<answer>", "</answer>"]
    assert tok.convert_tokens_to_ids(tags) == [500, 501, 502, 503]


def test_reasoning_tags_are_single_tokens_that_survive_skip_special(tok):
    text = "<think>\n3 + 4 = 7\n</think>\n<answer>\\boxed{7}</answer>"
    ids = tok.encode(text + "<|im_end|>")
    assert ids[0] == 500 and ids[-1] == EOS_ID and sum(i >= PAD_ID for i in ids) == 5
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(ids) == text + "<|im_end|>"


@pytest.mark.parametrize("text", [
    "What is 3 + 4? Put the answer in \\boxed{}.",
    "First, 9 - 5 equals 4, so the final answer is \\boxed{4}.",
    "  1234567890  spaces,\ttabs\nand newlines\n\n~!@#$%^&*()_+{}|:\"<>?",
])
def test_tokenizer_round_trip_is_deterministic(tok, text):
    ids = tok.encode(text)
    assert ids == tok.encode(text) == load_tokenizer().encode(text)
    assert tok.decode(ids) == text
    assert all(tok.decode([tok.convert_tokens_to_ids(d)]) == d for d in "0123456789")


def test_tokenizer_training_reproduces_committed_files():
    with open(os.path.join(TOKENIZER_DIR, "tokenizer.json")) as f:
        committed = json.load(f)
    trained = json.loads(train_tokenizer().to_str())
    assert trained["model"]["vocab"] == committed["model"]["vocab"]
    assert trained["model"]["merges"] == committed["model"]["merges"]
    assert trained["added_tokens"] == committed["added_tokens"]


def test_chat_template_is_chatml(tok):
    turns = [{"role": "user", "content": "What is 1 + 2?"},
             {"role": "assistant", "content": "\\boxed{3}"}]
    expected = ("<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
                "<|im_start|>assistant\n\\boxed{3}<|im_end|>\n")
    assert tok.apply_chat_template(turns, tokenize=False) == expected
    prompt = [{"role": "system", "content": "Be brief."}, turns[0]]
    assert tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_build_tokenizer_copies_committed_files(tmp_path):
    build_tokenizer(str(tmp_path / "t"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(tmp_path / "t" / name) as a, open(os.path.join(TOKENIZER_DIR, name)) as b:
            assert a.read() == b.read()
    with open(tmp_path / "t" / "tokenizer_config.json") as f:
        assert "<|im_start|>" in json.load(f)["chat_template"]


# ---------------------------------------------------------------- models

@pytest.mark.parametrize("family", FAMILIES)
def test_family_builds_reloads_and_runs(family, tiny_model_dir, tok):
    model_dir = tiny_model_dir(family)
    names = set(os.listdir(model_dir))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= names
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == MODEL_TYPES[family]
    config = config.get_text_config()  # the text stack's (qwen3_5*: nested as text_config)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (VOCAB, 64, 4)
    assert (config.eos_token_id, config.pad_token_id, config.bos_token_id) == (EOS_ID, PAD_ID, None)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert next(model.parameters()).dtype == torch.float32
    input_ids = torch.tensor([tok.encode("What is 3 + 4?")[:7], tok.encode("Put it in a box.")[:7]])
    with torch.no_grad():
        logits = model(input_ids).logits
    assert logits.shape == (2, 7, VOCAB) and torch.isfinite(logits).all()
    out = model.generate(input_ids[:1], max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 7 + 4 or out[0, -1].item() == EOS_ID


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_tokenizer_in_model_dir_matches_committed(family, tiny_model_dir):
    # transformers 5.x forces Qwen2Tokenizer on model_type qwen2; it must rebuild the same pipeline.
    # (5.x also installs an empty TemplateProcessing post-processor: it adds no tokens.)
    loaded = AutoTokenizer.from_pretrained(tiny_model_dir(family))
    backend = json.loads(loaded.backend_tokenizer.to_str())
    with open(os.path.join(TOKENIZER_DIR, "tokenizer.json")) as f:
        committed = json.load(f)
    backend.pop("post_processor"), committed.pop("post_processor")
    if family.startswith("qwen3_5"):
        # 5.x forces Qwen3_5Tokenizer, whose split regex also keeps combining marks (\p{M}) with
        # letters; identical ids on text without them (asserted below)
        pattern = lambda t: t["pre_tokenizer"]["pretokenizers"][0].pop("pattern")["Regex"]  # noqa: E731
        assert pattern(backend) == pattern(committed).replace(r"\p{L}+", r"[\p{L}\p{M}]+") \
            .replace(r"[^\s\p{L}\p{N}]", r"[^\s\p{L}\p{M}\p{N}]")
    assert backend == committed
    assert loaded("What is 3 + 4?").input_ids == [300, 266, 220, 18, 277, 220, 19, 30]


def test_llama_has_llama3_rope_scaling_and_untied_embeddings(tiny_model_dir):
    model_dir = tiny_model_dir("llama")
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128}
    assert raw["rope_scaling"] == scaling and raw["rope_theta"] == 10000.0
    config = AutoConfig.from_pretrained(model_dir)
    rope = getattr(config, "rope_parameters", None) or config.rope_scaling
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
    assert raw["tie_word_embeddings"] is False and raw["attention_bias"] is False
    tensors = safetensors_of(model_dir)
    assert not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert not any(k.endswith(".bias") for k in tensors)


def test_qwen2_is_tied_with_perturbed_qkv_bias(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    assert AutoConfig.from_pretrained(model_dir).tie_word_embeddings is True
    tensors = safetensors_of(model_dir)
    assert "lm_head.weight" not in tensors
    biases = [k for k in tensors if k.endswith(".bias")]
    assert len(biases) == 3 * 4 and {k.split(".")[-2] for k in biases} == {"q_proj", "k_proj", "v_proj"}
    q_bias = tensors["model.layers.0.self_attn.q_proj.bias"]
    assert q_bias.shape == (64,) and 0.01 < q_bias.std().item() < 0.04


def test_qwen3_head_dim_and_qk_norm(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3")
    config = AutoConfig.from_pretrained(model_dir)
    assert config.head_dim == 16 and config.tie_word_embeddings is True
    tensors = safetensors_of(model_dir)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 16, 64)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 16, 64)
    for key in ("model.layers.0.self_attn.k_norm.weight", "model.norm.weight",
                "model.layers.3.post_attention_layernorm.weight"):
        deviation = (tensors[key] - 1).abs()
        assert 0 < deviation.max().item() < 0.2, key


def test_qwen3_moe_has_eight_experts_in_hub_layout(tiny_model_dir):
    model_dir = tiny_model_dir("qwen3_moe")
    with open(os.path.join(model_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["num_experts"] == 8 and raw["num_experts_per_tok"] == 2
    assert raw["moe_intermediate_size"] == 32 and raw["norm_topk_prob"] is True
    assert raw["tie_word_embeddings"] is False and raw["mlp_only_layers"] == []
    assert AutoConfig.from_pretrained(model_dir).num_experts == 8
    tensors = safetensors_of(model_dir)
    experts = {k for k in tensors if ".mlp.experts." in k}
    assert len(experts) == 4 * 8 * 3  # per-expert gate/up/down, as on the Hub
    assert tensors["model.layers.0.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.mlp.gate.weight"].shape == (8, 64)


def test_same_seed_is_bit_identical_other_seed_differs(tmp_path, tiny_model_dir):
    first = safetensors_of(tiny_model_dir("qwen2"))
    again = safetensors_of(build_tiny_model("qwen2", str(tmp_path / "a"), seed=0))
    other = safetensors_of(build_tiny_model("qwen2", str(tmp_path / "b"), seed=1))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not any(torch.equal(first[k], other[k]) for k in first)


def test_sharded_save_reloads_to_identical_logits(tmp_path, tiny_model_dir):
    sharded = build_tiny_model("qwen3_moe", str(tmp_path / "s"), max_shard_size="20KB")
    with open(os.path.join(sharded, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards == {n for n in os.listdir(sharded) if n.endswith(".safetensors")}
    assert not os.path.exists(os.path.join(sharded, "model.safetensors"))
    input_ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    assert torch.equal(_logits(sharded, input_ids), _logits(tiny_model_dir("qwen3_moe"), input_ids))


def test_dtype_and_overrides(tmp_path):
    model_dir = build_tiny_model("llama", str(tmp_path / "bf16"), dtype="bfloat16", num_hidden_layers=2)
    tensors = safetensors_of(model_dir)
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert not any(k.startswith("model.layers.2.") for k in tensors)
    assert tiny_hf_config("qwen3", hidden_size=32).hidden_size == 32
    with pytest.raises(ValueError, match="unknown tiny model family"):
        tiny_hf_config("gpt2")


@pytest.mark.parametrize("family, tower, min_side", [
    ("qwen2_5_vl", dict(depth=3, fullatt_block_indexes=[2]), 56),
    ("qwen3_vl", dict(depth=3, deepstack_visual_indexes=[0, 2]), 64),
    ("qwen3_5", dict(depth=3), 64)])   # 14- and 16-pixel patches, 4 image tokens at least
def test_vision_language_real_vocab_and_tower_overrides(tmp_path, family, tower, min_side):
    """A larger vocab_size (a real shape's) keeps the vision tokens at the tokenizer's ids, and
    vision_config / max_pixels reach the tower and the image processor (benchmarks/grpo_step.py
    qwen2.5-vl-3b; qwen3_5 with images=True)."""
    model_dir = build_tiny_model(family, str(tmp_path / "vl"), vocab_size=1024,
                                 max_pixels=448 * 448, vision_config=tower, images=True)
    config = AutoConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert config.text_config.vocab_size == 1024 and config.vision_config.depth == 3
    assert config.vision_config.out_hidden_size == config.text_config.hidden_size == 64
    ids = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                     "<|video_pad|>"])
    assert ids == [config.vision_start_token_id, config.vision_end_token_id,
                   config.image_token_id, config.video_token_id] == [504, 505, 506, 507]
    with open(os.path.join(model_dir, "preprocessor_config.json")) as f:
        size = json.load(f)["size"]
    assert size == {"longest_edge": 448 * 448, "shortest_edge": min_side * min_side}
    tensors = safetensors_of(model_dir)
    assert not any(k.startswith("model.visual.blocks.3.") or k.startswith("visual.blocks.3.")
                   for k in tensors) and any(".blocks.2." in k for k in tensors)


def test_importing_fixtures_does_not_import_torch():
    code = "import sys, swift_megatron.fixtures; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# ---------------------------------------------------------------- dataset

def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_math_dataset_rows_are_correct(math_dataset_path, tok):
    rows = _rows(math_dataset_path)
    assert len(rows) == 64
    ops = set()
    for row in rows:
        assert set(row) == {"messages", "solution"}
        (message,) = row["messages"]
        assert message["role"] == "user"
        a, op, b = re.fullmatch(r"What is (\d) ([+-]) (\d)\? Put the answer in \\boxed\{\}\.",
                                message["content"]).groups()
        result = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["solution"] == str(result) and 0 <= result <= 18
        ops.add(op)
        prompt = tok.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
        assert len(tok.encode(prompt)) < 40
    assert ops == {"+", "-"}


def test_math_dataset_is_seeded(tmp_path, math_dataset_path):
    again = build_math_dataset(str(tmp_path / "sub" / "a.jsonl"))
    other = build_math_dataset(str(tmp_path / "b.jsonl"), num_rows=64, seed=1)
    assert _rows(again) == _rows(math_dataset_path) != _rows(other)
    assert len(_rows(build_math_dataset(str(tmp_path / "c.jsonl"), num_rows=5))) == 5


# ---------------------------------------------------------------- script

def test_make_tiny_models_script(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_tiny_models", os.path.join(REPO, "scripts", "make_tiny_models.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--output_dir", str(tmp_path), "--families", "qwen3", "--dataset_rows", "8"])
    assert sorted(os.listdir(tmp_path)) == ["math.jsonl", "qwen3"]
    assert len(_rows(tmp_path / "math.jsonl")) == 8
    assert os.path.isfile(tmp_path / "qwen3" / "model.safetensors")
