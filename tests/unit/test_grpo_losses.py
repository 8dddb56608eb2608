"""kl_k3, importance weights, policy_loss and aggregate_loss against hand-computed values,
plus the split invariance of the step loss over micro-batches and data-parallel ranks."""
import math

import pytest
import torch

from swift_megatron.rlhf.grpo.losses import (aggregate_loss, kl_k3, log_importance_weights,
                                             masked_mean, policy_loss)

ATOL = dict(atol=1e-6, rtol=0)


# ----------------------------------------------------------------------------- kl_k3
def test_kl_k3_by_hand():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5, -3.0]], dtype=torch.float64)
    # ref - logprobs = [0, 1, -1, 2]; k3 = exp(x) - x - 1.
    ref = logprobs + torch.tensor([[0.0, 1.0, -1.0, 2.0]], dtype=torch.float64)
    expected = torch.tensor([[0.0, math.e - 2, math.exp(-1), math.exp(2) - 3]], dtype=torch.float64)
    torch.testing.assert_close(kl_k3(logprobs, ref), expected, atol=1e-12, rtol=0)


def test_kl_k3_exactly_zero_when_equal():
    logprobs = torch.randn(3, 5)
    assert torch.equal(kl_k3(logprobs, logprobs.clone()), torch.zeros(3, 5))


def test_kl_k3_clamps_extremes():
    logprobs = torch.zeros(1, 4, dtype=torch.float64)
    ref = torch.tensor([[30.0, 3.0, -30.0, -5.0]], dtype=torch.float64)
    # 30 -> log ratio clamped to 20, exp(20) - 21 -> clamped to 10.
    # 3 -> exp(3) - 4 = 16.09 -> 10.  -30 -> -20: exp(-20) + 19 = 19.0 -> 10.
    # -5 -> exp(-5) + 4 = 4.006737946999085 (inside the clamp).
    expected = torch.tensor([[10.0, 10.0, 10.0, math.exp(-5) + 4]], dtype=torch.float64)
    torch.testing.assert_close(kl_k3(logprobs, ref), expected, atol=1e-12, rtol=0)
    assert not torch.isinf(kl_k3(torch.zeros(1), torch.tensor([1e6]))).any()


def test_kl_k3_nonnegative():
    g = torch.Generator().manual_seed(0)
    kl = kl_k3(torch.randn(16, 32, generator=g) * 3, torch.randn(16, 32, generator=g) * 3)
    assert (kl >= 0).all()


