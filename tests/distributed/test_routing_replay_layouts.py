"""Routing replay (R3) in every parallel layout of the policy: TP=2 with sequence parallelism,
EP=2, PP=2 (also with full recomputation, whose backward pops the replayed routes in the
1F1B schedule's order), PP=2 x VPP=2, CP=2 packed and padded. Each layout's logprobs of three
completions whose samples carry forced routes equal those of transformers' model with its
routers forced to the same experts (tests/distributed/workers/routing_replay.py), so each rank's
routers got the columns of their own layers at their own token positions."""
import pytest

from tests.distributed.launch import run_workers_together
from tests.distributed.workers import routing_replay as worker

pytestmark = pytest.mark.slow

LAYOUTS = ("tp2", "ep2", "pp2", "pp2_vpp2", "cp2", "cp2_padded")
ATOL = 1e-4     # float32 megatron vs transformers, same experts


@pytest.fixture(scope="module")
def results(tiny_model_dir, tmp_path_factory):
    model = tiny_model_dir("qwen3_moe")
    root = tmp_path_factory.mktemp("replay_layouts")
    jobs = [("routing_replay.py", 2, root / layout,
             ["--model", model, "--layout", layout, *(["--recompute"] if layout == "pp2" else [])])
            for layout in LAYOUTS]
    return model, dict(zip(LAYOUTS, run_workers_together(jobs, timeout=600)))


@pytest.fixture(scope="module")
def reference(results):
    from swift_megatron.model.config import load_hf_config

    model, _ = results
    return worker.hf_forced_logprobs(model, worker.forced_samples(load_hf_config(model)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_replays_the_given_experts(results, reference, layout):
    ranks = results[1][layout]
    last = [r for r in ranks if r["logprobs"]]
    assert len(last) == (1 if layout.startswith("pp2") else 2)   # the last stage reports
    for rank in last:
        worst = max(abs(a - float(b)) for got, want in zip(rank["logprobs"], reference)
                    for a, b in zip(got, want))
        assert worst < ATOL, (layout, worst)
    assert all(r["queued"] == 0 and r["queued_after"] == 0 for r in ranks)


def test_recomputation_pops_the_routes_in_the_pipeline_order(results):
    for rank in results[1]["pp2"]:
        assert rank["same_params"] and rank["grad_max"] > 1e-3
        assert rank["grad_diff"] < 1e-6, rank["grad_diff"]
