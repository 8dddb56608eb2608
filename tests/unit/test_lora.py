"""LoRA (swift_megatron/lora): config and PEFT-format rules in process, and two single-process
worker runs at once (tests/distributed/workers/lora_checks.py, half of the families each, ~15 s)
measuring LoRA models against references, against peft, and merged exports against peft's
merge_and_unload.

    python -m pytest tests/unit/test_lora.py -q -s     # -s prints the measured differences
"""
import json

import pytest
import torch

from swift_megatron.arguments.lora import LoraArguments
from swift_megatron.bridge.mapping import QKV, Dims, GateUp, RowParallel, Shard
from swift_megatron.errors import UserError
from swift_megatron.fixtures import FAMILIES
from swift_megatron.lora import HF_PROJECTIONS, LoraConfig, read_adapter
from swift_megatron.lora.peft_io import config_from_peft, peft_config_dict
from swift_megatron.lora.targets import LoraTarget, rows_on, split_index
from tests.distributed.launch import run_workers_together

LOGITS_ATOL = 1e-4
MERGE_ATOL = 1e-6


# ---- config ---------------------------------------------------------------------------------

def test_scale_is_alpha_over_r_or_over_sqrt_r_with_rslora():
    assert LoraConfig(r=8, lora_alpha=32).scale == 4.0
    assert LoraConfig(r=16, lora_alpha=32, use_rslora=True).scale == 8.0


def test_all_linear_targets_every_projection_and_names_are_checked():
    assert LoraConfig().projections() == HF_PROJECTIONS
    assert LoraConfig(target_modules=["v_proj", "q_proj"]).projections() == ("q_proj", "v_proj")
    with pytest.raises(UserError, match="lm_head not supported"):
        LoraConfig(target_modules=["q_proj", "lm_head"])
    with pytest.raises(UserError, match="rank must be >= 1"):
        LoraConfig(r=0)


def test_config_from_command_line_flags():
    config = LoraConfig.from_arguments(LoraArguments(), seed=7)
    assert (config.r, config.lora_alpha, config.lora_dropout, config.target_modules, config.seed) == \
        (8, 32, 0.05, ("all-linear",), 7)


def test_written_config_is_a_peft_lora_config_and_reads_back():
    import peft

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, use_rslora=True)
    data = peft_config_dict(config, ["v_proj", "q_proj"], "base/dir")
    theirs = peft.LoraConfig(**{k: v for k, v in data.items() if k != "peft_type"})
    assert (theirs.r, theirs.lora_alpha, theirs.use_rslora, sorted(theirs.target_modules)) == \
        (4, 8, True, ["q_proj", "v_proj"])
    back = config_from_peft(data, "x")
    assert (back.r, back.lora_alpha, back.lora_dropout) == (4, 8, 0.1)
    assert back.projections() == ("q_proj", "v_proj")


def test_config_written_by_peft_reads():
    import peft

    data = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"]).to_dict()
    data["peft_type"] = "LORA"
    assert config_from_peft(data, "x").projections() == ("q_proj", "down_proj")


@pytest.mark.parametrize("change, message", [
    ({"peft_type": "IA3"}, "not LORA"), ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias=all"), ({"target_modules": ["q_proj", "score"]}, "not supported"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern")])
def test_unsupported_peft_configs_are_user_errors(change, message):
    data = dict(peft_config_dict(LoraConfig(), ["q_proj"], "base"), **change)
    with pytest.raises(UserError, match=message):
        config_from_peft(data, "adapter_config.json")


def test_adapter_directories_without_the_peft_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no adapter_config.json"):
        read_adapter(str(tmp_path))
    config = peft_config_dict(LoraConfig(), ["q_proj"], "b")
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "adapter_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="only safetensors"):
        read_adapter(str(tmp_path))


# ---- layouts: the split index reproduces the bridge's own sharding -------------------------

class DictReader:
    def __init__(self, tensors):
        self.tensors = tensors

    def shape(self, name):
        return list(self.tensors[name].shape)

    def read(self, name, dim=None, start=0, stop=None):
        tensor = self.tensors[name]
        return tensor if dim is None else tensor.narrow(dim, start, stop - start)


