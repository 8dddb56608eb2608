"""The loss types beyond the clipped surrogate (cispo, sapo, fipo, real), the token masks
(entropy, off-policy sequences), the rollout importance-sampling modes, on-policy distillation's
per-token advantages and --kl_in_reward's sequence KL, against hand-computed values; plus the
split invariance of the step loss for the new types."""
import math

import pytest
import torch

from swift_megatron.rlhf.grpo.losses import (FipoSettings, aggregate_loss, entropy_mask,
                                             fipo_weights, future_kl, off_policy_keep,
                                             policy_loss, real_group_loss, real_kl_term,
                                             rollout_correction, sequence_kl, token_advantages)

F64 = torch.float64
EXACT = dict(atol=1e-12, rtol=0)


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def _with_ratios(ratios, logprobs):
    """(logprobs, old) with exp(logprobs - old) = ratios."""
    logprobs = torch.tensor(logprobs, dtype=F64, requires_grad=True)
    return logprobs, logprobs.detach() - torch.tensor(ratios, dtype=F64).log()


# ------------------------------------------------------------------------------- cispo
def test_cispo_by_hand():
    logprobs, old = _with_ratios([[0.5, 6.0], [7.0, 1.0]], [[-1.0, -2.0], [-0.5, -3.0]])
    loss, info = policy_loss(logprobs, old, torch.tensor([2.0, -1.0], dtype=F64), torch.ones(2, 2),
                             epsilon_low=0.2, epsilon_high=5.0, loss_type="cispo")
    # weight = sg(min(r, 5)): [[0.5, 5], [5, 1]]; loss = -weight * A * logprobs:
    # row 0 (A = 2): -0.5*2*(-1) = 1, -5*2*(-2) = 20; row 1 (A = -1): 5*(-0.5), 1*(-3).
    torch.testing.assert_close(loss.detach(), torch.tensor([[1.0, 20.0], [-2.5, -3.0]], dtype=F64),
                               **EXACT)
    assert info["high_clip"].tolist() == [[False, True], [False, False]]  # r > 5 and A > 0
    assert "low_clip" not in info
    loss.sum().backward()  # the weight is a constant: d/dlogprobs = -weight * A
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0, -10.0], [5.0, 1.0]], dtype=F64),
                               **EXACT)


# -------------------------------------------------------------------------------- sapo
def test_sapo_by_hand():
    logprobs, old = _with_ratios([[1.5, 1.0], [0.5, 1.0]], [[-1.0, -2.0], [-0.5, -3.0]])
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    loss, info = policy_loss(logprobs, old, adv, torch.ones(2, 2), epsilon_low=0.2,
                             epsilon_high=0.2, loss_type="sapo", tau_pos=1.0, tau_neg=2.0)
    # gate = sigmoid(tau (r - 1)) * 4 / tau; loss = -gate * A.
    # A > 0 (tau_pos 1): r 1.5 -> 4 sigmoid(0.5); r 1 -> 4 * 0.5 = 2.
    # A < 0 (tau_neg 2): r 0.5 -> sigmoid(-1) * 2; r 1 -> 0.5 * 2 = 1.
    expected = [[-4 * sigmoid(0.5), -2.0], [2 * 2 * sigmoid(-1.0), 2 * 1.0]]
    torch.testing.assert_close(loss.detach(), torch.tensor(expected, dtype=F64), **EXACT)
    assert info == {}  # no hard clipping
    # d loss / d logprobs = -A * gate'(r) * r, gate'(r) = 4 sigmoid(x)(1 - sigmoid(x)), x = tau (r - 1)
    loss.sum().backward()
    d = lambda r, tau: 4 * sigmoid(tau * (r - 1)) * (1 - sigmoid(tau * (r - 1))) * r  # noqa: E731
    expected_grad = [[-1.0 * d(1.5, 1.0), -1.0], [2.0 * d(0.5, 2.0), 2.0]]  # r = 1: -A exactly
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected_grad, dtype=F64), **EXACT)


