"""The loss diagnostics (rollout_correction/ metrics, importance-weight statistics, entropy
summaries) against hand-computed values."""
import math

import pytest
import torch

from swift_megatron.rlhf.grpo.diagnostics import (entropy_summary, importance_weight_metrics,
                                                  offpolicy_metrics)


def test_offpolicy_metrics_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, 9.0], [-0.5, -0.5, -1.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, -1.0, -1.25]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    got = {k: v.item() for k, v in offpolicy_metrics(trainer, rollout, mask).items()}
    e = math.exp
    log_rho = [0.5, -1.0, 0.0, 0.5, 0.25]                  # trainer - rollout, masked tokens
    t_mean, r_mean = [-1.5, -2.0 / 3], [-1.25, -2.75 / 3]   # per-completion mean logprobs
    diff = [r - t for r, t in zip(r_mean, t_mean)]          # [0.25, -0.25]
    expected = {
        "training_ppl": (e(1.5) + e(2 / 3)) / 2, "training_log_ppl": (1.5 + 2 / 3) / 2,
        "rollout_ppl": (e(1.25) + e(2.75 / 3)) / 2, "rollout_log_ppl": (1.25 + 2.75 / 3) / 2,
        "kl": -sum(log_rho) / 5,
        "k3_kl": sum(e(x) - x - 1 for x in log_rho) / 5,
        "log_ppl_diff": 0.0, "log_ppl_abs_diff": 0.25, "log_ppl_diff_max": 0.25,
        "log_ppl_diff_min": -0.25, "ppl_ratio": (e(0.25) + e(-0.25)) / 2,
        "chi2_token": sum(e(2 * x) for x in log_rho) / 5 - 1,
        "chi2_seq": (e(-0.5) + e(0.5)) / 2 - 1,   # completion mean log rho: -0.25, 0.25
    }
    assert got == pytest.approx(expected, abs=1e-12)


def test_importance_weight_metrics_by_hand():
    old = torch.tensor([[math.log(3.0), math.log(0.25)]], dtype=torch.float64)
    rollout = torch.zeros(1, 2, dtype=torch.float64)
    weights = torch.tensor([[2.0, 0.25]], dtype=torch.float64)   # token_truncate at 2
    got = importance_weight_metrics(old, rollout, weights, torch.ones(1, 2), "token_truncate", 2.0)
    # ess: weights clamped to [0.5, 2] -> [2, 0.5], mean 1.25, normalised w / (1.25 + 1e-8),
    # mean square (4 + 0.25) / 2 / (1.25 + 1e-8)^2 (about 1.36)
    ess = (1.25 + 1e-8) ** 2 / 2.125
    assert {k: v.item() for k, v in got.items()} == pytest.approx(
        {"is_weight_mean": 1.125, "ess": ess, "clipped_frac": 0.5}, abs=1e-12)
    # sequence modes count completions: exp(mean(log 3, log 0.25)) = sqrt(0.75) <= 2
    seq = importance_weight_metrics(old, rollout, weights, torch.ones(1, 2), "sequence_mask", 2.0)
    assert seq["clipped_frac"].item() == 0.0


def test_entropy_summary_by_hand():
    entropy = torch.tensor([[1.0, 2.0, 9.0], [3.0, 3.0, 3.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    got = {k: v.item() for k, v in entropy_summary(entropy, mask).items()}
    assert got == {"mean": 2.25, "max": 3.0, "min": 1.5}   # completions 1.5 and 3 (third empty)
    empty = entropy_summary(entropy, torch.zeros(3, 3))
    assert {k: v.item() for k, v in empty.items()} == {"mean": 0.0, "max": 0.0, "min": 0.0}
