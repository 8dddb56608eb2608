"""group_advantages and weighted_rewards against hand-computed values."""
import math

import pytest
import torch

from swift_megatron.rlhf.grpo.advantages import (compute_advantages, gdpo_advantages,
                                                 group_advantages, overflow_problem,
                                                 weighted_rewards)

EPS = 1e-4


def test_group_scaling_by_hand():
    # Group 0: rewards [1, 0] -> mean 0.5, deviations [+0.5, -0.5],
    #   unbiased var = (0.25 + 0.25) / (2 - 1) = 0.5, std = sqrt(0.5).
    # Group 1: rewards [1, 1] -> mean 1, std 0 -> advantages 0 / (0 + eps) = 0.
    adv, metrics = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]),
                                    torch.tensor([0, 0, 1, 1]), "group", EPS)
    s = math.sqrt(0.5)
    expected = torch.tensor([0.5 / (s + EPS), -0.5 / (s + EPS), 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    # Batch: mean 0.75, deviations [0.25, -0.75, 0.25, 0.25], sum of squares
    #   3 * 0.0625 + 0.5625 = 0.75, unbiased var 0.75 / 3 = 0.25, std 0.5.
    assert metrics == pytest.approx({"reward_mean": 0.75, "reward_std": 0.5,
                                     "frac_reward_zero_std": 0.5}, abs=1e-7)


def test_batch_and_none_scaling_by_hand():
    rewards, ids = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    centered = torch.tensor([0.5, -0.5, 0.0, 0.0])  # reward - group mean
    adv, _ = group_advantages(rewards, ids, "batch", EPS)
    torch.testing.assert_close(adv, centered / (0.5 + EPS), atol=1e-6, rtol=0)
    adv, _ = group_advantages(rewards, ids, "none", EPS)
    torch.testing.assert_close(adv, centered, atol=1e-6, rtol=0)


def test_three_groups_of_three_by_hand():
    # Group 7: [2, 4, 9] mean 5, deviations [-3, -1, 4], var (9 + 1 + 16) / 2 = 13.
    # Group 2: [0, 3, 0] mean 1, deviations [-1, 2, -1], var (1 + 4 + 1) / 2 = 3.
    # Group 5: [6, 6, 6] std 0.
    rewards = torch.tensor([2.0, 0.0, 6.0, 4.0, 3.0, 6.0, 9.0, 0.0, 6.0])
    ids = torch.tensor([7, 2, 5, 7, 2, 5, 7, 2, 5])
    adv, metrics = group_advantages(rewards, ids, "group", EPS)
    s7, s2 = math.sqrt(13.0), math.sqrt(3.0)
    expected = torch.tensor([-3 / (s7 + EPS), -1 / (s2 + EPS), 0.0,
                             -1 / (s7 + EPS), 2 / (s2 + EPS), 0.0,
                             4 / (s7 + EPS), -1 / (s2 + EPS), 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    # Batch mean 36 / 9 = 4; squares of deviations 4+16+4+0+1+4+25+16+4 = 74; var 74 / 8.
    assert metrics["reward_mean"] == pytest.approx(4.0, abs=1e-6)
    assert metrics["reward_std"] == pytest.approx(math.sqrt(74 / 8), abs=1e-6)
    assert metrics["frac_reward_zero_std"] == pytest.approx(1 / 3, abs=1e-7)


def test_matches_torch_std_per_group_reference():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(48, generator=g, dtype=torch.float64)
    ids = torch.randint(0, 6, (48,), generator=g) * 11
    adv, _ = group_advantages(rewards, ids, "group", EPS)
    for pid in ids.unique():
        sel = ids == pid
        r = rewards[sel]
        ref = (r - r.mean()) / (r.std() + EPS) if r.numel() > 1 else torch.zeros_like(r)
        torch.testing.assert_close(adv[sel], ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_permutation_invariance_is_exact(scale):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(64, generator=g)
    ids = torch.arange(8).repeat_interleave(8)
    adv, metrics = group_advantages(rewards, ids, scale, EPS)
    perm = torch.randperm(64, generator=g)
    adv_p, metrics_p = group_advantages(rewards[perm], ids[perm], scale, EPS)
    assert torch.equal(adv_p, adv[perm])
    assert metrics_p == metrics


def test_interleaved_equals_contiguous():
    rewards = torch.tensor([0.3, 1.7, 0.9, 2.5, 0.1, 1.1, 0.4, 0.8, 3.0])
    contiguous_ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    adv_c, _ = group_advantages(rewards, contiguous_ids)
    # Interleave: position k takes group k % 3, member k // 3.
    idx = torch.tensor([0, 3, 6, 1, 4, 7, 2, 5, 8])
    adv_i, _ = group_advantages(rewards[idx], contiguous_ids[idx])
    assert contiguous_ids[idx].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert torch.equal(adv_i, adv_c[idx])


def test_singleton_group_has_zero_advantage_and_no_nan():
    adv, metrics = group_advantages(torch.tensor([3.0]), torch.tensor([5]))
    assert adv.tolist() == [0.0]
    assert metrics == {"reward_mean": 3.0, "reward_std": 0.0, "frac_reward_zero_std": 1.0}
    # Singleton beside a real group: [2, 4] mean 3, var (1 + 1) / 1 = 2.
    adv, metrics = group_advantages(torch.tensor([2.0, 7.0, 4.0]), torch.tensor([0, 1, 0]))
    assert not torch.isnan(adv).any()
    s = math.sqrt(2.0)
    torch.testing.assert_close(adv, torch.tensor([-1 / (s + EPS), 0.0, 1 / (s + EPS)]),
                               atol=1e-6, rtol=0)
    assert metrics["frac_reward_zero_std"] == 0.5


def test_integer_rewards_are_accepted():
    adv, _ = group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), "none")
    assert adv.tolist() == [0.5, -0.5]


def test_invalid_scale_rewards():
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), "groups")


def test_weighted_rewards_nan_is_zero():
    per_func = torch.tensor([[1.0, float("nan")], [0.5, 2.0], [float("nan"), float("nan")]])
    weights = torch.tensor([1.0, 0.5])
    # Row 0: 1*1 + NaN -> 1; row 1: 0.5*1 + 2*0.5 = 1.5; row 2: all NaN -> 0.
    assert weighted_rewards(per_func, weights).tolist() == [1.0, 1.5, 0.0]
    with pytest.raises(ValueError):
        weighted_rewards(per_func, torch.tensor([1.0]))


# ------------------------------------------------------- estimators, gdpo, kl_in_reward
def test_rloo_is_leave_one_out_by_hand():
    rewards, ids = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    adv, _ = group_advantages(rewards, ids, "none", estimator="rloo")
    # R_0 = 1 minus the mean of the others (0, 0, 1) = 2/3 = 4/3 * (1 - 0.5); group 1: 0.
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0])
    torch.testing.assert_close(adv, expected, atol=1e-7, rtol=0)
    adv, _ = group_advantages(rewards, ids, "group", EPS, estimator="rloo")
    s = math.sqrt(1 / 3)  # group 0: mean 0.5, var (4 * 0.25) / 3
    torch.testing.assert_close(adv, expected / torch.tensor([s + EPS] * 4 + [EPS] * 2),
                               atol=1e-6, rtol=0)
    single, _ = group_advantages(torch.tensor([5.0]), torch.tensor([0]), "none", estimator="rloo")
    assert single.tolist() == [0.0]  # K = 1: R - mean