# -------------------------------------------------------------------------------- fipo
def test_future_kl_by_hand_and_chunking():
    log_ratio = torch.tensor([[0.1, -0.2, 0.3, 9.0], [5.0, 0.1, -0.2, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0]])
    # gamma 0.5. Row 0: FKL_2 = 0.3, FKL_1 = -0.2 + 0.5 * 0.3 = -0.05,
    #   FKL_0 = 0.1 + 0.5 * (-0.2) + 0.25 * 0.3 = 0.075; the masked 9.0 is left out.
    # Row 1 (prompt position first): FKL_2 = -0.2, FKL_1 = 0.1 - 0.1 = 0.
    expected = torch.tensor([[0.075, -0.05, 0.3, 0.0], [0.0, 0.0, -0.2, 0.0]], dtype=F64)
    torch.testing.assert_close(future_kl(log_ratio, mask, 0.5), expected, **EXACT)
    torch.testing.assert_close(future_kl(log_ratio, mask, 0.5, chunk=1), expected, **EXACT)
    torch.testing.assert_close(future_kl(log_ratio, mask, 0.5, chunk=3), expected, **EXACT)


def test_fipo_weights_clip_safety_and_delta():
    log_ratio = torch.tensor([[0.1, -0.2, 0.3]], dtype=F64).repeat(2, 1)
    mask = torch.ones(2, 3)
    ratio = torch.tensor([[1.0, 1.0, 1.0], [5.0, 1.0, 5.0]], dtype=F64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=F64)
    e = [math.exp(0.075), math.exp(-0.05), math.exp(0.3)]  # 1.0779, 0.9512, 1.3499
    high_only = FipoSettings(decay_rate=1.0, clip_range=0.2, clip_high_only=True,
                             safety_threshold=None)
    weight, info = fipo_weights(log_ratio, ratio, adv, mask, high_only)
    # clipped to [1, 1.2]
    torch.testing.assert_close(weight[0], torch.tensor([e[0], 1.0, 1.2], dtype=F64), **EXACT)
    both = FipoSettings(decay_rate=1.0, clip_range=0.2, clip_high_only=False, safety_threshold=4.0)
    weight, info = fipo_weights(log_ratio, ratio, adv, mask, both)
    # Row 0: [0.8, 1.2] clip. Row 1: A < 0 and r = 5 > 4 on tokens 0 and 2 -> within [0.8, 1].
    torch.testing.assert_close(weight, torch.tensor([[e[0], e[1], 1.2], [1.0, e[1], 1.0]],
                                                    dtype=F64), **EXACT)
    assert info["safety_keep"].tolist() == [[True] * 3, [False, True, False]]
    # delta 3: row 1's tokens 0 and 2 (r = 5 > 3) leave the sum: FKL_1 = -0.2, FKL_0 = -0.1.
    no_clip = FipoSettings(decay_rate=1.0, clip_range=None, safety_threshold=None)
    weight, info = fipo_weights(log_ratio, ratio, adv, mask, no_clip, delta=3.0)
    torch.testing.assert_close(info["future_kl"][1], torch.tensor([-0.1, -0.2, 0.0], dtype=F64),
                               **EXACT)
    torch.testing.assert_close(weight[1], torch.tensor([math.exp(-0.1), math.exp(-0.2), 1.0],
                                                       dtype=F64), **EXACT)


