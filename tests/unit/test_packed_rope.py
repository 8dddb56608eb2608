"""RoPE on packed sequences without host syncs (model/compat.py `packed_rope`) equals
megatron-core's own per-sequence loop, for both of its frequency layouts."""
import torch

from swift_megatron.model.compat import _MEGATRON_THD, packed_rope, positions_in_sequences


class OneRankGroup:
    """What megatron's THD RoPE reads of a context-parallel group of one rank."""

    def size(self):
        return 1

    def rank(self):
        return 0


def test_positions_restart_in_every_sequence():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert positions_in_sequences(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_packed_rope_equals_megatron():
    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 13, 16], dtype=torch.int32)
    t = torch.randn(16, 4, 8, generator=gen)
    for length in (7, 16):  # max_seqlen frequencies, and frequencies as long as the packed row
        freqs = torch.randn(length, 1, 1, 8, generator=gen)
        expected = _MEGATRON_THD(t, cu, freqs, cp_group=OneRankGroup())
        assert torch.equal(packed_rope(t, cu, freqs, cp_group=OneRankGroup()), expected)
