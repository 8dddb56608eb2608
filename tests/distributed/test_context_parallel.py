"""Context parallelism (CP=2, megatron's zigzag layout, all-gather-KV attention) reproduces the
single process: two Adam steps of the GRPO loss (with a KL term) on tiny dense and MoE models,
padded and packed (THD) micro-batches of completions of very different lengths: the step losses,
grad norms, entropy and old-policy logprobs (tests/distributed/workers/cp_steps.py)."""
import pytest
import torch

from tests.distributed.launch import run_workers

pytestmark = pytest.mark.slow

CONFIGS = ["dense_padded", "dense_packed", "moe_padded", "moe_packed"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return run_workers("cp_steps.py", 1, tmp_path_factory.mktemp("cp_single"))[0]


@pytest.fixture(scope="module")
def cp2(tmp_path_factory):
    return run_workers("cp_steps.py", 2, tmp_path_factory.mktemp("cp2"), ["--cp", 2])


def _trimmed(values, width):
    return torch.tensor(values)[:, :width]


@pytest.mark.parametrize("config", CONFIGS)
def test_cp2_reproduces_single_process(single, cp2, config):
    reference = single[config]
    for rank in cp2:
        mine = rank[config]
        assert mine["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-6)
        assert mine["losses"] == pytest.approx(reference["losses"], rel=1e-6)
        assert torch.tensor(mine["entropy"]) == pytest.approx(torch.tensor(reference["entropy"]),
                                                              rel=1e-6)
        for step_mine, step_ref in zip(mine["logprobs"], reference["logprobs"]):
            for lp, ref in zip(step_mine, step_ref):  # CP pads the rows to a multiple of 4
                width = len(ref[0])
                assert _trimmed(lp, width) == pytest.approx(torch.tensor(ref), abs=1e-5)
    # the steps really trained and the KL term moved the loss
    assert reference["losses"][0] != pytest.approx(reference["losses"][1], rel=1e-3)
    assert reference["grad_norms"][0] > 0