def test_fipo_loss_is_weighted_clipped_surrogate():
    logprobs, old = _with_ratios([[1.1, 0.9, 1.5]], [[-1.0, -2.0, -0.5]])
    fipo = FipoSettings(decay_rate=1.0, clip_range=None, safety_threshold=None)
    loss, info = policy_loss(logprobs, old, torch.tensor([1.0], dtype=F64), torch.ones(1, 3),
                             epsilon_low=0.2, epsilon_high=0.2, loss_type="fipo", fipo=fipo)
    lr = [math.log(1.1), math.log(0.9), math.log(1.5)]
    fkl = [lr[0] + 0.5 * lr[1] + 0.25 * lr[2], lr[1] + 0.5 * lr[2], lr[2]]
    # clipped surrogate, A = 1: -min(r, clip(r, 0.8, 1.2)) = [-1.1, -0.9, -1.2]
    expected = [-1.1 * math.exp(fkl[0]), -0.9 * math.exp(fkl[1]), -1.2 * math.exp(fkl[2])]
    torch.testing.assert_close(loss.detach(), torch.tensor([expected], dtype=F64), **EXACT)
    assert info["high_clip"].tolist() == [[False, False, True]]


# -------------------------------------------------------------------------------- real
def _real_group(scores, mask_len=2):
    """logprobs / old whose per-completion mean log ratio is `scores` (two tokens each)."""
    old = torch.zeros(len(scores), mask_len, dtype=F64)
    logprobs = torch.tensor(scores, dtype=F64)[:, None].repeat(1, mask_len).requires_grad_()
    return logprobs, old


def test_real_group_loss_by_hand():
    # Group 3: scores [0.2, -0.4, 0.1, 0.0], A [+, -, +, -]; group 8: all A > 0 -> no loss.
    logprobs, old = _real_group([0.2, -0.4, 0.1, 0.0, 0.5, 0.5, 0.5, 0.5])
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, 2.0, 1.0, 1.0], dtype=F64)
    groups = torch.tensor([3, 3, 3, 3, 8, 8, 8, 8])
    total, valid = real_group_loss(logprobs, old, adv, torch.ones(8, 2), groups, tau=0.5,
                                   group_size=4)
    # negatives: log(1 + e^(-0.4/0.5) + e^(0/0.5)); positives: log(1 + e^(-0.2/0.5) + e^(-0.1/0.5))
    neg = math.log(1 + math.exp(-0.8) + 1.0)
    pos = math.log(1 + math.exp(-0.4) + math.exp(-0.2))
    assert total.item() == pytest.approx(neg + pos, abs=1e-12)
    assert valid == 1
    total.backward()
    # d/ds_j: negatives (1/tau) e^(s_j/tau) / (1 + sum); positives -(1/tau) e^(-s_j/tau) / (1 + sum);
    # each score is the mean of two tokens, so every token gets half.
    zn, zp = 1 + math.exp(-0.8) + 1.0, 1 + math.exp(-0.4) + math.exp(-0.2)
    per_score = [-2 * math.exp(-0.4) / zp, 2 * math.exp(-0.8) / zn, -2 * math.exp(-0.2) / zp,
                 2 * 1.0 / zn] + [0.0] * 4
    expected = torch.tensor(per_score, dtype=F64)[:, None].repeat(1, 2) / 2
    torch.testing.assert_close(logprobs.grad, expected, **EXACT)


def test_real_needs_whole_groups():
    logprobs, old = _real_group([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="whole groups of 2"):
        real_group_loss(logprobs, old, torch.ones(3, dtype=F64), torch.ones(3, 2),
                        torch.tensor([0, 0, 1]), tau=0.5, group_size=2)


def test_real_group_order_does_not_matter():
    logprobs, old = _real_group([0.3, -0.1, 0.2, 0.4])
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64)
    groups = torch.tensor([1, 0, 1, 0])
    total, valid = real_group_loss(logprobs, old, adv, torch.ones(4, 2), groups, 1.0, 2)
    # group 0: s = [-0.1 (neg), 0.4 (pos)]; group 1: s = [0.3 (pos), 0.2 (neg)]
    expected = (math.log(1 + math.exp(-0.1)) + math.log(1 + math.exp(-0.4))
                + math.log(1 + math.exp(0.2)) + math.log(1 + math.exp(-0.3)))
    assert (total.item(), valid) == (pytest.approx(expected, abs=1e-12), 2)


