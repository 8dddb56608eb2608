"""Dynamic-sampling group selection and overlong masking."""
import torch

from swift_megatron.rlhf.grpo.filtering import (overlong_mask, select_groups, zero_std_groups,
                                                zero_std_prompt_ids)

# Interleaved groups: position k belongs to prompt [0, 1, 2][k % 3].
# Group 0: [1, 1] zero std; group 1: [2, 5] std > 0; group 2: [3, 3 + 1e-8] near-zero std.
REWARDS = torch.tensor([1.0, 2.0, 3.0, 1.0, 5.0, 3.0 + 1e-8], dtype=torch.float64)
IDS = torch.tensor([0, 1, 2, 0, 1, 2])


def test_zero_std_groups_interleaved():
    assert zero_std_groups(REWARDS, IDS).tolist() == [True, False, True, True, False, True]
    # A tolerance below the near-zero std (1e-8 / sqrt(2) ~ 7.1e-9) keeps group 2.
    assert zero_std_groups(REWARDS, IDS, tol=1e-9).tolist() == [True, False, False, True,
                                                                False, False]


def test_zero_std_groups_singleton_and_ints():
    assert zero_std_groups(torch.tensor([4, 1, 4]), torch.tensor([9, 3, 3])).tolist() == \
        [True, False, False]


def test_prompt_ids_to_resample_and_select_groups():
    assert zero_std_prompt_ids(REWARDS, IDS).tolist() == [0, 2]
    keep = select_groups(IDS, torch.tensor([1]))
    assert keep.tolist() == [False, True, False, False, True, False]
    assert select_groups(IDS, torch.tensor([0, 2])).tolist() == [True, False, True, True,
                                                                 False, True]


def test_overlong_mask_zeroes_exactly_truncated_rows():
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    before = mask.clone()
    out = overlong_mask(torch.tensor([False, True, False]), mask)
    assert out.tolist() == [[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert out.dtype == mask.dtype and torch.equal(mask, before)  # input left as is
    bool_out = overlong_mask(torch.tensor([True, False, True]), mask.bool())
    assert bool_out.tolist() == [[False] * 4, [True] * 4, [False] * 4]