# ----------------------------------------------------------------- importance weights
def test_sequence_level_ratio_is_exp_of_masked_mean():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    # log ratios row 0: [0.1, 0.3, 5.0 (padding)] -> mean over 2 valid = 0.2;
    # row 1: [-0.4, 0.2, 0.5] all valid -> mean (-0.4 + 0.2 + 0.5) / 3 = 0.1.
    old = logprobs - torch.tensor([[0.1, 0.3, 5.0], [-0.4, 0.2, 0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    lw = log_importance_weights(logprobs, old, mask, "sequence")
    torch.testing.assert_close(lw, torch.tensor([[0.2] * 3, [0.1] * 3]), **ATOL)
    # The ratio exp(0.2) = 1.2214 and exp(0.1) = 1.1052 sit inside [0.5, 1.5]: no clipping, and
    # the per-token loss is -ratio on every position of the row.
    loss, _ = policy_loss(logprobs, old, torch.ones(2), mask, epsilon_low=0.5, epsilon_high=0.5,
                          importance_sampling_level="sequence")
    expected = -torch.tensor([[math.exp(0.2)] * 3, [math.exp(0.1)] * 3])
    torch.testing.assert_close(loss.detach(), expected, **ATOL)


def test_sequence_gradient_spreads_over_valid_tokens():
    logprobs = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    lw = log_importance_weights(logprobs, torch.randn(2, 4), mask, "sequence")
    lw[0, 3].backward()  # any position of row 0 carries the row's mean
    expected = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert torch.equal(logprobs.grad, expected)


def test_sequence_token_has_sequence_value_and_token_gradient():
    g = torch.Generator().manual_seed(3)
    logprobs = torch.randn(2, 4, generator=g, requires_grad=True)
    old = torch.randn(2, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    seq = log_importance_weights(logprobs, old, mask, "sequence")
    seq_tok = log_importance_weights(logprobs, old, mask, "sequence_token")
    torch.testing.assert_close(seq_tok, seq.detach(), **ATOL)
    seq_tok.sum().backward()
    assert torch.equal(logprobs.grad, torch.ones(2, 4))  # d/dlogprobs_t of itself only


def test_token_level_and_bad_level():
    lp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -1.0]])
    assert log_importance_weights(lp, old, torch.ones(1, 2), "token").tolist() == [[0.5, -1.0]]
    with pytest.raises(ValueError, match="importance_sampling_level"):
        log_importance_weights(lp, old, torch.ones(1, 2), "seq")


# ----------------------------------------------------------------------- policy_loss
def _two_by_three():
    # Row 0 (A = +1) ratios [1.5, 1.1, 0.5]; row 1 (A = -1) ratios [0.5, 1.1, 3.0].
    ratios = torch.tensor([[1.5, 1.1, 0.5], [0.5, 1.1, 3.0]], dtype=torch.float64)
    logprobs = torch.tensor([[-1.0, -2.0, -0.7], [-0.3, -1.2, -2.2]], dtype=torch.float64)
    old = logprobs - ratios.log()
    return logprobs, old, torch.tensor([1.0, -1.0], dtype=torch.float64), torch.ones(2, 3)


def test_policy_loss_by_hand_with_clipping_and_delta():
    logprobs, old, adv, mask = _two_by_three()
    loss, info = policy_loss(logprobs, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                             delta=2.0)
    # Clip range [0.8, 1.28].
    # Row 0, A=+1: -min(r, clip(r)): 1.5 -> -min(1.5, 1.28) = -1.28; 1.1 -> -1.1;
    #   0.5 -> -min(0.5, 0.8) = -0.5.
    # Row 1, A=-1: max(r, clip(r)): 0.5 -> max(0.5, 0.8) = 0.8; 1.1 -> 1.1;
    #   3.0 -> delta caps r at 2.0 -> max(2.0, 1.28) = 2.0.
    expected = torch.tensor([[-1.28, -1.1, -0.5], [0.8, 1.1, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)
    assert info["high_clip"].tolist() == [[True, False, False], [False, False, False]]
    assert info["low_clip"].tolist() == [[False, False, False], [True, False, False]]
    assert "kl" not in info


def test_policy_loss_without_delta():
    logprobs, old, adv, mask = _two_by_three()
    loss, _ = policy_loss(logprobs, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28)
    # Only row 1 col 2 changes: max(3.0, 1.28) = 3.0.
    expected = torch.tensor([[-1.28, -1.1, -0.5], [0.8, 1.1, 3.0]], dtype=torch.float64)
    torch.testing.assert_close(loss, expected, atol=1e-12, rtol=0)


def test_on_policy_gradient_is_minus_advantage():
    g = torch.Generator().manual_seed(5)
    logprobs = torch.randn(3, 4, generator=g, requires_grad=True)
    adv = torch.tensor([0.7, -1.3, 0.0])
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, torch.ones(3, 4),
                          epsilon_low=0.2, epsilon_high=0.2)
    assert torch.equal(loss.detach(), -adv[:, None].expand(3, 4))  # ratio is exactly 1
    loss.sum().backward()
    assert torch.equal(logprobs.grad, -adv[:, None].expand(3, 4))


def test_on_policy_gradient_sequence_level():
    logprobs = torch.randn(2, 3, requires_grad=True)
    adv, mask = torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, mask, epsilon_low=0.2,
                          epsilon_high=0.2, importance_sampling_level="sequence")
    loss[:, 0].sum().backward()  # one position per row: -A * d(mean log ratio)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(logprobs.grad, expected, **ATOL)


def test_kl_term_added_with_beta():
    logprobs, old, adv, mask = _two_by_three()
    ref = logprobs + torch.tensor([[0.0, 1.0, -1.0], [2.0, 0.5, -0.5]], dtype=torch.float64)
    base, _ = policy_loss(logprobs, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28)
    with_kl, info = policy_loss(logprobs, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                                ref_logprobs=ref, beta=0.1)
    k3 = lambda x: math.exp(x) - x - 1  # noqa: E731
    kl = torch.tensor([[0.0, k3(1.0), k3(-1.0)], [k3(2.0), k3(0.5), k3(-0.5)]], dtype=torch.float64)
    torch.testing.assert_close(info["kl"], kl, atol=1e-12, rtol=0)
    torch.testing.assert_close(with_kl - base, 0.1 * kl, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logprobs, old, adv, mask, epsilon_low=0.2, epsilon_high=0.2, beta=0.1)


# -------------------------------------------------------------------- aggregate_loss
LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])  # valid: 1, 2 | 4 -> sum 7 over 3 tokens