# ------------------------------------------------------------------------ entropy mask
def test_entropy_mask_keeps_the_top_quantile():
    entropy = torch.tensor([[0.1, 0.5, 0.9, 7.0], [0.3, 0.7, 0.2, 0.4]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    # completion entropies sorted: 0.1 0.2 0.3 0.4 0.5 0.7 0.9; the 0.6 quantile sits at
    # 0.6 * 6 = 3.6 -> 0.4 + 0.6 * (0.5 - 0.4) = 0.46 (the masked 7.0 is not counted)
    kept = entropy_mask(entropy, mask, top_quantile=0.4)
    assert kept.tolist() == [[False, True, True, False], [False, True, False, False]]
    assert entropy_mask(entropy, mask, 1.0).tolist() == mask.bool().tolist()
    assert not entropy_mask(entropy, torch.zeros(2, 4), 0.5).any()


def test_token_mask_drops_the_policy_term_not_the_kl():
    logprobs, old = _with_ratios([[1.0, 1.0]], [[-1.0, -2.0]])
    ref = logprobs.detach() + torch.tensor([[1.0, 1.0]], dtype=F64)
    loss, _ = policy_loss(logprobs, old, torch.tensor([3.0], dtype=F64), torch.ones(1, 2),
                          epsilon_low=0.2, epsilon_high=0.2, ref_logprobs=ref, beta=0.1,
                          token_mask=torch.tensor([[True, False]]))
    k3 = math.e - 2  # exp(1) - 1 - 1
    torch.testing.assert_close(loss.detach(), torch.tensor([[-3.0 + 0.1 * k3, 0.1 * k3]],
                                                           dtype=F64), **EXACT)


# ------------------------------------------------------------- rollout importance sampling
def test_rollout_correction_four_modes_by_hand():
    rollout = torch.zeros(2, 3)
    old = torch.tensor([[0.5, -1.0, 3.0], [1.0, 0.5, 30.0]])   # old - rollout; col 2 of row 0 masked
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    e = math.exp
    # row 1's third log ratio is clamped to 20; its mean (1 + 0.5 + 20) / 3 = 7.1667
    seq = [e(-0.25), e(21.5 / 3)]
    cases = {
        "token_truncate": [[1.5, e(-1.0), 1.0], [1.5, 1.5, 1.5]],
        "token_mask": [[0.0, e(-1.0), 1.0], [0.0, 0.0, 0.0]],
        "sequence_truncate": [[seq[0], seq[0], 1.0], [1.5, 1.5, 1.5]],
        "sequence_mask": [[e(0.5), e(-1.0), 1.0], [0.0, 0.0, 0.0]],
    }
    # token_mask: e(0.5) = 1.65, e(1) = 2.72 and e(20) exceed 1.5 -> 0
    for mode, expected in cases.items():
        got = rollout_correction(old, rollout, mask, mode, threshold=1.5)
        torch.testing.assert_close(got, torch.tensor(expected), atol=1e-6, rtol=0, msg=mode)
    with pytest.raises(ValueError):
        rollout_correction(old, rollout, mask, "clip", 2.0)


def test_off_policy_keep_by_hand():
    logprobs = torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0], [-1.0, -1.0, 0.0]])
    behaviour = torch.tensor([[-0.5, -0.7, 9.0], [-0.5, -0.7, 9.0], [-0.9, -0.9, 9.0]])
    mask = torch.tensor([[1, 1, 0]] * 3)
    # drift = mean(behaviour - logprobs): rows 0, 1 -> (0.5 + 0.3) / 2 = 0.4; row 2 -> 0.1
    keep = off_policy_keep(logprobs, behaviour, mask, torch.tensor([-1.0, 1.0, -1.0]), delta=0.3)
    assert keep.tolist() == [False, True, True]   # only row 0: drift > 0.3 and A < 0


