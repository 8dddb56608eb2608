"""Completions -> micro-batches: alignment of tokens, targets, completion mask and logprobs."""
import pytest
import torch

from swift_megatron.rlhf.grpo.batch import Sample, collate, split_micro_batches


def sample(prompt, completion, finish="stop", logprobs=None, advantage=0.0, group_id=0):
    return Sample(group_id=group_id, prompt_id=0, prompt_ids=prompt, completion_ids=completion,
                  rollout_logprobs=logprobs, finish_reason=finish, rewards=[], advantage=advantage)


def test_collate_aligns_targets_and_mask():
    batch = collate([sample([1, 2, 3], [4, 5], logprobs=[-0.5, -0.25], advantage=1.5),
                     sample([7], [8, 9, 10], logprobs=[-1.0, -2.0, -3.0], advantage=-1.0,
                            group_id=5)], pad_id=0)
    # model input: sequence[:-1]; targets: sequence[1:]; right padded to the longest (4)
    assert batch["tokens"].tolist() == [[1, 2, 3, 4], [7, 8, 9, 0]]
    assert batch["targets"].tolist() == [[2, 3, 4, 5], [8, 9, 10, 0]]
    # the mask marks target positions that are completion tokens (4, 5 and 8, 9, 10)
    assert batch["completion_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert batch["rollout_logprobs"].tolist() == [[0, 0, -0.5, -0.25], [-1, -2, -3, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert batch["advantages"].tolist() == [1.5, -1.0]
    assert batch["group_ids"].tolist() == [0, 5]
    # the engine's logprobs only when every sample has them
    assert "rollout_logprobs" not in collate([sample([1], [2], logprobs=[-0.5]), sample([1], [2])],
                                             pad_id=0)


def test_collate_pads_to_multiple_and_filters_overlong():
    batch = collate([sample([1, 2], [3], finish="length"), sample([1], [2, 3])], pad_id=9,
                    pad_to_multiple=4, overlong_filter=True)
    assert batch["tokens"].shape == (2, 4)
    assert batch["truncated"].tolist() == [True, False]
    assert batch["completion_mask"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    unfiltered = collate([sample([1, 2], [3], finish="length")], pad_id=9)
    assert unfiltered["completion_mask"].tolist() == [[0, 1]]


def test_split_micro_batches_checks_divisibility():
    samples = [sample([1], [2]) for _ in range(4)]
    assert len(split_micro_batches(samples, 2, pad_id=0)) == 2
    with pytest.raises(ValueError, match="do not split"):
        split_micro_batches(samples, 3, pad_id=0)


def _sample(prompt, completion):
    return Sample(group_id=0, prompt_id=0, prompt_ids=prompt, completion_ids=completion,
                  rollout_logprobs=None, finish_reason="stop", rewards=[])


def test_packed_layout_and_unpack():
    from swift_megatron.rlhf.grpo.batch import unpack

    samples = [_sample([1, 2], [3, 4, 5]), _sample([6], [7])]
    micro = collate(samples, pad_id=0, pad_to_multiple=4, packed=True)
    assert micro["tokens"].tolist() == [[1, 2, 3, 4, 6, 0, 0, 0]]       # 4 + 1 real, 3 padding
    assert micro["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0, 1, 2]]  # restart per sequence
    assert micro["cu_seqlens"].tolist() == [0, 4, 5, 8] and micro["max_seqlen"] == 4
    assert micro["packed_targets"].tolist() == [2, 3, 4, 5, 7, 0, 0, 0]
    assert micro["packed_index"].tolist() == [[0, 1, 2, 3], [4, -1, -1, -1]]
    assert micro["targets"].tolist() == [[2, 3, 4, 5], [7, 0, 0, 0]]     # loss side stays [B, S]
    values = torch.arange(8, dtype=torch.float32)
    assert unpack(values, micro["packed_index"]).tolist() == [[0, 1, 2, 3], [4, 0, 0, 0]]


def test_packed_sequences_padded_for_context_parallelism():
    """sequence_multiple (2 x CP): each sequence padded at its end, the row to pad_to_multiple."""
    samples = [_sample([1, 2], [3, 4, 5, 6]), _sample([6], [7])]  # 5 and 1 positions
    micro = collate(samples, pad_id=0, pad_to_multiple=8, packed=True, sequence_multiple=4)
    assert micro["cu_seqlens"].tolist() == [0, 8, 12, 16] and micro["max_seqlen"] == 8
    assert micro["tokens"].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0, 0]]
    assert micro["packed_targets"][:9].tolist() == [2, 3, 4, 5, 6, 0, 0, 0, 7]
    assert micro["packed_index"].tolist() == [[0, 1, 2, 3, 4], [8, -1, -1, -1, -1]]
    assert micro["position_ids"][0, 8:12].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not a multiple of sequence_multiple=4"):
        collate(samples, pad_id=0, pad_to_multiple=6, packed=True, sequence_multiple=4)


def test_zigzag_positions_and_padding_multiples():
    from swift_megatron.parallel.context import padding_multiples, zigzag_positions

    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    shares = torch.cat([zigzag_positions(12, 3, r) for r in range(3)])
    assert sorted(shares.tolist()) == list(range(12))  # every position on exactly one rank
    with pytest.raises(ValueError, match="2 x CP = 4 chunks"):
        zigzag_positions(6, 2, 0)
    assert padding_multiples(1, 1) == (1, 1)
    assert padding_multiples(2, 2) == (8, 4)  # TP=2 sequence parallel, CP=2


def test_token_groups():
    from swift_megatron.rlhf.grpo.batch import token_groups

    lengths = [(3, 2), (10, 30), (2, 2), (4, 4), (1, 1)]   # model reads 4, 39, 3, 7, 1 tokens
    samples = [_sample([1] * p, [2] * c) for p, c in lengths]
    groups = token_groups(samples, max_tokens=10)
    assert [[len(s.prompt_ids) + len(s.completion_ids) - 1 for s in g] for g in groups] == \
        [[4], [39], [3, 7], [1]]
