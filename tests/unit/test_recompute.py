"""Selective recomputation (--recompute_granularity selective --recompute_modules) on our layer
spec, CPU, float32, through the code the trainer runs (one worker run:
tests/distributed/workers/recompute.py): tiny qwen3 (dense), qwen3_moe (MoE), qwen3_5 (Gated
DeltaNet + gated attention) and qwen3_5_moe (both, with a shared expert), one packed micro-batch.

Recomputation reruns the same float32 ops on the same inputs: the loss equals the one without
recomputation bit for bit, and so do the gradients with core_attn, mlp and moe. With layernorm
the norm's backward runs as a nested autograd call from a gradient hook and its input gradient
joins the residual stream's in another order: the gradients then differ by float32 rounding
(observed <= 7.5e-8 on gradients up to 0.18; a norm recomputed wrong would differ by O(1e-2)).
What autograd holds for the backward shrinks with every module recomputed.
"""
import json

import pytest

from tests.distributed.launch import run_workers

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("recompute")
    models = [f"--model={family}={tiny_model_dir(family)}" for family in FAMILIES]
    result = run_workers("recompute.py", 1, out, models)[0]
    print(json.dumps(result))
    return result


@pytest.mark.parametrize("family", FAMILIES)
def test_flags_reach_megatron(report, family):
    cases = report[family]
    assert cases["none"]["granularity"] is None
    expected = {"default": ["core_attn"], "dense": ["core_attn", "mlp", "layernorm"],
                "moe": ["core_attn", "moe"], "moe_layernorm": ["core_attn", "moe", "layernorm"]}
    for name, case in cases.items():
        if name != "none":
            assert (case["granularity"], case["modules"]) == ("selective", expected[name])


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_equal_no_recomputation(report, family):
    cases = report[family]
    for name, case in cases.items():
        assert case["loss"] == cases["none"]["loss"], name
        assert case["grad_names_equal"], name
        if "layernorm" in case["modules"]:
            assert case["max_grad_diff"] <= 1e-5 * case["max_grad"], name
        else:
            assert case["grads_equal"], (name, case["max_grad_diff"], case["max_grad"])


@pytest.mark.parametrize("family,chosen", [("qwen3", "dense"), ("qwen3_moe", "moe"),
                                           ("qwen3_moe", "moe_layernorm"),
                                           ("qwen3_5", "dense"), ("qwen3_5_moe", "moe_layernorm")])
def test_recomputed_modules_hold_fewer_bytes(report, family, chosen):
    cases = report[family]
    none, more = cases["none"]["saved_bytes"], cases[chosen]["saved_bytes"]
    assert more < none
    if "default" in cases:   # core_attn alone saves less than the larger set
        assert more < cases["default"]["saved_bytes"] < none
    if chosen == "moe_layernorm" and "moe" in cases:
        assert more < cases["moe"]["saved_bytes"]