def _agg(loss_type, loss=LOSS, mask=MASK, **kw):
    step = dict(num_sequences=2, num_tokens=3, max_completion_length=3, num_micro_batches=1)
    step.update(kw)
    return aggregate_loss(loss, mask, loss_type, **step).item()


def test_aggregate_by_hand():
    # grpo: sequence means (1+2)/2 = 1.5 and 4/1 = 4 -> (1.5 + 4) / num_sequences.
    assert _agg("grpo") == pytest.approx(5.5 / 2)
    assert _agg("grpo", num_sequences=4) == pytest.approx(5.5 / 4)
    # bnpo: 7 / 3 tokens, / num_micro_batches.
    assert _agg("bnpo") == pytest.approx(7 / 3)
    assert _agg("bnpo", num_micro_batches=2) == pytest.approx(7 / 6)
    # dr_grpo: 7 / (num_sequences * max_completion_length).
    assert _agg("dr_grpo") == pytest.approx(7 / 6)
    assert _agg("dr_grpo", max_completion_length=4) == pytest.approx(7 / 8)
    # dapo: 7 / step tokens (clamped to 1).
    assert _agg("dapo") == pytest.approx(7 / 3)
    assert _agg("dapo", num_tokens=10) == pytest.approx(0.7)
    assert _agg("dapo", num_tokens=torch.tensor(10)) == pytest.approx(0.7)
    assert _agg("dapo", mask=torch.zeros(2, 3), num_tokens=0) == 0.0


def test_aggregate_fully_masked_sequence_and_nan_padding():
    loss = torch.cat([LOSS, torch.tensor([[7.0, 8.0, 9.0]])])
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    # The empty sequence adds 0 but counts: (1.5 + 4 + 0) / 3.
    assert _agg("grpo", loss, mask, num_sequences=3) == pytest.approx(5.5 / 3)
    # NaN on padding never leaks into the loss.
    loss[0, 2] = loss[2, 0] = float("nan")
    expected = {"grpo": 5.5 / 3, "bnpo": 7 / 3, "dr_grpo": 7 / 9, "dapo": 7 / 3}
    for loss_type, value in expected.items():
        assert _agg(loss_type, loss, mask, num_sequences=3) == pytest.approx(value)


def test_aggregate_unknown_type():
    with pytest.raises(ValueError, match="loss_type"):
        _agg("token_mean")


def test_masked_mean():
    assert masked_mean(LOSS, MASK).item() == pytest.approx(7 / 3)
    torch.testing.assert_close(masked_mean(LOSS, MASK, dim=-1), torch.tensor([1.5, 4.0]))


# ------------------------------------------------------------------- split invariance
LENGTHS = [1, 3, 5, 8, 2, 7, 4, 6]  # 8 completions, T = 8, 36 valid tokens


