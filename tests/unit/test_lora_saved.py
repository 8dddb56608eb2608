"""LoRA's --modules_to_save (lora/saved.py) and --target_regex: flag and config rules in process,
and one worker run (tests/distributed/workers/lora_saved_checks.py, ~30 s) on tiny llama
(untied embeddings, ms-swift's Megatron names word_embeddings / output_layer) and qwen3 (tied,
the HF name embed_tokens) measured against peft."""
import pytest

from swift_megatron.arguments.lora import LoraArguments, saved_module
from swift_megatron.errors import UserError
from swift_megatron.lora import LoraConfig
from swift_megatron.lora.peft_io import config_from_peft, peft_config_dict
from tests.distributed.launch import run_workers

LOGITS_ATOL = 1e-4


# ---- names and configs ----------------------------------------------------------------------

@pytest.mark.parametrize("name, module", [
    ("word_embeddings", "embedding.word_embeddings"),
    ("embed_tokens", "embedding.word_embeddings"), ("all-embedding", "embedding.word_embeddings"),
    ("model.embed_tokens", "embedding.word_embeddings"),
    ("output_layer", "output_layer"), ("lm_head", "output_layer")])
def test_ms_swift_and_hf_names_select_the_module(name, module):
    assert saved_module(name) == module


def test_other_modules_and_bad_regexes_are_user_errors():
    with pytest.raises(UserError, match="'norm': only the word embedding"):
        LoraArguments(modules_to_save=["norm"])
    with pytest.raises(UserError, match="--target_regex"):
        LoraArguments(target_regex="(")
    assert LoraArguments().modules_to_save == [] and LoraArguments().target_regex is None


def test_target_regex_replaces_target_modules_as_ms_swift():
    config = LoraConfig.from_arguments(LoraArguments(target_modules=["q_proj"],
                                                     target_regex=r".*\.v_proj",
                                                     modules_to_save=["lm_head", "embed_tokens"]),
                                       seed=1)
    select = config.selector()
    hf = ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
          "model.layers.0.self_attn.v_proj")
    assert select("decoder.layers.0.self_attention.linear_qkv", hf) == hf[2:]
    assert config.modules_to_save == ("embedding.word_embeddings", "output_layer")
    megatron = LoraConfig(target_regex=r"decoder\.layers\.0\.self_attention\.linear_qkv").selector()
    assert megatron("decoder.layers.0.self_attention.linear_qkv", hf) == hf
    assert megatron("decoder.layers.1.self_attention.linear_qkv", hf) == ()


def test_peft_configs_with_modules_to_save_and_regexes_read():
    data = peft_config_dict(LoraConfig(), ["model.layers.0.self_attn.q_proj"], "b",
                            ["lm_head", "model.embed_tokens"], tied=True)
    assert data["ensure_weight_tying"]
    assert data["modules_to_save"] == ["lm_head", "model.embed_tokens"]
    back = config_from_peft(data, "x")
    assert back.modules_to_save == ("embedding.word_embeddings", "output_layer")
    select = back.selector()   # full names: peft's rule, the name or a suffix after a dot
    assert select("m", ("model.layers.0.self_attn.q_proj", "model.layers.10.self_attn.q_proj")) \
        == ("model.layers.0.self_attn.q_proj",)
    string = config_from_peft(dict(data, target_modules=r".*\.q_proj"), "x")
    assert string.target_regex == r".*\.q_proj"
    with pytest.raises(UserError, match="'score': only the word embedding"):
        config_from_peft(dict(data, modules_to_save=["score"]), "x")


# ---- models (one worker run) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def checks(tiny_model_dir, tmp_path_factory):
    from pathlib import Path

    root = Path(tiny_model_dir("llama")).parent
    tiny_model_dir("qwen3")
    out = tmp_path_factory.mktemp("lora_saved")
    return run_workers("lora_saved_checks.py", 1, out, ["--root", root])[0]


@pytest.mark.parametrize("family, trainable", [
    ("llama", ["embedding.word_embeddings.weight", "output_layer.weight"]),
    ("qwen3", ["embedding.word_embeddings.weight"])])   # tied: one matrix
def test_the_modules_train_beside_the_adapters_and_disabled_gives_the_base(checks, family,
                                                                             trainable):
    saved = checks[family]["saved"]
    assert saved["trainable"] == trainable and saved["saved_moves_logits"] > 0.5
    assert saved["disabled_is_base"] and saved["base_export_is_base"]


@pytest.mark.parametrize("family, tying", [("llama", None), ("qwen3", True)])
def test_saved_in_peft_format(checks, family, tying):
    """peft's own layout: the full weights under their HF names without `modules_to_save.default`,
    the HF module names in adapter_config.json; a tied model writes both names, as peft does
    with ensure_weight_tying."""
    saved = checks[family]["saved"]
    assert saved["keys"] == ["base_model.model.lm_head.weight",
                             "base_model.model.model.embed_tokens.weight"]
    assert saved["config"] == {"modules_to_save": ["lm_head", "model.embed_tokens"],
                               "ensure_weight_tying": tying}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_peft_loads_it_and_merges_as_we_do(checks, family):
    saved = checks[family]["saved"]
    print(f"{family}: peft vs ours {saved['peft_logits']:.1e}, merged export vs peft "
          f"{saved['merge_vs_peft']:.1e}, merged HF checkpoint vs peft "
          f"{saved['merged_hf_vs_peft']:.1e}")
    assert saved["peft_logits"] <= LOGITS_ATOL and saved["merged_hf_vs_peft"] <= LOGITS_ATOL
    assert saved["merge_vs_peft"] == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_we_load_what_peft_saves_with_the_same_logits(checks, family):
    diff, effect = (checks[family]["peft_made"][k] for k in ("max_abs_diff", "effect"))
    print(f"{family}: peft-made adapter with modules_to_save, logits max abs diff {diff:.1e} "
          f"(it moves them by {effect:.2f})")
    assert diff <= LOGITS_ATOL and effect > 0.1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_loaded_back_and_resumed_exactly(checks, family):
    saved, checkpoint = checks[family]["saved"], checks[family]["checkpoint"]
    assert saved["round_trip"] == 0.0 and saved["round_trip_disabled_is_base"]
    assert checkpoint["resumed"] == 0.0 and checkpoint["resumed_disabled_is_base"]
    assert checkpoint["plain_loads_base"]


@pytest.mark.parametrize("naming, adapted", [
    ("hf", [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qv"]),
    ("megatron", ["model.layers.2.mlp.down_proj"] + [f"model.layers.2.self_attn.{p}_proj"
                                                     for p in "kqv"])])
def test_target_regex_adapts_the_matching_linears_only(checks, naming, adapted):
    result = checks["qwen3"]["regex"][naming]
    assert result["adapted"] == adapted and result["target_modules"] == adapted
    assert result["peft_logits"] <= LOGITS_ATOL and result["lora_effect"] > 0.1
    assert result["round_trip"] == 0.0
