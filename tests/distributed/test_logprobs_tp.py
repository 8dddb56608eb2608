"""Vocab-parallel logprobs (values and gradients) and entropy (values): TP=2 equals TP=1 and a
plain torch reference (float64 log_softmax over the real vocab); a log-softmax built from autograd
all_reduces (which sum the replicated loss's gradient over TP ranks) gives different TP=2
gradients, so this test would catch that mistake."""
import pytest
import torch

from tests.distributed.launch import run_workers_together
from tests.distributed.workers.logprobs_grad import TEMPERATURE, VOCAB, inputs

pytestmark = pytest.mark.slow


def reference():
    logits, targets, w_lp = inputs()
    leaf = logits.double().requires_grad_(True)
    logp = torch.log_softmax(leaf[..., :VOCAB] / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * w_lp.double()).sum().backward()
    return lp, ent, leaf.grad


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    layouts = [(1, False), (2, False), (2, True)]  # (TP, compiled)
    jobs = [("logprobs_grad.py", tp, root / f"tp{tp}{compiled}", ["--compile"] if compiled else [])
            for tp, compiled in layouts]
    return dict(zip(layouts, run_workers_together(jobs)))


@pytest.mark.parametrize("layout", [(1, False), (2, False), (2, True)],
                         ids=["tp1", "tp2", "tp2-compiled"])
def test_values_and_grads_match_reference(runs, layout):
    lp, ent, grad = reference()
    for rank in runs[layout]:
        assert rank["compiled"] == layout[1]
        assert torch.tensor(rank["logprobs"]).double() == pytest.approx(lp.detach(), abs=1e-5)
        assert torch.tensor(rank["entropy"]).double() == pytest.approx(ent.detach(), abs=1e-5)
        assert torch.tensor(rank["grad"]).double() == pytest.approx(grad, abs=1e-5)
        # padded vocab column gets no gradient at all
        assert torch.all(torch.tensor(rank["grad"])[..., VOCAB:] == 0)


def test_tp2_equals_tp1_and_naive_version_differs(runs):
    one, two = runs[1, False][0], runs[2, False][0]
    assert torch.tensor(two["grad"]) == pytest.approx(torch.tensor(one["grad"]), abs=1e-5)
    naive_error = (torch.tensor(two["naive_grad"]) - torch.tensor(one["naive_grad"])).abs().max()
    assert naive_error > 1e-2  # the wrong implementation is visibly wrong with TP=2
