"""RoPE on packed sequences in one batched op per query / key (model/rope.py) equals megatron-core's
own per-sequence `apply_rotary_pos_emb` with cu_seqlens bit for bit (both frequency layouts,
sequences of length 1, partial rotary, float32 and bfloat16), inside a real attention layer too,
and runs 4 ops per rotated tensor (5 with partial rotary) where megatron's runs 14 and reads
cu_seqlens back to the host (a device sync on a GPU)."""
import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils._python_dispatch import TorchDispatchMode

from swift_megatron.model.rope import (PackedRopeSelfAttention, positions_in_sequences,
                                       rotary_tables, rotate)

LENGTHS = [5, 1, 7, 3, 1, 9, 2, 4]  # 8 sequences, two of one token


class OneRankGroup:
    """What megatron's THD RoPE reads of a context-parallel group of one rank."""

    def size(self):
        return 1

    def rank(self):
        return 0


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that compute (each a kernel launch on a GPU), views aside, and the
    tensor-to-host reads (`.item()` / `.tolist()`: device syncs on a GPU)."""

    def __init__(self):
        super().__init__()
        self.ops, self.host_reads = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.host_reads += 1
        elif not func.is_view:
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _config(**overrides):
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                             **overrides)


def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0).to(torch.int32)


def _megatron(t, cu, freqs, config=None):
    return rope_utils.apply_rotary_pos_emb(t, freqs, config or _config(), cu_seqlens=cu,
                                           cp_group=OneRankGroup())


def test_positions_restart_in_every_sequence():
    cu = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    assert positions_in_sequences(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [16, 4], ids=["full", "partial_25pct"])
def test_batched_rope_equals_megatron(dtype, rot):
    gen = torch.Generator().manual_seed(0)
    cu, total = _cu(LENGTHS), sum(LENGTHS)
    t = torch.randn(total, 4, 16, generator=gen).to(dtype)
    # max_seqlen frequencies (RoPE), and frequencies as long as the packed row (M-RoPE)
    for length in (max(LENGTHS), total):
        freqs = torch.randn(length, 1, 1, rot, generator=gen) * 30
        expected = _megatron(t, cu, freqs)
        got = rotate(t.unsqueeze(1), *rotary_tables(cu, freqs, total, dtype)).squeeze(1)
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert (got.float() - expected.float()).abs().max().item() == 0.0
        assert not torch.equal(got[:, :, :rot], t[:, :, :rot])  # it did rotate
        assert torch.equal(got[:, :, rot:], t[:, :, rot:])      # and passed the rest through


def test_rope_op_count_per_layer():
    """A layer rotates its query and its key: megatron's THD path runs >10 ops and a host read
    (`cu_seqlens.tolist()`) for each; ours 4 ops each once the micro-batch's tables exist."""
    cu, total = _cu(LENGTHS), sum(LENGTHS)
    q, k = torch.randn(total, 1, 4, 16), torch.randn(total, 1, 2, 16)
    freqs = torch.randn(max(LENGTHS), 1, 1, 16)
    with OpCounter() as megatron:
        _megatron(q.squeeze(1), cu, freqs), _megatron(k.squeeze(1), cu, freqs)
    with OpCounter() as tables:
        cos, sin = rotary_tables(cu, freqs, total, q.dtype)
    with OpCounter() as ours:
        rotate(q, cos, sin), rotate(k, cos, sin)
    print(f"\nper layer, {len(LENGTHS)} packed sequences: megatron {len(megatron.ops)} ops + "
          f"{megatron.host_reads} host reads {megatron.ops}; ours {len(ours.ops)} ops "
          f"{ours.ops}; once per micro-batch: {len(tables.ops)} ops")
    assert len(ours.ops) == 8 and ours.host_reads == 0
    assert len(megatron.ops) >= 20 and megatron.host_reads >= 2


@pytest.fixture
def single_rank(single_process_group):
    """Megatron's model-parallel groups (all of size 1) on the one-process world."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("rotary_percent", [1.0, 0.25])
def test_attention_layer_equals_megatron(single_rank, rotary_percent):
    """Our spec's attention on a packed micro-batch (batched RoPE) gives megatron's
    SelfAttention.forward's output exactly, forward and backward; padded input still goes
    through megatron's own RoPE."""
    from swift_megatron.model.spec import layer_spec

    torch.manual_seed(0)
    config = _config(num_query_groups=2, use_cpu_initialization=True, kv_channels=16,
                     attention_dropout=0.0)
    spec = layer_spec(qk_layernorm=True, num_experts=None).submodules.self_attention
    attention = PackedRopeSelfAttention(config, spec.submodules, layer_number=1,
                                        **spec.params)
    total = sum(LENGTHS)
    cu = _cu(LENGTHS)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(LENGTHS), max_seqlen_kv=max(LENGTHS))
    rot = int(16 * rotary_percent)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))

    def table(length):  # RotaryEmbedding.get_emb's frequency table (its init wants CUDA)
        freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
        return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    freqs = table(max(LENGTHS))
    hidden = torch.randn(total, 1, 64)

    def run(forward):
        x = hidden.clone().requires_grad_()
        with OpCounter() as counter:
            out, _ = forward(attention, x, None, rotary_pos_emb=freqs, packed_seq_params=params)
        out.square().sum().backward()
        return out, x.grad, counter

    ours, ours_grad, first = run(PackedRopeSelfAttention.forward)
    _, _, later = run(PackedRopeSelfAttention.forward)  # the micro-batch's next layer
    ref, ref_grad, ref_ops = run(SelfAttention.forward)
    assert torch.equal(ours, ref) and torch.equal(ours_grad, ref_grad)
    assert ref_ops.host_reads >= 2 and first.host_reads == later.host_reads == 0
    # megatron's path runs 28 RoPE ops per layer; ours 8 (10 with partial rotary: the pass-through)
    assert len(later.ops) == len(ref_ops.ops) - (20 if rotary_percent == 1.0 else 18)
    assert len(first.ops) > len(later.ops)           # the tables, once per micro-batch
    print(f"\nattention forward ({len(LENGTHS)} sequences, rotary {rotary_percent}): ours "
          f"{len(first.ops)} ops (first layer, with the tables) / {len(later.ops)} (the others),"
          f" 0 host reads; megatron {len(ref_ops.ops)} ops / {ref_ops.host_reads} host reads")
    padded = torch.randn(6, 2, 64)
    freqs = table(6)
    assert attention._batched_freqs(dict(rotary_pos_emb=freqs)) is None
    out, _ = attention(padded, None, rotary_pos_emb=freqs)
    ref, _ = SelfAttention.forward(attention, padded, None, rotary_pos_emb=freqs)
    assert torch.equal(out, ref)
