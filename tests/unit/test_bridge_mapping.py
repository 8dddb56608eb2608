"""The bridge's mapping classes on synthetic tensors (no model, no process group): every rank's
shard loaded from a small safetensors file, then `to_hf` on all shards, gives back the original
tensors exactly for TP sizes 1, 2 and 4; the fused layouts (QKV, GateUp, Qwen3.5's gated QKV and
Gated DeltaNet segments) match hand-built ones; vocab padding
rows are zeros and vanish on export; a wrong shape or a missing tensor is a UserError naming it."""
import types

import pytest
import torch
from safetensors.torch import save_file

from swift_megatron.bridge.io import HFReader
from swift_megatron.bridge.load import load_hf_weights
from swift_megatron.bridge.mapping import (QKV, ColumnParallel, Dims, GatedQKV, GateUp,
                                           Replicated, RowParallel, Segmented, Shard,
                                           VocabParallel)
from swift_megatron.bridge.position import RankPosition
from swift_megatron.model.layout import PipelineSplit
from swift_megatron.errors import UserError

HIDDEN = 3
TP_SIZES = (1, 2, 4)


def dims(heads=4, groups=2, head_dim=2, vocab=8, padded=8) -> Dims:
    return Dims(num_heads=heads, num_query_groups=groups, head_dim=head_dim, vocab_size=vocab,
                padded_vocab_size=padded)


