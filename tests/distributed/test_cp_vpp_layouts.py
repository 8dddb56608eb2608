"""Context parallelism (CP=2: megatron's zigzag layout, all-gather-KV attention) and the
interleaved pipeline (PP=2 x VPP=2) reproduce the single process: two Adam steps of the GRPO
loss (with a KL term) on tiny 4-layer dense and MoE models, on padded and packed (THD)
micro-batches of completions of very different lengths: step losses, grad norms, entropy and the
old-policy logprobs of the forward-only pass (tests/distributed/workers/cp_steps.py).

The first step agrees to 1e-6; the second to 1e-5: Adam divides by the root of tiny second
moments, which magnifies float32 summation-order differences of the first step's gradients."""
import pytest
import torch

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow

CONFIGS = ["dense_padded", "dense_packed", "moe_padded", "moe_packed"]
# (worker flags, micro-batch size): the interleaved pipeline with 6 micro-batches of one
# completion (more than PP, so its steady state sends activations and gradients at once)
LAYOUTS = {"cp2": (["--cp", 2], 3), "pp2_vpp2": (["--pp", 2, "--vpp", 2], 1)}
_SINGLE = {}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, tmp_path_factory):
    """(the single process's results, the layout's per rank) at the layout's micro-batch size."""
    flags, micro = LAYOUTS[request.param]
    if micro not in _SINGLE:
        _SINGLE[micro] = run_workers("cp_steps.py", 1, tmp_path_factory.mktemp(f"single{micro}"),
                                     ["--micro_batch_size", micro])[0]
    layout = run_workers("cp_steps.py", 2, tmp_path_factory.mktemp(request.param),
                         flags + ["--micro_batch_size", micro])
    return _SINGLE[micro], layout


@pytest.mark.parametrize("config", CONFIGS)
def test_layout_reproduces_single_process(runs, config):
    single, layout = runs
    reference = single[config]
    for rank in layout:
        mine = rank[config]
        assert mine["grad_norms"][0] == pytest.approx(reference["grad_norms"][0], rel=1e-6)
        assert mine["grad_norms"][1] == pytest.approx(reference["grad_norms"][1], rel=1e-5)
        if mine["losses"][0] is None:  # a pipeline stage before the last
            continue
        assert mine["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert torch.tensor(mine["entropy"]) == pytest.approx(torch.tensor(reference["entropy"]),
                                                              rel=1e-6)
        for step_mine, step_ref in zip(mine["logprobs"], reference["logprobs"]):
            for lp, ref in zip(step_mine, step_ref):
                assert torch.tensor(lp) == pytest.approx(torch.tensor(ref), rel=1e-5, abs=1e-5)
    assert any(rank[config]["losses"][0] is not None for rank in layout)
    # the steps really trained and the KL term moved the loss
    assert reference["losses"][0] != pytest.approx(reference["losses"][1], rel=1e-3)
    assert reference["grad_norms"][0] > 0