def test_reinforce_plus_plus_scales_by_std_of_centered_rewards():
    rewards, ids = torch.tensor([1.0, 3.0, 10.0, 10.0]), torch.tensor([0, 0, 1, 1])
    centered = torch.tensor([-1.0, 1.0, 0.0, 0.0])
    adv, _ = group_advantages(rewards, ids, "batch", EPS, estimator="reinforce_plus_plus")
    # std of the centered values: sum of squares 2 over 3 -> sqrt(2/3)
    torch.testing.assert_close(adv, centered / (math.sqrt(2 / 3) + EPS), atol=1e-6, rtol=0)
    grpo, _ = group_advantages(rewards, ids, "batch", EPS)
    # grpo divides by the std of the rewards: deviations from 6: -5 -3 4 4 -> sqrt(66 / 3)
    torch.testing.assert_close(grpo, centered / (math.sqrt(22) + EPS), atol=1e-6, rtol=0)
    adv, _ = group_advantages(rewards, ids, "group", EPS, estimator="reinforce_plus_plus")
    torch.testing.assert_close(adv, centered / torch.tensor([math.sqrt(2) + EPS] * 2 + [EPS] * 2),
                               atol=1e-6, rtol=0)


def test_gdpo_by_hand():
    nan = float("nan")
    per_func = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 0.2], [1.0, 0.4]], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    adv = gdpo_advantages(per_func, torch.tensor([1.0, 2.0], dtype=torch.float64), ids)
    # f1: group 0 [1, 0] -> +-0.5 / (sqrt(0.5) + 1e-8); group 1 [1, 1] -> 0.
    # f2: group 0 has one value (0.5): 0 / 1e-8 = 0, NaN -> 0; group 1 [0.2, 0.4] -> -+0.1 /
    #   (sqrt(0.02) + 1e-8). Weighted sum: [a, -a, -2b, 2b]; mean 0; then / (std + 1e-8).
    a, b = 0.5 / (math.sqrt(0.5) + 1e-8), 0.1 / (math.sqrt(0.02) + 1e-8)
    summed = [a, -a, -2 * b, 2 * b]
    std = math.sqrt(sum(x * x for x in summed) / 3)
    expected = torch.tensor([x / (std + 1e-8) for x in summed], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, atol=1e-12, rtol=0)