def _real_micro_batch():
    """Two groups of two completions (A +, -), two tokens each, on-policy (every REAL score 0);
    the engine's logprobs of completion 1 (A < 0) lie 0.5 above the trainer's: dropped by an
    off-policy mask of delta 0.3. ref - logprobs per token: c0 [0.1, 0.2], c1 [1, 1],
    c2 [0, 0.3], c3 [-0.2, 0]."""
    logprobs = torch.tensor([[-1.0, -2.0], [-1.5, -0.5], [-0.3, -0.7], [-2.0, -1.0]], dtype=F64)
    gaps = torch.tensor([[0.1, 0.2], [1.0, 1.0], [0.0, 0.3], [-0.2, 0.0]], dtype=F64)
    batch = {"completion_mask": torch.ones(4, 2, dtype=torch.long),
             "advantages": torch.tensor([1.0, -1.0, 1.0, -1.0], dtype=F64),
             "group_ids": torch.tensor([0, 0, 1, 1]), "ref_logprobs": logprobs + gaps,
             "rollout_logprobs": logprobs + torch.tensor([[0.0], [0.5], [0.0], [0.0]], dtype=F64)}
    return logprobs, gaps, batch


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_real_kl_averages_over_the_kept_tokens(monkeypatch, micro_batches):
    """--loss_type real with --beta and --off_policy_sequence_mask_delta (issue 40): the KL
    term is the mean over the KEPT completions' tokens (ms-swift's), not their sum over every
    token of the step; each of the step's micro-batches adds its own mean / micro-batches."""
    from swift_megatron.rlhf.grpo import objective

    logprobs, gaps, batch = _real_micro_batch()
    monkeypatch.setattr(objective, "token_logprobs", lambda mb, out, settings, with_entropy:
                        (logprobs.clone().requires_grad_(), torch.zeros_like(logprobs)))
    settings = objective.LossSettings(
        loss_type="real", beta=0.1, epsilon=0.2, epsilon_high=0.2, delta=None,
        importance_sampling_level="token", temperature=1.0, max_completion_length=2,
        vocab_size=10, num_generations=2, real_tau=0.5, off_policy_sequence_mask_delta=0.3)
    step = objective.StepConstants(num_sequences=4 * micro_batches, num_tokens=8.0 * micro_batches,
                                   num_micro_batches=micro_batches, contribution_scale=1.0)
    contribution, metrics = objective.grpo_loss(settings, step, batch, None)
    kl = [math.exp(d) - d - 1 for row in (0, 2, 3) for d in gaps[row].tolist()]   # c1 dropped
    # both groups hold a positive and a negative (the dropped completion keeps its advantage,
    # its score is 0 like the others'): 2 x (log 2 + log 2) / 2 groups of the step
    groups = 2 * (2 * math.log(2)) / (2 * micro_batches)
    expected = groups + 0.1 * sum(kl) / 6 / micro_batches
    assert contribution.item() == pytest.approx(expected, abs=1e-12)
    assert metrics["kl"].item() == pytest.approx(sum(kl) / 6, abs=1e-12)


