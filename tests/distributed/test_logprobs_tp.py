"""The output layer's logprobs (values, the gradients of the hidden states and of the weight) and
entropy (values): TP=2, with and without sequence parallelism, equals TP=1 and a plain torch
reference (float64 log_softmax over the real vocab of hidden @ W^T); the weight gradient added
into a DDP `main_grad` equals the returned one; a log-softmax built from autograd all_reduces
(which sum the replicated loss's gradient over TP ranks) gives different TP=2 gradients, so this
test would catch that mistake."""
import pytest
import torch

from tests.distributed.launch import run_workers_together
from tests.distributed.workers.logprobs_grad import PADDED, TEMPERATURE, VOCAB, inputs

pytestmark = pytest.mark.slow
LAYOUTS = [(1, False, False), (2, False, False), (2, True, False), (2, False, True)]
IDS = ["tp1", "tp2", "tp2-compiled", "tp2-sp"]


def reference():
    hidden, weight, targets, w_lp = inputs()
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logits = h.transpose(0, 1) @ w.t()
    logp = torch.log_softmax(logits[..., :VOCAB] / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    (lp * w_lp.double()).sum().backward()
    return lp, ent, h.grad, w.grad


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("logprobs")
    jobs = [("logprobs_grad.py", tp, root / name,
             (["--compile"] if compiled else []) + (["--sp"] if sp else []))
            for (tp, compiled, sp), name in zip(LAYOUTS, IDS)]
    return dict(zip(LAYOUTS, run_workers_together(jobs)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS)
def test_values_and_grads_match_reference(runs, layout):
    lp, ent, hidden_grad, weight_grad = reference()
    for rank in runs[layout]:
        assert rank["compiled"] == layout[1]
        assert torch.tensor(rank["logprobs"]).double() == pytest.approx(lp.detach(), abs=1e-5)
        assert torch.tensor(rank["entropy"]).double() == pytest.approx(ent.detach(), abs=1e-5)
        assert torch.tensor(rank["hidden_grad"]).double() == pytest.approx(hidden_grad, abs=1e-5)
        assert torch.tensor(rank["weight_grad"]).double() == pytest.approx(weight_grad, abs=1e-5)
        # the padded vocab row gets no gradient at all
        assert torch.all(torch.tensor(rank["weight_grad"])[VOCAB:PADDED] == 0)
        # under DDP the gradient goes into main_grad (on top of what it held) and none is returned
        assert torch.tensor(rank["main_grad"]).double() == pytest.approx(weight_grad, abs=1e-5)
        assert not rank["ddp_grad_returned"]


def test_tp2_equals_tp1_and_naive_version_differs(runs):
    one, two = runs[1, False, False][0], runs[2, False, False][0]
    assert torch.tensor(two["hidden_grad"]) == pytest.approx(torch.tensor(one["hidden_grad"]), abs=1e-5)
    naive_error = (torch.tensor(two["naive_grad"]) - torch.tensor(one["naive_grad"])).abs().max()
    assert naive_error > 1e-2  # the wrong implementation is visibly wrong with TP=2
