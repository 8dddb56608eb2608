"""Full training with ms-swift's freeze flags (training/freeze.py), through megatron's DDP,
optimizer and forward_backward (workers/freeze_steps.py: one process and two gloo processes at
once, ~1 min on 2 cores): 2 Adam steps on tiny Qwen3 (tied embeddings) and Qwen3-MoE.

Checked on every rank: the frozen parameters are bit-identical after training while every other
one moved; no frozen parameter has a gradient buffer; the optimizer holds state for exactly the
trainable elements (summed over DP with the distributed optimizer); the ratio cuts at the same
parameter in every layout (TP=2, DP=2 with the distributed optimizer, EP=2 with experts spread
over the ranks) as in one process, with the same gradient norms (what trains, nothing else);
freezing the output layer of a tied model at PP=2 freezes the embedding on the first stage and
the output layer's copy on the last (their gradients are all-reduced together: one frozen alone
would hang the run).
"""
import json

import pytest

from tests.distributed.launch import run_workers_together

pytestmark = pytest.mark.slow

RULES = {"freeze_parameters": ["embedding.word_embeddings", "decoder.layers.0."],
         "freeze_parameters_regex": "final_layernorm",
         "trainable_parameters": ["decoder.layers.0.mlp."]}
RATIO = {"freeze_parameters_ratio": 0.4}
OUTPUT = {"freeze_parameters": ["output_layer"]}
SINGLE = {"rules": ("qwen3", RULES, {}), "ratio": ("qwen3", RATIO, {}),
          "tied_output": ("qwen3", OUTPUT, {}),
          "moe_ratio": ("qwen3_moe", {"freeze_parameters_ratio": 0.5}, {})}
# layout -> (its one-process job, layout)
LAYOUTS = {"ratio_tp2": ("ratio", dict(tp=2)), "ratio_dp2_dist_opt": ("ratio", dict(dist_opt=1)),
           "tied_output_pp2": ("tied_output", dict(pp=2)),
           "moe_ratio_ep2": ("moe_ratio", dict(ep=2))}


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("freeze")
    single = [dict(name=name, hf_dir=tiny_model_dir(family), flags=flags)
              for name, (family, flags, _) in SINGLE.items()]
    layouts = [dict(name=name, hf_dir=tiny_model_dir(SINGLE[ref][0]), flags=SINGLE[ref][1],
                    **layout) for name, (ref, layout) in LAYOUTS.items()]
    (out / "single.json").write_text(json.dumps(single))
    (out / "layouts.json").write_text(json.dumps(layouts))
    one, two = run_workers_together([
        ("freeze_steps.py", 1, out / "one", ["--jobs", out / "single.json"]),
        ("freeze_steps.py", 2, out / "two", ["--jobs", out / "layouts.json"])])
    return one[0], two


@pytest.mark.parametrize("job", list(SINGLE))
def test_frozen_weights_stay_bit_identical_while_the_others_move(runs, job):
    result = runs[0][job]
    assert result["frozen"] and result["frozen_identical"] and result["trainable_moved"]
    assert result["frozen_with_grad_buffer"] == []
    assert result["optimizer_elements"] == result["trainable_elements"]


LAYER0 = [f"decoder.layers.0.{n}.weight" for n in (
    "input_layernorm", "pre_mlp_layernorm", "self_attention.k_layernorm",
    "self_attention.linear_proj", "self_attention.linear_qkv", "self_attention.q_layernorm")]


def test_prefixes_regex_and_trainable_prefixes_as_ms_swift(runs):
    assert runs[0]["rules"]["frozen"] == sorted(["embedding.word_embeddings.weight",
                                                 "decoder.final_layernorm.weight", *LAYER0])


def test_ratio_freezes_from_the_bottom_up(runs):
    """Tiny Qwen3: the embedding 504 x 64 = 32,256 of 180,416 elements, a layer 37,024; 40% =
    72,166 take the embedding and layer 0 (69,280 in all) and layer 1's input norm (64), which
    comes next in module order (its attention output projection, 4,096, would pass the cut)."""
    layer0 = LAYER0 + ["decoder.layers.0.mlp.linear_fc1.weight",
                       "decoder.layers.0.mlp.linear_fc2.weight"]
    assert runs[0]["ratio"]["frozen"] == sorted(["embedding.word_embeddings.weight", *layer0,
                                                 "decoder.layers.1.input_layernorm.weight"])
    assert runs[0]["ratio"]["trainable_elements"] == 180416 - 32256 - 37024 - 64


@pytest.mark.parametrize("job", list(LAYOUTS))
def test_layouts_freeze_what_one_process_freezes(runs, job):
    reference = runs[0][LAYOUTS[job][0]]
    ranks = [rank[job] for rank in runs[1]]
    for rank in ranks:
        assert rank["frozen_identical"] and rank["trainable_moved"]
        assert rank["frozen_with_grad_buffer"] == []
        assert rank["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
    frozen = set().union(*(rank["frozen"] for rank in ranks))
    # (the tied output layer's copy exists at PP > 1 only; its test is below)
    assert sorted(frozen - {"output_layer.weight"}) == reference["frozen"]
    if LAYOUTS[job][1].get("dist_opt"):   # the state is split over the two DP ranks
        assert sum(rank["optimizer_elements"] for rank in ranks) == ranks[0]["trainable_elements"]
    else:
        assert all(rank["optimizer_elements"] == rank["trainable_elements"] for rank in ranks)


def test_a_tied_output_layer_freezes_both_copies_at_pp2(runs):
    first, last = (rank["tied_output_pp2"]["frozen"] for rank in runs[1])
    assert (first, last) == (["embedding.word_embeddings.weight"], ["output_layer.weight"])
