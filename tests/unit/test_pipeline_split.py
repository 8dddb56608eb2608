"""--decoder_first_pipeline_num_layers / --decoder_last_pipeline_num_layers: the split of
model/layout.py (`PipelineSplit`, what the bridge and the layer specs use) is megatron-core's
own (transformer_layer.get_transformer_layer_offset, transformer_block.get_num_layers_to_build)
in every layout, its rules fail up front naming the flags, and the dry run's memory estimate
counts the fullest stage. (tests/distributed/test_layout_equivalence.py trains uneven splits
against one process; test_bridge_layouts.py loads and exports them.)"""
import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.model.layout import PipelineSplit, check_layout
from swift_megatron.model.memory import estimate

HF = dict(model_type="qwen2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
          head_dim=16, intermediate_size=128, num_hidden_layers=7, vocab_size=1000,
          tie_word_embeddings=False)


def rlhf(*argv):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *map(str, argv)],
                         "megatron rlhf")


@pytest.mark.parametrize("layers, pp, vpp, first, last", [
    (4, 2, 1, 3, None), (4, 2, 1, None, 3), (7, 3, 1, 1, None), (8, 3, 1, 2, 2),
    (9, 4, 1, 3, None), (8, 2, 2, 2, None), (12, 3, 2, 2, 2), (16, 4, 2, None, 4),
    (8, 4, 2, None, None),
])
def test_the_split_is_megatrons(layers, pp, vpp, first, last):
    config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               num_layers_in_first_pipeline_stage=first,
                               num_layers_in_last_pipeline_stage=last)
    split = PipelineSplit(layers, pp, vpp, first, last)
    seen = []
    for pp_rank in range(pp):
        for vp_stage in range(vpp):
            stage = vp_stage if vpp > 1 else None
            expected = (get_transformer_layer_offset(config, stage, pp_rank),
                        get_num_layers_to_build(config, stage, pp_rank))
            assert split.chunk(pp_rank, vp_stage) == expected
            offset, count = expected
            seen += range(offset, offset + count)
            assert all(split.owner(n) == (pp_rank, vp_stage) for n in range(offset, offset + count))
    assert sorted(seen) == list(range(layers))     # every layer once


@pytest.mark.parametrize("split, message", [
    (PipelineSplit(4, 3, first=1), r"leave 3 of num_hidden_layers=4 for the 2 middle "
                                   r"pipeline stages, which must hold equal shares"),
    (PipelineSplit(4, 2, first=2, last=1), r"leave 1 of num_hidden_layers=4 for 0 other"),
    (PipelineSplit(4, 2, first=5), r"leave -1 of num_hidden_layers=4"),
    (PipelineSplit(8, 2, 2, first=3), r"--decoder_first_pipeline_num_layers 3 must be >= 1 and "
                                      r"a multiple of --virtual_pipeline_model_parallel_size 2"),
    (PipelineSplit(7, 2), r"pipeline_model_parallel_size=2 does not divide num_hidden_layers=7: "
                          r".* or split unevenly with --decoder_first_pipeline_num_layers"),
])
def test_splits_megatron_cannot_make_fail_naming_the_flags(split, message):
    with pytest.raises(UserError, match=message):
        split.check()


def test_a_layer_count_pp_does_not_divide_splits_unevenly():
    with pytest.raises(UserError, match="does not divide num_hidden_layers=7"):
        check_layout(HF, tp=1, pp=2)
    check_layout(HF, tp=1, pp=2, first=3)                    # 3 + 4
    check_layout(HF, tp=1, pp=3, last=3)                     # 2 + 2 + 3
    assert PipelineSplit(7, 3, last=3).stage_layers() == [2, 2, 3]


@pytest.mark.parametrize("argv, message", [
    (["--decoder_first_pipeline_num_layers", 2],
     r"--decoder_first_pipeline_num_layers need --pipeline_model_parallel_size > 1"),
    (["--decoder_last_pipeline_num_layers", 2],     # export's too (no --auto_parallel there)
     r"--decoder_last_pipeline_num_layers need --pipeline_model_parallel_size > 1"),
    (["--pipeline_model_parallel_size", 2, "--decoder_last_pipeline_num_layers", 0],
     r"--decoder_last_pipeline_num_layers must be >= 1, got 0"),
])
def test_flag_rules_fail_at_parse_time(argv, message):
    from swift_megatron.arguments.commands import ExportCommandArguments

    with pytest.raises(UserError, match=message):
        rlhf(*argv)
    with pytest.raises(UserError, match=message):
        parse_command(ExportCommandArguments, ["--model", "m", "--to_mcore", "true",
                                               *map(str, argv)], "megatron export")



def test_auto_parallel_chooses_the_pipeline_of_the_split():
    assert rlhf("--decoder_first_pipeline_num_layers", 2, "--auto_parallel", "true").parallel \
        .uneven_pipeline == {"first": 2}


def test_the_memory_estimate_counts_the_fullest_stage():
    from swift_megatron.preflight import run_shape

    plan = type("Plan", (), dict(dp_size=1, micro_batch_size=1))
    even = run_shape(rlhf("--pipeline_model_parallel_size", 2), plan, dict(HF, num_hidden_layers=8))
    uneven = run_shape(rlhf("--pipeline_model_parallel_size", 2,
                            "--decoder_first_pipeline_num_layers", 2), plan,
                       dict(HF, num_hidden_layers=8))
    assert (even.stage_layers, uneven.stage_layers) == (None, 6)
    hf = dict(HF, num_hidden_layers=8)
    per_layer = (estimate(hf, uneven)["weights"] - estimate(hf, even)["weights"]) / 2
    assert per_layer > 0     # two more layers on the fullest stage
    assert estimate(hf, uneven)["activations"] == pytest.approx(
        estimate(hf, even)["activations"] * 6 / 4)