@pytest.mark.parametrize("mapping, shapes", [
    (QKV("w", "q", "k", "v"), {"q": (8 * 2, 3), "k": (2 * 2, 3), "v": (2 * 2, 3)}),
    (GateUp("w", "gate", "up"), {"gate": (6, 3), "up": (6, 3)}),
    (RowParallel("w", "down"), {"down": (3, 10)})])
@pytest.mark.parametrize("tp", [1, 2])
def test_rows_and_positions_rebuild_each_ranks_fused_shard(mapping, shapes, tp):
    """Placing each HF tensor's rows_on(rank) at their positions gives exactly the bridge's
    load() of that rank (8 heads, 2 query groups, head_dim 2: GQA per-group interleave)."""
    dims = Dims(num_heads=8, num_query_groups=2, head_dim=2, vocab_size=0, padded_vocab_size=0)
    full = {name: torch.randn(shape) for name, shape in shapes.items()}
    names = list(full)
    dim = 1 if isinstance(mapping, RowParallel) else 0
    for rank in range(tp):
        expected = mapping.load(DictReader(full), names, Shard(rank, tp), dims)
        target = LoraTarget("m", mapping, tuple(names), tuple(names), Shard(rank, tp))
        local = expected.shape[dim]
        rebuilt = torch.zeros_like(expected)
        for name, index in split_index(target, local, dims).items():
            rows = rows_on(index, local, rank)
            rebuilt.index_copy_(dim, index[rows] % local, full[name].index_select(dim, rows))
        assert torch.equal(rebuilt, expected)


# ---- LoRA models (one worker run) -----------------------------------------------------------

@pytest.fixture(scope="module")
def checks(tiny_model_dir, tmp_path_factory):
    from pathlib import Path

    root = Path([tiny_model_dir(family) for family in FAMILIES][0]).parent
    out = tmp_path_factory.mktemp("lora_checks")
    halves = (FAMILIES[0::2], FAMILIES[1::2])   # two worker processes, one per core
    ranks = run_workers_together([("lora_checks.py", 1, out / str(i),
                                   ["--root", root, "--families", *families])
                                  for i, families in enumerate(halves)])
    return {**ranks[0][0], **ranks[1][0]}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_projection_is_base_plus_scaled_b_a_x(checks, family):
    diffs = checks[family]["projections"]
    print(f"{family}: max abs diff per projection {json.dumps(diffs)}")
    # hybrid: a Gated DeltaNet layer's 5 projections plus gated attention's 4, and the MLP's 3
    assert len(diffs) == (12 if family.startswith("qwen3_5") else 7)
    assert max(diffs.values()) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_fresh_adapters_give_the_base_model_and_only_adapters_train(checks, family):
    init = checks[family]["init"]
    assert init["equal_base"] and init["trainable_are_adapters"]
    mlp = {"qwen3_moe": 8 * 3, "qwen3_5_moe": 8 * 3 + 3}.get(family, 3)  # experts (+ shared)
    if family.startswith("qwen3_5"):  # 3 Gated DeltaNet layers (5 projections), 1 attention
        projections = 3 * (5 + mlp) + 4 + mlp
    else:
        projections = 4 * (4 + mlp)
    assert init["num_trainable"] == 2 * projections  # A and B


@pytest.mark.parametrize("family", FAMILIES)
def test_disabled_adapters_give_exactly_the_base_model(checks, family):
    result = checks[family]["disabled"]
    assert result["equal_base"] and result["lora_moves_logits"] > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_save_then_load_adapter_is_bit_exact(checks, family):
    result = checks[family]["round_trip"]
    assert result["same_names"] and result["bit_exact"] and result["same_logits"]
    gdn = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    adapted = [p for p in HF_PROJECTIONS if family.startswith("qwen3_5") or p not in gdn]
    assert result["config"] == {"r": 4, "lora_alpha": 8, "target_modules": sorted(adapted),
                                "peft_type": "LORA", "task_type": "CAUSAL_LM", "use_rslora": False}


# peft on transformers 5.19's Qwen3_5Moe (experts fused into parameters) does not apply
# per-expert adapters (it does for Qwen3Moe); our expert projections are checked against the
# HF-layout weights instead (test_each_projection_is_base_plus_scaled_b_a_x)
PEFT_PER_EXPERT = [f if f != "qwen3_5_moe" else pytest.param(f, marks=pytest.mark.skip(
    reason="peft does not apply per-expert adapters to transformers' fused Qwen3.5-MoE experts"))
    for f in FAMILIES]