def test_real_kl_term_by_hand():
    kl = torch.tensor([[0.2, 0.4, 9.0], [1.0, 3.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])   # a dropped completion: all zeros
    assert real_kl_term(kl, mask, 2).item() == pytest.approx(0.3 / 2, abs=1e-12)
    assert real_kl_term(kl, torch.zeros(2, 3), 1).item() == 0.0   # nothing kept adds nothing
    with pytest.raises(ValueError, match="num_micro_batches"):
        real_kl_term(kl, mask, 0)


# ------------------------------------------------------------ distillation, kl_in_reward
def test_token_advantages_by_hand():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]])
    teacher = torch.tensor([[-0.5, -3.0, 8.0], [-0.5, -1.5, -0.25]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = token_advantages(torch.tensor([1.0, -2.0]), mask, teacher, old, teacher_kl_coef=0.5)
    # A + 0.5 * (teacher - old) on masked tokens: row 0 gaps [0.5, -1.0] (third masked: A)
    expected = torch.tensor([[1.25, 0.5, 1.0], [-2.0, -2.5, -1.875]])
    torch.testing.assert_close(adv, expected, atol=1e-7, rtol=0)


def test_per_token_advantages_in_policy_loss():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[0.5, -3.0]], dtype=F64)
    loss, _ = policy_loss(logprobs, logprobs.detach(), adv, torch.ones(1, 2), epsilon_low=0.2,
                          epsilon_high=0.2)
    loss.sum().backward()
    torch.testing.assert_close(logprobs.grad, -adv, **EXACT)
    with pytest.raises(ValueError, match="advantages must be"):
        policy_loss(logprobs, logprobs.detach(), torch.ones(3), torch.ones(1, 2),
                    epsilon_low=0.2, epsilon_high=0.2)


def test_sequence_kl_by_hand():
    old = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, -0.5, -0.5]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -0.5, -0.25]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # row 0: 0.5 - 1.0 = -0.5 (masked 5.0 left out); row 1: 0.5 + 0 - 0.25 = 0.25
    torch.testing.assert_close(sequence_kl(old, ref, mask), torch.tensor([-0.5, 0.25]))


# ------------------------------------------------------------------- split invariance
LENGTHS = [1, 3, 5, 8, 2, 7, 4, 6]  # 8 completions in 4 groups of 2, T = 8


def _step():
    g = torch.Generator().manual_seed(11)
    logprobs = (-torch.rand(8, 8, generator=g, dtype=F64) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(8, 8, generator=g, dtype=F64)
    adv = torch.randn(8, generator=g, dtype=F64)
    mask = (torch.arange(8)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    return logprobs, old, adv, mask


SPLITS = {"1x8": [list(range(8))], "2x4": [[0, 1, 2, 3], [4, 5, 6, 7]],
          "4x2 (two ranks)": [[0, 1], [4, 5], [2, 3], [6, 7]], "8x1": [[i] for i in range(8)]}


def _step_loss(loss_type, split, logprobs, old, adv, mask):
    total = logprobs.new_zeros(())
    for rows in map(torch.tensor, split):
        if loss_type == "real":
            loss, _ = real_group_loss(logprobs[rows], old[rows], adv[rows], mask[rows],
                                      rows // 2, tau=0.5, group_size=2)
            total = total + loss / 4   # / groups in the step
            continue
        per_token, _ = policy_loss(logprobs[rows], old[rows], adv[rows], mask[rows],
                                   epsilon_low=0.2, epsilon_high=5.0 if loss_type == "cispo" else 0.28,
                                   loss_type=loss_type, fipo=FipoSettings(decay_rate=2.0))
        total = total + aggregate_loss(per_token, mask[rows], loss_type, num_sequences=8,
                                       num_tokens=int(mask.sum()), max_completion_length=8,
                                       num_micro_batches=len(split))
    (grad,) = torch.autograd.grad(total, logprobs)
    return total.detach(), grad


@pytest.mark.parametrize("loss_type,split", [
    (loss_type, split) for loss_type in ("cispo", "sapo", "fipo", "real")
    for split in ("2x4", "4x2 (two ranks)", "8x1")
    if not (loss_type == "real" and split == "8x1")])  # real needs whole groups of 2
def test_new_loss_types_are_split_invariant(loss_type, split):
    step = _step()
    loss_1, grad_1 = _step_loss(loss_type, SPLITS["1x8"], *step)
    loss_s, grad_s = _step_loss(loss_type, SPLITS[split], *step)
    torch.testing.assert_close(loss_s, loss_1, atol=1e-12, rtol=0)
    torch.testing.assert_close(grad_s, grad_1, atol=1e-12, rtol=0)
    assert grad_1.abs().sum() > 0
