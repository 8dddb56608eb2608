"""Vocab-parallel logprobs and entropy: TP=2 values and gradients equal TP=1 and a plain torch
reference (float64 log_softmax over the real vocab); a log-softmax built from autograd all_reduces
(which sum the replicated loss's gradient over TP ranks) gives different TP=2 gradients, so this
test would catch that mistake."""
import pytest
import torch

from tests.distributed.launch import run_workers
from tests.distributed.workers.logprobs_grad import TEMPERATURE, VOCAB, inputs

pytestmark = pytest.mark.slow


def reference():
    logits, targets, (w_lp, w_ent) = inputs()
    leaf = logits.double().requires_grad_(True)
    logp = torch.log_softmax(leaf[..., :VOCAB] / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    ((lp * w_lp.double()).sum() + (ent * w_ent.double()).sum()).backward()
    return lp, ent, leaf.grad


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    return {tp: run_workers("logprobs_grad.py", tp, root / f"tp{tp}") for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
def test_values_and_grads_match_reference(runs, tp):
    lp, ent, grad = reference()
    for rank in runs[tp]:
        assert torch.tensor(rank["logprobs"]).double() == pytest.approx(lp.detach(), abs=1e-5)
        assert torch.tensor(rank["entropy"]).double() == pytest.approx(ent.detach(), abs=1e-5)
        assert torch.tensor(rank["grad"]).double() == pytest.approx(grad, abs=1e-5)
        # padded vocab column gets no gradient at all
        assert torch.all(torch.tensor(rank["grad"])[..., VOCAB:] == 0)


def test_tp2_equals_tp1_and_naive_version_differs(runs):
    one, two = runs[1][0], runs[2][0]
    assert torch.tensor(two["grad"]) == pytest.approx(torch.tensor(one["grad"]), abs=1e-5)
    naive_error = (torch.tensor(two["naive_grad"]) - torch.tensor(one["naive_grad"])).abs().max()
    assert naive_error > 1e-2  # the wrong implementation is visibly wrong with TP=2
