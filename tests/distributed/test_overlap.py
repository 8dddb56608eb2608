"""--overlap_grad_reduce / --overlap_param_gather over DP=2 (gloo): the overlapped reductions
(started by DDP's hooks in the last micro-batch's backward, in several buckets) and the deferred
parameter all-gather (finished in the next forward, or by gather_params) give the same losses,
grad norms and trained weights as the plain ones, in full training (the logprob head adds its
weight gradient through autograd then, for DDP's hook) and in LoRA training (the adapters'
gradients likewise). workers/overlap_steps.py runs every job in one process group."""
import json

import pytest

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow

JOBS = [
    dict(name="full", dist_opt=True),
    dict(name="full_overlap", dist_opt=True, overlap_grad_reduce=True, overlap_param_gather=True,
         bucket_size=20000),
    dict(name="lora", dist_opt=False),
    dict(name="lora_overlap", dist_opt=False, overlap_grad_reduce=True, bucket_size=2000),
    dict(name="lora_overlap_dist_opt", dist_opt=True, overlap_grad_reduce=True,
         overlap_param_gather=True, bucket_size=2000),
]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("overlap")
    (out / "jobs.json").write_text(json.dumps([dict(job, lora=job["name"].startswith("lora"))
                                               for job in JOBS]))
    return run_workers("overlap_steps.py", 2, out, ["--jobs", out / "jobs.json"])


@pytest.mark.parametrize("overlapped, plain", [("full_overlap", "full"), ("lora_overlap", "lora"),
                                               ("lora_overlap_dist_opt", "lora")])
def test_overlapped_reductions_equal_the_plain_ones(ranks, overlapped, plain):
    for rank in ranks:
        mine, reference = rank[overlapped], rank[plain]
        assert mine["buckets"] > 1 and reference["buckets"] == 1
        for key in ("losses", "grad_norms", "weights"):
            assert mine[key] == pytest.approx(reference[key], rel=1e-6, abs=1e-9), key
    # the steps trained: the loss moved, and both ranks hold the same weights
    assert ranks[0][plain]["losses"][0] != ranks[0][plain]["losses"][-1]
    assert ranks[0][overlapped]["weights"] == pytest.approx(ranks[1][overlapped]["weights"],
                                                            rel=1e-12)