@pytest.mark.parametrize("family", PEFT_PER_EXPERT)
def test_peft_loads_our_adapter_with_the_same_logits(checks, family):
    result = checks[family]["peft_reads_ours"]
    print(f"{family}: peft.PeftModel vs Megatron LoRA logits max abs diff "
          f"{result['max_abs_diff']:.2e} (LoRA moves logits by {result['lora_effect']:.2f})")
    assert result["max_abs_diff"] <= LOGITS_ATOL and result["lora_effect"] > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_we_load_an_adapter_peft_created_with_the_same_logits(checks, family):
    result = checks[family]["ours_reads_peft"]
    print(f"{family}: peft-created adapter (rslora), logits max abs diff "
          f"{result['max_abs_diff']:.2e}")
    assert result["max_abs_diff"] <= LOGITS_ATOL and result["use_rslora"]


@pytest.mark.parametrize("family", PEFT_PER_EXPERT)
def test_merged_export_equals_peft_merge_and_unload(checks, family):
    result = checks[family]["merge"]
    print(f"{family}: merged export vs merge_and_unload, {result['num_tensors']} tensors, max abs "
          f"diff {result['max_abs_diff']:.2e}")
    assert result["max_abs_diff"] <= MERGE_ATOL
    assert result["lora_in_export"] == [] and result["missing"] == []


@pytest.mark.parametrize("family", PEFT_PER_EXPERT)
def test_merge_adapter_into_hf_reloads_in_transformers_like_peft(checks, family):
    diff = checks[family]["merge_to_hf"]["max_abs_diff_vs_peft"]
    print(f"{family}: merged HF checkpoint vs peft logits max abs diff {diff:.2e}")
    assert diff <= LOGITS_ATOL


def test_base_weights_bit_identical_after_100_merged_exports(checks):
    assert checks["qwen3"]["base_untouched"] == {"exports": 100, "bit_identical": True}


def test_lora_backward_has_no_batched_matmul(checks):
    """megatron's frozen output layer multiplied the transposed logits' gradient through
    torch.matmul's batched fallback (10x slower on an H100); training's chunked head
    (model/head.py) runs plain matrix products only."""
    assert checks["qwen3"]["backward_ops"] == {"b2": ["aten::mm"], "b1": ["aten::mm"]}


def test_forward_only_passes_ignore_lora_dropout(checks):
    assert checks["qwen3"]["forward_only"] == {"equal": True, "still_training": True}


def test_targeting_some_projections_of_a_fused_linear(checks):
    result = checks["qwen3"]["partial"]
    assert result == {"adapted_modules": 4, "k_equal_base": True, "q_moved": True,
                      "v_moved": True, "targets": ["q_proj", "v_proj"]}


@pytest.mark.parametrize("case, message", [
    ("missing_dir", "no adapter_config.json"), ("rank_mismatch", "rank 8 .* rank 4"),
    ("unknown_target", "no adapted module for model.layers.0.mlp.down_proj.lora_A.weight"),
    ("unsupported_target", "lm_head not supported"),
    ("wrong_shape", r"down_proj.lora_A.weight \(4, 128\) \(expected \(8, 128\)\)")])
def test_adapters_that_do_not_fit_are_user_errors(checks, case, message):
    import re

    error = checks["qwen3"]["errors"][case]
    assert error is not None and re.search(message, error), error


def test_peft_fused_expert_adapters_are_rejected_with_a_user_error(checks):
    result = checks["qwen3_moe"]["peft_fused_experts"]
    assert result["target_parameters"] == ["down_proj", "gate_up_proj"]
    assert "target_parameters" in result["error"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_each_lora_linear_is_one_autograd_node_with_the_same_gradients(checks, family):
    """At one rank a LoRA linear runs as one autograd node (lora/branch.py
    FrozenLinearWithAdapter), with the loss and every gradient of megatron's frozen linear plus
    the adapter branch (qwen2: q/k/v with biases; qwen3_moe: the experts), dropout on and off."""
    for dropout, result in checks[family]["one_node"].items():
        print(f"{family} dropout {dropout}: {result}")
        assert result["same_params"]
        assert result["loss"] <= 1e-6 and result["grads"] <= 1e-5
        assert result["nodes_two"] == 0 and result["nodes_one"] == result["linears"]
