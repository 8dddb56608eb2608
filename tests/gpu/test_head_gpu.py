"""GPU: the output layer's chunked logprobs (model/logprobs.py `head_logprobs`, compiled as on
CUDA by default) against the plain path they replace: bf16 logits from one product, a float32
log-softmax, autograd's gradients. 4096 tokens, hidden 1536, a 151,936-row vocabulary padded to
152,064 (the last backward block is short and holds the padding), temperature 0.9.

    python -m pytest tests/gpu/test_head_gpu.py -q -s

Passed on an H200 (2026-11-27); the CPU counterparts are
tests/distributed/test_logprobs_tp.py (float64, TP=1/2, SP, compiled).
"""
import pytest
import torch

pytestmark = pytest.mark.gpu
TOKENS, HIDDEN, VOCAB, PADDED, TEMPERATURE = 4096, 1536, 151936, 152064, 0.9


@pytest.fixture(scope="module")
def runs():
    from swift_megatron.model import logprobs
    from swift_megatron.parallel.state import ParallelState

    state = ParallelState.initialize(device="cuda", seed=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(TOKENS, HIDDEN, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(PADDED, HIDDEN, device="cuda", generator=gen) * 3 / HIDDEN ** 0.5).bfloat16()
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=gen)
    upstream = torch.randn(TOKENS, device="cuda", generator=gen)

    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    lp, ent = logprobs.head_logprobs(h, w, targets, TEMPERATURE, VOCAB, with_entropy=True)
    (lp * upstream).sum().backward()
    compiled = logprobs.KERNELS.ran_compiled

    h0, w0 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp = torch.log_softmax((h0 @ w0.t())[:, :VOCAB].float() / TEMPERATURE, dim=-1)
    lp0 = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent0 = -(logp.exp() * logp).sum(-1)
    (lp0 * upstream).sum().backward()
    ParallelState.destroy()
    return dict(compiled=compiled, ours=(lp, ent, h.grad, w.grad),
                plain=(lp0.detach(), ent0.detach(), h0.grad, w0.grad))


def test_the_compiled_kernels_ran(runs):
    assert runs["compiled"]


def test_logprobs_and_entropy_equal_the_plain_path(runs):
    (lp, ent, _, _), (lp0, ent0, _, _) = runs["ours"], runs["plain"]
    assert (lp - lp0).abs().max().item() < 1e-3     # both from the same bf16 logits
    assert (ent - ent0).abs().max().item() < 1e-3


def test_gradients_equal_the_plain_path(runs):
    (_, _, gh, gw), (_, _, gh0, gw0) = runs["ours"], runs["plain"]
    assert gh.dtype == gw.dtype == torch.bfloat16
    # bf16 gradients: one rounding each way, relative to the largest entry
    assert (gh.float() - gh0.float()).abs().max() <= 2e-2 * gh0.float().abs().max()
    assert (gw.float() - gw0.float()).abs().max() <= 2e-2 * gw0.float().abs().max()
    assert torch.all(gw[VOCAB:] == 0)                # the padding rows get nothing