def numbered(*shape) -> torch.Tensor:
    """Distinct values, so any misplaced element shows."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 1


@pytest.fixture
def reader_of(tmp_path):
    """Write {name: tensor} as model.safetensors and return an HFReader over it."""
    def make(tensors):
        save_file({k: v.contiguous() for k, v in tensors.items()},
                  str(tmp_path / "model.safetensors"))
        return HFReader(str(tmp_path))
    return make


def load_all(mapping, reader, names, tp, d):
    return [mapping.load(reader, names, Shard(rank, tp), d) for rank in range(tp)]


# ---- simple splits --------------------------------------------------------------------------

@pytest.mark.parametrize("tp", TP_SIZES)
def test_replicated_gives_every_rank_the_whole_tensor(reader_of, tp):
    tensors = {"model.norm.weight": numbered(8)}
    mapping = Replicated("decoder.final_layernorm.weight", "model.norm.weight")
    shards = load_all(mapping, reader_of(tensors), list(tensors), tp, dims())
    assert all(torch.equal(s, tensors["model.norm.weight"]) for s in shards)
    assert torch.equal(mapping.to_hf(shards[:1], list(tensors), dims())["model.norm.weight"],
                       tensors["model.norm.weight"])


@pytest.mark.parametrize("tp", TP_SIZES)
@pytest.mark.parametrize("cls,dim", [(ColumnParallel, 0), (RowParallel, 1)])
def test_column_and_row_parallel_split_and_gather(reader_of, cls, dim, tp):
    tensors = {"w": numbered(8, 12)}
    mapping = cls("m.weight", "w")
    reader = reader_of(tensors)
    shards = load_all(mapping, reader, ["w"], tp, dims())
    for rank, shard in enumerate(shards):
        assert torch.equal(shard, tensors["w"].chunk(tp, dim=dim)[rank])
    assert torch.equal(mapping.to_hf(shards, ["w"], dims())["w"], tensors["w"])


# ---- vocabulary -----------------------------------------------------------------------------

@pytest.mark.parametrize("tp", TP_SIZES)
def test_vocab_padding_rows_are_zero_and_removed_on_export(reader_of, tp):
    vocab = 7
    padded = -(-vocab // tp) * tp
    tensors = {"model.embed_tokens.weight": numbered(vocab, HIDDEN)}
    d = dims(vocab=vocab, padded=padded)
    mapping = VocabParallel("embedding.word_embeddings.weight", "model.embed_tokens.weight")
    shards = load_all(mapping, reader_of(tensors), list(tensors), tp, d)
    full = torch.cat(shards)
    assert full.shape == (padded, HIDDEN)
    assert torch.equal(full[:vocab], tensors["model.embed_tokens.weight"])
    assert torch.count_nonzero(full[vocab:]) == 0
    exported = mapping.to_hf(shards, list(tensors), d)["model.embed_tokens.weight"]
    assert torch.equal(exported, tensors["model.embed_tokens.weight"])


# ---- fused layouts --------------------------------------------------------------------------

def qkv_tensors(heads, groups, head_dim, bias=False):
    shape = lambda rows: (rows,) if bias else (rows, HIDDEN)  # noqa: E731
    q, k, v = (numbered(*shape(n * head_dim)) for n in (heads, groups, groups))
    return {"q": q, "k": k * 1000, "v": v * 100000}


def test_qkv_fuses_per_query_group_gqa_example(reader_of):
    """4 heads, 2 KV groups, head_dim 2: [q heads 0-1, k0, v0, q heads 2-3, k1, v1]."""
    d = dims(heads=4, groups=2, head_dim=2)
    t = qkv_tensors(4, 2, 2)
    q, k, v = (t[n].reshape(-1, 2, HIDDEN) for n in "qkv")  # per head
    expected = torch.cat([q[0], q[1], k[0], v[0], q[2], q[3], k[1], v[1]])
    mapping = QKV("linear_qkv.weight", "q", "k", "v")
    reader = reader_of(t)
    assert torch.equal(load_all(mapping, reader, ["q", "k", "v"], 1, d)[0], expected)
    tp2 = load_all(mapping, reader, ["q", "k", "v"], 2, d)
    assert torch.equal(tp2[0], expected[:8]) and torch.equal(tp2[1], expected[8:])


QKV_CASES = [(heads, groups, tp) for heads, groups in [(4, 2), (4, 4), (8, 4), (8, 1)]
             for tp in TP_SIZES if groups % tp == 0]  # TP splits whole KV groups


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("heads,groups,tp", QKV_CASES)
def test_qkv_round_trip(reader_of, heads, groups, tp, bias):
    d = dims(heads=heads, groups=groups, head_dim=2)
    tensors = qkv_tensors(heads, groups, 2, bias)
    mapping = QKV("linear_qkv", "q", "k", "v")
    shards = load_all(mapping, reader_of(tensors), ["q", "k", "v"], tp, d)
    assert all(s.shape[0] == (heads // groups + 2) * 2 * groups // tp for s in shards)
    restored = mapping.to_hf(shards, ["q", "k", "v"], d)
    assert all(torch.equal(restored[n], tensors[n]) for n in "qkv")


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gate_up_holds_gate_then_up_rows_per_rank(reader_of, tp):
    tensors = {"gate": numbered(8, HIDDEN), "up": numbered(8, HIDDEN) * 1000}
    mapping = GateUp("linear_fc1.weight", "gate", "up")
    shards = load_all(mapping, reader_of(tensors), ["gate", "up"], tp, dims())
    for rank, shard in enumerate(shards):
        expected = torch.cat([tensors["gate"].chunk(tp)[rank], tensors["up"].chunk(tp)[rank]])
        assert torch.equal(shard, expected)
    restored = mapping.to_hf(shards, ["gate", "up"], dims())
    assert all(torch.equal(restored[name], tensors[name]) for name in ("gate", "up"))


def test_gated_qkv_regroups_per_head_q_and_gate_per_query_group(reader_of):
    """4 heads in 2 groups, head_dim 2: HF q_proj rows per head are [q_h; gate_h]; mcore's
    rows per group are [q of its heads | gate of its heads | k | v]."""
    d = dims(heads=4, groups=2, head_dim=2)
    t = {"q": numbered(16, HIDDEN), "k": numbered(4, HIDDEN) * 1000,
         "v": numbered(4, HIDDEN) * 100000}
    qg = t["q"].reshape(4, 2, 2, HIDDEN)  # head, [q, gate], head_dim
    q, gate = qg[:, 0], qg[:, 1]
    k, v = t["k"].reshape(2, 2, HIDDEN), t["v"].reshape(2, 2, HIDDEN)
    expected = torch.cat([q[0], q[1], gate[0], gate[1], k[0], v[0],
                          q[2], q[3], gate[2], gate[3], k[1], v[1]])
    mapping = GatedQKV("linear_qkv.weight", "q", "k", "v")
    reader = reader_of(t)
    assert torch.equal(load_all(mapping, reader, ["q", "k", "v"], 1, d)[0], expected)
    tp2 = load_all(mapping, reader, ["q", "k", "v"], 2, d)
    assert torch.equal(torch.cat(tp2), expected)


@pytest.mark.parametrize("heads,groups,tp", QKV_CASES)
def test_gated_qkv_round_trip(reader_of, heads, groups, tp):
    d = dims(heads=heads, groups=groups, head_dim=2)
    t = {"q": numbered(2 * heads * 2, HIDDEN), "k": numbered(groups * 2, HIDDEN) * 1000,
         "v": numbered(groups * 2, HIDDEN) * 100000}
    mapping = GatedQKV("linear_qkv.weight", "q", "k", "v")
    shards = load_all(mapping, reader_of(t), ["q", "k", "v"], tp, d)
    assert all(s.shape[0] == (2 * heads // groups + 2) * 2 * groups // tp for s in shards)
    restored = mapping.to_hf(shards, ["q", "k", "v"], d)
    assert all(torch.equal(restored[n], t[n]) for n in "qkv")


GDN_DIMS = dict(linear_qk_dim=8, linear_v_dim=16, linear_v_heads=4)
GDN_IN_PROJ = [(0, "linear_qk_dim"), (0, "linear_qk_dim"), (0, "linear_v_dim"),
               (1, "linear_v_dim"), (2, "linear_v_heads"), (3, "linear_v_heads")]


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gdn_in_proj_holds_each_segments_chunk_per_rank(reader_of, tp):
    """in_proj_qkv = [q(8); k(8); v(16)], z(16), b(4), a(4): rank r holds
    [q_r, k_r, v_r, z_r, b_r, a_r]; the export restores all four HF tensors."""
    d = Dims(**dims().__dict__ | GDN_DIMS)
    t = {"qkv": numbered(32, HIDDEN), "z": numbered(16, HIDDEN) * 1000,
         "b": numbered(4, HIDDEN) * 100000, "a": numbered(4, HIDDEN) * 1e7}
    names = ["qkv", "z", "b", "a"]
    mapping = Segmented("in_proj.weight", *names, segments=GDN_IN_PROJ)
    shards = load_all(mapping, reader_of(t), names, tp, d)
    q, k, v = torch.split(t["qkv"], [8, 8, 16])
    for rank, shard in enumerate(shards):
        expected = torch.cat([x.chunk(tp)[rank] for x in (q, k, v, t["z"], t["b"], t["a"])])
        assert torch.equal(shard, expected)
    restored = mapping.to_hf(shards, names, d)
    assert all(torch.equal(restored[n], t[n]) for n in names)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_gdn_conv_round_trip_keeps_its_kernel_dims(reader_of, tp):
    d = Dims(**dims().__dict__ | GDN_DIMS)
    t = {"conv": numbered(32, 1, 4)}
    mapping = Segmented("conv1d.weight", "conv", segments=GDN_IN_PROJ[:3])
    shards = load_all(mapping, reader_of(t), ["conv"], tp, d)
    assert all(s.shape == (32 // tp, 1, 4) for s in shards)
    assert torch.equal(mapping.to_hf(shards, ["conv"], d)["conv"], t["conv"])


# ---- names ----------------------------------------------------------------------------------

def test_patterns_translate_layer_and_expert_numbers():
    mapping = GateUp("decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight",
                     "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
                     "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight")
    index = mapping.match("decoder.layers.12.mlp.experts.local_experts.3.linear_fc1.weight")
    assert index == {"layer": 12, "expert": 3} and mapping.is_expert
    assert mapping.hf_names(index)[1] == "model.layers.12.mlp.experts.3.up_proj.weight"
    assert mapping.match("decoder.layers.1.mlp.linear_fc1.weight") is None


def test_rank_position_maps_stage_and_expert_numbers_to_global():
    pos = RankPosition(tp=Shard(), etp=Shard(), pp_rank=1, pp_size=2, ep_rank=1, ep_size=2,
                       split=PipelineSplit(4, 2), experts_per_rank=4, layer_offset=2)
    assert (pos.to_global("decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight")
            == "decoder.layers.2.mlp.experts.local_experts.5.linear_fc2.weight")
    assert pos.owner_stage("decoder.layers.3.input_layernorm.weight") == 1
    assert pos.owner_ep("decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight") == 1


def test_rank_position_of_interleaved_chunks():
    """PP=2 x VPP=2, 8 layers: chunks of 2; stage 1 holds layers 2-3 (chunk 0) and 6-7."""
    pos = RankPosition(tp=Shard(), etp=Shard(), pp_rank=1, pp_size=2, ep_rank=0, ep_size=1,
                       split=PipelineSplit(8, 2, 2), experts_per_rank=0, layer_offset=2)
    second = pos.for_chunk(types.SimpleNamespace(vp_stage=1))
    assert second.to_global("decoder.layers.1.mlp.linear_fc1.weight") == \
        "decoder.layers.7.mlp.linear_fc1.weight"
    assert pos.for_chunk(types.SimpleNamespace(vp_stage=0)).layer_offset == 2
    assert [pos.owner_stage(f"decoder.layers.{n}.input_layernorm.weight") for n in range(8)] == \
        [0, 0, 1, 1, 0, 0, 1, 1]


def test_rank_position_of_an_uneven_split():
    """PP=3, 7 layers as 1 + 3 + 3 (--decoder_first_pipeline_num_layers 1); and PP=2 x VPP=2
    with 8 layers as a first stage of 2 and a last of 6 (chunks 1, 3, 1, 3)."""
    pos = RankPosition(tp=Shard(), etp=Shard(), pp_rank=2, pp_size=3, ep_rank=0, ep_size=1,
                       split=PipelineSplit(7, 3, first=1), experts_per_rank=0, layer_offset=4)
    assert pos.for_chunk(types.SimpleNamespace(vp_stage=None)).layer_offset == 4
    assert [pos.owner_stage(f"decoder.layers.{n}.input_layernorm.weight") for n in range(7)] == \
        [0, 1, 1, 1, 2, 2, 2]
    split = PipelineSplit(8, 2, 2, first=2, last=6)
    assert [split.chunk(p, v) for v in range(2) for p in range(2)] == \
        [(0, 1), (1, 3), (4, 1), (5, 3)]


# ---- errors ---------------------------------------------------------------------------------

class _Norm(torch.nn.Module):
    def __init__(self, size):
        super().__init__()
        self.final_layernorm = torch.nn.Module()
        self.final_layernorm.weight = torch.nn.Parameter(torch.zeros(size))


def _load_norm(tmp_path, tensors, size=4):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = torch.nn.Module()
    model.decoder = _Norm(size)
    pos = RankPosition(tp=Shard(), etp=Shard(), pp_rank=0, pp_size=1, ep_rank=0, ep_size=1,
                       split=PipelineSplit(1), experts_per_rank=0, layer_offset=0)
    mappings = [Replicated("decoder.final_layernorm.weight", "model.norm.weight")]
    load_hf_weights(model, str(tmp_path), mappings, dims(), pos)
    return model


def test_load_copies_into_the_parameter(tmp_path):
    model = _load_norm(tmp_path, {"model.norm.weight": numbered(4)})
    assert torch.equal(model.decoder.final_layernorm.weight.data, numbered(4))


def test_shape_mismatch_is_a_user_error_naming_the_tensor(tmp_path):
    with pytest.raises(UserError, match=r"model\.norm\.weight.*\(5,\).*expected \(4,\)"):
        _load_norm(tmp_path, {"model.norm.weight": numbered(5)})


def test_missing_tensor_is_a_user_error_naming_it(tmp_path):
    with pytest.raises(UserError, match=r"'model\.norm\.weight' is missing"):
        _load_norm(tmp_path, {"model.other.weight": numbered(4)})


def test_directory_without_safetensors_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="only safetensors"):
        HFReader(str(tmp_path))