def _step():
    g = torch.Generator().manual_seed(11)
    logprobs = (-torch.rand(8, 8, generator=g, dtype=torch.float64) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(8, 8, generator=g, dtype=torch.float64)
    ref = logprobs.detach() + 0.3 * torch.randn(8, 8, generator=g, dtype=torch.float64)
    adv = torch.randn(8, generator=g, dtype=torch.float64)
    mask = (torch.arange(8)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return logprobs, old, ref, adv, mask


# Each split: a list of ranks, each a list of micro-batches (row indices).
SPLITS = {
    "1x8": [[list(range(8))]],
    "2x4": [[[0, 1, 2, 3], [4, 5, 6, 7]]],
    "4x2": [[[0, 1], [2, 3], [4, 5], [6, 7]]],
    "8x1": [[[i] for i in range(8)]],
    "2 ranks x 2x2": [[[0, 2], [4, 6]], [[1, 3], [5, 7]]],
    "2 ranks uneven": [[[7], [0, 5, 2]], [[1, 3, 4], [6]]],
}


def _step_loss(loss_type, split, logprobs, old, ref, adv, mask):
    micro_batches = [mb for rank in split for mb in rank]
    total = logprobs.new_zeros(())
    for rows in micro_batches:
        rows = torch.tensor(rows)
        per_token, _ = policy_loss(logprobs[rows], old[rows], adv[rows], mask[rows],
                                   epsilon_low=0.2, epsilon_high=0.28, delta=2.0,
                                   ref_logprobs=ref[rows], beta=0.04)
        total = total + aggregate_loss(per_token, mask[rows], loss_type, num_sequences=8,
                                       num_tokens=int(mask.sum()), max_completion_length=8,
                                       num_micro_batches=len(micro_batches))
    (grad,) = torch.autograd.grad(total, logprobs)
    return total.detach(), grad


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("split", list(SPLITS))
def test_step_loss_is_split_invariant(loss_type, split):
    logprobs, old, ref, adv, mask = _step()
    loss_1, grad_1 = _step_loss(loss_type, SPLITS["1x8"], logprobs, old, ref, adv, mask)
    loss_s, grad_s = _step_loss(loss_type, SPLITS[split], logprobs, old, ref, adv, mask)
    torch.testing.assert_close(loss_s, loss_1, **ATOL)
    torch.testing.assert_close(grad_s, grad_1, **ATOL)
    assert grad_1.abs().sum() > 0


def test_unsplit_values_match_definitions():
    logprobs, old, ref, adv, mask = _step()
    per_token, _ = policy_loss(logprobs, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                               delta=2.0, ref_logprobs=ref, beta=0.04)
    per_token = per_token.detach()
    lengths = torch.tensor(LENGTHS, dtype=torch.float64)
    row_sums = (per_token * mask).sum(-1)
    for loss_type, value in [("grpo", (row_sums / lengths).mean()),
                             ("dr_grpo", row_sums.sum() / (8 * 8)),
                             ("dapo", row_sums.sum() / 36),
                             ("bnpo", row_sums.sum() / 36)]:
        got, _ = _step_loss(loss_type, SPLITS["1x8"], logprobs, old, ref, adv, mask)
        torch.testing.assert_close(got, value, **ATOL)


def test_bnpo_is_mean_of_micro_batch_token_means_and_depends_on_split():
    # bnpo is TRL's local definition: each micro-batch's token mean, averaged over
    # micro-batches. Micro-batches hold different token counts, so the step loss changes with
    # the split; that is why it is left out of the invariance test above.
    logprobs, old, ref, adv, mask = _step()
    per_token, _ = policy_loss(logprobs, old, adv, mask, epsilon_low=0.2, epsilon_high=0.28,
                               delta=2.0, ref_logprobs=ref, beta=0.04)
    per_token = per_token.detach()
    def token_mean(rows):
        return (per_token[rows] * mask[rows]).sum() / mask[rows].sum()

    expected = (token_mean([0, 1, 2, 3]) + token_mean([4, 5, 6, 7])) / 2
    got, _ = _step_loss("bnpo", SPLITS["2x4"], logprobs, old, ref, adv, mask)
    torch.testing.assert_close(got, expected, **ATOL)
    unsplit, _ = _step_loss("bnpo", SPLITS["1x8"], logprobs, old, ref, adv, mask)
    assert abs(got - unsplit) > 1e-3


def test_logprob_mismatch_masks_and_summarises():
    from swift_megatron.rlhf.grpo.losses import logprob_mismatch
    trainer = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, -0.5, -0.5]])
    engine = torch.tensor([[-1.5, -2.0, 0.0], [-0.5, -0.25, -0.5]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # masked diffs: 0.5, 0, (5 masked), 0, 0.25, 0 -> mean 0.75 / 5 = 0.15, max 0.5
    assert logprob_mismatch(trainer, engine, mask) == pytest.approx({"mean": 0.15, "max": 0.5})
