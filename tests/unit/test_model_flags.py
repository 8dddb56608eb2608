"""Flags that change the model or its optimizer, on a tiny qwen3_moe on CPU through the code the
trainer runs (one worker run: tests/distributed/workers/model_flags.py):

- --moe_expert_capacity_factor reaches megatron's TransformerConfig (drop policy "probs", our
  alltoall dispatcher, grouped experts) for the policy and the reference model alike; a factor
  no expert can exceed (experts / top-k = 4) leaves the logits bit-identical to the no-drop
  model's, a small one drops tokens and changes them, and backward runs with dropped tokens.
- --adam_eps reaches the optimizer: one step of the distributed optimizer is Adam's first step
  with that epsilon, and measurably not with the default one.
- --vit_lr / --aligner_lr (tiny qwen2_5_vl, --freeze_vit false --freeze_aligner false, a batch
  with images): one step moves the vision tower, the merger and the language model each by
  Adam's first step at its own learning rate (and measurably not at --lr); their optimizer
  groups peak at vit_lr / aligner_lr with minimum min_lr x part_lr / lr, as ms-swift's.
"""
import json

import pytest

from tests.distributed.launch import run_workers

TOKENS, TOP_K, EXPERTS = 48, 2, 8     # the worker's batch; the tiny qwen3_moe's routing


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("model_flags")
    result = run_workers("model_flags.py", 1, out, ["--moe_dir", tiny_model_dir("qwen3_moe"),
                                                    "--vl_dir", tiny_model_dir("qwen2_5_vl")])[0]
    print(json.dumps(result))
    return result


def test_capacity_factor_reaches_megatron_with_our_dispatcher(report):
    capacity = report["capacity"]
    for case, factor in (("none", None), ("large", 4.0), ("small", 0.5)):
        assert (capacity[case]["capacity_factor"], capacity[case]["drop_policy"],
                capacity[case]["dispatcher"], capacity[case]["grouped_gemm"]) == \
            (factor, "probs", "alltoall", True)


def test_no_tokens_dropped_without_the_flag_or_with_a_large_factor(report):
    capacity = report["capacity"]
    assert capacity["none"]["routed"] == [TOKENS * TOP_K] * 4
    assert capacity["large"]["routed"] == [TOKENS * TOP_K] * 4
    assert capacity["large_equals_none"] is True


def test_a_small_factor_drops_tokens_and_changes_the_logits(report):
    capacity = report["capacity"]
    per_expert = -(-TOKENS * TOP_K * 0.5 // EXPERTS)          # ceil(96 / 8 * 0.5) = 6
    routed = capacity["small"]["routed"]
    assert all(count <= per_expert * EXPERTS for count in routed)
    assert sum(routed) < 4 * TOKENS * TOP_K
    assert capacity["small_max_abs_diff"] > 1e-3


def test_the_reference_model_drops_tokens_the_same_way(report):
    capacity = report["capacity"]
    assert capacity["reference_factor"] == 0.5
    assert capacity["reference_equals_policy"] is True


def test_backward_runs_with_dropped_tokens(report):
    # every parameter: 4 layers of 7 (norms, attention, router) plus 2 grouped expert weights,
    # the embedding, final norm and output layer
    assert report["capacity"]["backward"] == {"params_with_grad": 4 * 9 + 3, "all_finite": True}


def test_adam_eps_is_the_optimizers_epsilon(report):
    adam = report["adam_eps"]
    assert adam["settings_eps"] == 1e-3 and adam["distributed"] is True
    # lr 1e-3: float32 rounding of the update is ~1e-10; a wrong epsilon moves it by ~1e-3
    assert adam["max_update_error"]["flag_eps"] < 1e-6
    assert adam["max_update_error"]["default_eps"] > 1e-4


def test_vision_parts_step_at_their_own_learning_rates(report):
    """Worker: lr 1e-3, vit_lr 1e-4, aligner_lr 1e-2, min_lr 1e-4, no weight decay or clipping."""
    parts = report["vision_lrs"]["parts"]
    for part, rate in (("vit", 1e-4), ("aligner", 1e-2), ("llm", 1e-3)):
        # Adam's first step moves each weight by about its part's learning rate (float32
        # rounding of weights near 1 is ~1e-7)
        assert parts[part]["max_update"] == pytest.approx(rate, rel=1e-2)
        assert parts[part]["own_lr_error"] < 1e-6
    assert parts["vit"]["base_lr_error"] > 5e-4               # at --lr it would move 10x more
    assert parts["aligner"]["base_lr_error"] > 5e-3
    # (max_lr, min_lr) of the optimizer groups: vit, language model, aligner
    groups = [value for group in report["vision_lrs"]["group_lrs"] for value in group]
    assert groups == pytest.approx([1e-4, 1e-5, 1e-3, 1e-4, 1e-2, 1e-3], rel=1e-9)


def test_dense_models_reject_the_capacity_factor():
    import torch

    from swift_megatron.errors import UserError
    from swift_megatron.model.config import transformer_config

    hf = dict(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(UserError, match=r"^--moe_expert_capacity_factor applies to MoE models; "
                                        r"this qwen3 model has no experts"):
        transformer_config(hf, dtype=torch.float32, moe_expert_capacity_factor=1.0)
