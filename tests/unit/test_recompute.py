"""Selective recomputation (--recompute_granularity selective --recompute_modules) on our layer
spec, CPU, float32, through the code the trainer runs (one worker run:
tests/distributed/workers/recompute.py): tiny qwen3 (dense), qwen3_moe (MoE), qwen3_5 (Gated
DeltaNet + gated attention) and qwen3_5_moe (both, with a shared expert), one packed micro-batch;
qwen3 and qwen3_moe also at TP=2 with sequence parallelism (two processes, each rank's shards),
qwen3 also with LoRA adapters (--train_type lora).

Recomputation reruns the same float32 ops on the same inputs: the loss equals the one without
recomputation bit for bit, and so do the gradients with core_attn, mlp and moe. With layernorm
the norm's backward runs as a nested autograd call from a gradient hook and its input gradient
joins the residual stream's in another order: the gradients then differ by float32 rounding
(observed <= 5e-7 x the largest gradient; a norm recomputed wrong would differ by O(1e-2)).
What autograd holds for the backward shrinks with every module recomputed.
"""
import json

import pytest

from tests.distributed.launch import run_workers_together

FAMILIES = ("qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_lora")
TP_FAMILIES = ("qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def reports(tiny_model_dir, tmp_path_factory):
    """[one report per rank] for each layout: "tp1" (every family), "tp2" (TP=2 + SP)."""
    layouts, jobs = ("tp1", "tp2"), []
    for layout, nproc, families in zip(layouts, (1, 2), (FAMILIES, TP_FAMILIES)):
        out = tmp_path_factory.mktemp(f"recompute_{layout}")
        models = [f"--model={family}={tiny_model_dir(family.replace('_lora', ''))}"
                  for family in families]
        jobs.append(("recompute.py", nproc, out, [*models, "--tp", nproc]))
    result = dict(zip(layouts, run_workers_together(jobs)))
    print(json.dumps(result))
    return result


CASES = [("tp1", f) for f in FAMILIES] + [("tp2", f) for f in TP_FAMILIES]


def each_rank(reports, layout, family):
    return [rank[family] for rank in reports[layout]]


EXPECTED = {"default": ["core_attn"], "dense": ["core_attn", "mlp", "layernorm"],
            "moe": ["core_attn", "moe"], "moe_layernorm": ["core_attn", "moe", "layernorm"]}
CHOSEN = {"qwen3": ["dense"], "qwen3_moe": ["moe", "moe_layernorm"], "qwen3_5": ["dense"],
          "qwen3_5_moe": ["moe_layernorm"], "qwen3_lora": ["dense"]}


@pytest.mark.parametrize("layout,family", CASES)
def test_flags_reach_megatron(reports, layout, family):
    for cases in each_rank(reports, layout, family):
        assert cases["none"]["granularity"] is None
        for name in set(cases) - {"none"}:
            assert (cases[name]["granularity"], cases[name]["modules"]) == \
                ("selective", EXPECTED[name])


@pytest.mark.parametrize("layout,family", CASES)
def test_loss_and_gradients_equal_no_recomputation(reports, layout, family):
    for cases in each_rank(reports, layout, family):
        for name, case in cases.items():
            assert case["loss"] == cases["none"]["loss"], name
            assert case["eval_logits_equal"], name   # no-grad forwards (reference, old policy)
            assert case["grad_names_equal"], name
            if "layernorm" in case["modules"]:
                assert case["max_grad_diff"] <= 1e-5 * case["max_grad"], name
            else:
                assert case["grads_equal"], (name, case["max_grad_diff"], case["max_grad"])


@pytest.mark.parametrize("layout,family,chosen", [
    (layout, family, chosen) for layout, family in CASES for chosen in CHOSEN[family]])
def test_recomputed_modules_hold_fewer_bytes(reports, layout, family, chosen):
    for cases in each_rank(reports, layout, family):
        held = {name: case["saved_bytes"] for name, case in cases.items()}
        assert held[chosen] < held["none"]
        if "default" in held:   # core_attn alone drops less than the larger set
            assert held[chosen] < held["default"] < held["none"]
        if chosen == "moe_layernorm" and "moe" in held:
            assert held[chosen] < held["moe"]