def test_compute_advantages_subtracts_beta_kl_before_the_estimator():
    per_func = torch.tensor([[1.0], [0.0], [1.0], [1.0]])
    ids = torch.tensor([0, 0, 1, 1])
    adv, metrics = compute_advantages(per_func, torch.tensor([1.0]), ids, scale_rewards="group",
                                      kl=torch.tensor([0.4, 0.0, 0.0, 2.0]), beta=0.5)
    # shaped rewards [0.8, 0, 1, 0]: group 0 +-0.4 / (sqrt(0.32) + eps), group 1 +-0.5 / ...
    expected = torch.tensor([0.4 / (math.sqrt(0.32) + EPS), -0.4 / (math.sqrt(0.32) + EPS),
                             0.5 / (math.sqrt(0.5) + EPS), -0.5 / (math.sqrt(0.5) + EPS)])
    torch.testing.assert_close(adv, expected, atol=1e-6, rtol=0)
    assert metrics["reward_mean"] == 0.75  # the metrics are of the rewards themselves
    gdpo, _ = compute_advantages(per_func, torch.tensor([1.0]), ids, scale_rewards="gdpo")
    torch.testing.assert_close(gdpo, gdpo_advantages(per_func, torch.tensor([1.0]), ids))
    with pytest.raises(ValueError, match="gdpo"):
        compute_advantages(per_func, torch.tensor([1.0]), ids, scale_rewards="gdpo",
                           kl=torch.zeros(4), beta=0.1)
    # no reward functions (pure distillation): every advantage is 0
    empty, _ = compute_advantages(torch.zeros(4, 0), torch.zeros(0), ids)
    assert empty.tolist() == [0.0] * 4


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_estimators_are_permutation_invariant(estimator, scale):
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(32, generator=g)
    ids = torch.arange(8).repeat_interleave(4)
    adv, _ = group_advantages(rewards, ids, scale, EPS, estimator=estimator)
    perm = torch.randperm(32, generator=g)
    adv_p, _ = group_advantages(rewards[perm], ids[perm], scale, EPS, estimator=estimator)
    assert torch.equal(adv_p, adv[perm])


def test_gdpo_is_permutation_invariant():
    g = torch.Generator().manual_seed(3)
    per_func = torch.rand(24, 3, generator=g, dtype=torch.float64)
    per_func[::5, 1] = float("nan")
    ids, weights = torch.arange(6).repeat_interleave(4), torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    perm = torch.randperm(24, generator=g)
    assert torch.equal(gdpo_advantages(per_func[perm], weights, ids[perm]),
                       gdpo_advantages(per_func, weights, ids)[perm])


def test_rewards_whose_statistics_overflow_are_named():
    """issue 40: a function returning 1e300 (finite, accepted) made reward/std inf, every
    advantage 0 and the run train nothing, silently; now the function is named. Ordinary
    rewards, a None (NaN) among them included, pass."""
    per_func = torch.tensor([[1e300, 0.5], [0.0, math.nan], [2.0, 0.1], [1.0, 0.2]],
                            dtype=torch.float64)
    prompts = torch.tensor([0, 0, 1, 1])
    weights = torch.ones(2, dtype=torch.float64)
    advantages, metrics = compute_advantages(per_func, weights, prompts)
    assert metrics["reward_std"] == math.inf
    problem = overflow_problem(per_func, weights, advantages, metrics, ["huge", "fine"])
    assert problem.startswith("the rewards' statistics are not finite (reward/mean")
    assert "reward function 'huge' returned |reward| up to 1e+300" in problem
    ordinary = per_func.clone()
    ordinary[0, 0] = 3.0
    advantages, metrics = compute_advantages(ordinary, weights, prompts)
    assert overflow_problem(ordinary, weights, advantages, metrics, ["huge", "fine"]) is None


def test_an_overflowing_weight_is_blamed_not_its_reward():
    """issue 57: --reward_weights 1e308 on rewards up to 3.3 blamed the reward function; the
    weight is named now, with its value and the reward's scale."""
    per_func = torch.tensor([[3.3, 0.5], [0.0, 0.2], [2.0, 0.1], [1.0, 0.4]], dtype=torch.float64)
    prompts = torch.tensor([0, 0, 1, 1])
    weights = torch.tensor([1e308, 1.0], dtype=torch.float64)
    advantages, metrics = compute_advantages(per_func, weights, prompts)
    problem = overflow_problem(per_func, weights, advantages, metrics, ["textlen", "fine"])
    assert "--reward_weights gives reward function 'textlen' the weight 1e+308 (its |reward| " \
           "reaches 3.3)" in problem
