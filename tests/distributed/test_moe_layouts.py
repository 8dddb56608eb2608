"""Grouped-GEMM experts and our token dispatch on two processes over gloo
(workers/moe_layouts.py, the tiny qwen3_moe; the shared expert of qwen3_5_moe is megatron's
module in every form, tests/unit/test_moe_grouped.py): with EP=2 (four experts per rank, uneven
all-to-all splits) and with TP=2 + sequence parallelism (ETP=2: each expert's ffn split over
the ranks), every rank's logits and gradients of grouped experts match SequentialMLP's, and
those of our dispatcher (device-side permutations, the sort by local expert as one gather)
match megatron's dispatcher, in float32; a MoE layer's forward and backward then calls none of
megatron's `masked_select`s nor a `tolist` per chunk: what remains are the split sizes its
collectives need on the host."""
import json

import pytest

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_layouts")
    ranks = run_workers("moe_layouts.py", 2, out, ["--model", tiny_model_dir("qwen3_moe")])
    print(json.dumps(ranks))
    return ranks


@pytest.mark.parametrize("layout, local_experts", [("ep2", 4), ("tp2_sp", 8)])
@pytest.mark.parametrize("pair", ["grouped", "dispatch"])
def test_same_logits_and_gradients_in_the_layout(report, layout, local_experts, pair):
    for rank in report:
        result = rank[layout][pair]
        assert result["same_names"] is True
        assert result["experts"] == 2 * local_experts * 4    # fc1, fc2 of each, 4 layers
        assert result["logits"] < 1e-5
        assert result["grads"] < 5e-6


@pytest.mark.parametrize("layout", ["ep2", "tp2_sp"])
def test_only_the_split_sizes_go_to_the_host(report, layout):
    for rank in report:
        syncs = rank[layout]["syncs"]
        assert set(syncs["grouped"]) <= {"cpu", "numpy"}           # the split sizes
        assert syncs["megatron"]["masked_select"] == 2
        assert syncs["megatron"]["tolist"] > syncs["sequential"].get("tolist", 0)
