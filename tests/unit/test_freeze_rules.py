"""ms-swift's freeze flags: their values and rules (arguments/freeze.py, model/trainable.py) on
hand-made parameter tables, and what the dry run's memory estimate makes of them (the training
itself: tests/distributed/test_freeze.py)."""
import pytest

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.model.memory import RunShape, estimate, rank_parameters
from swift_megatron.model.trainable import (FreezeRules, estimated_table, frozen_on_first_stage,
                                            saved_on_first_stage, trainable_names)

EMB, OUT = "embedding.word_embeddings.weight", "output_layer.weight"
TABLE = [(EMB, 100), ("decoder.layers.0.input_layernorm.weight", 10),
         ("decoder.layers.0.mlp.linear_fc1.weight", 40),
         ("decoder.layers.1.input_layernorm.weight", 10),
         ("decoder.layers.1.mlp.linear_fc1.weight", 40), ("decoder.final_layernorm.weight", 10),
         (OUT, 100)]
ALL = {n for n, _ in TABLE}


def trains(tied=False, table=TABLE, **rules):
    return trainable_names(table, {n for n, _ in table}, FreezeRules(**rules), tied)


def parse(*argv):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *map(str, argv)],
                         "megatron rlhf")


def test_defaults_are_ms_swifts():
    f = parse().freeze
    assert (f.freeze_parameters, f.freeze_parameters_regex, f.freeze_parameters_ratio,
            f.trainable_parameters, f.trainable_parameters_regex) == ([], None, 0.0, [], None)
    assert not f.active and parse("--freeze_parameters_ratio", 1).freeze.active


@pytest.mark.parametrize("argv, message", [
    (["--freeze_parameters_ratio", 1.5], r"must be in \[0, 1\]"),
    (["--freeze_parameters_regex", "(("], "not a valid regular expression"),
    (["--trainable_parameters_regex", "[a"], "--trainable_parameters_regex"),
    (["--freeze_parameters_ratio", 0.5, "--pipeline_model_parallel_size", 2],
     "not supported with --pipeline_model_parallel_size > 1")])
def test_bad_values_name_the_flag(argv, message):
    with pytest.raises(UserError, match=message):
        parse(*argv)


def test_ratio_0_or_1_works_with_pipeline_parallelism():
    assert parse("--freeze_parameters_ratio", 1, "--pipeline_model_parallel_size", 2).freeze.active


def test_prefixes_then_regex_then_trainable_prefixes_and_regex():
    assert trains(freeze=("decoder.layers.",)) == {EMB, "decoder.final_layernorm.weight", OUT}
    assert trains(freeze_regex=r"layernorm") == ALL - {n for n in ALL if "layernorm" in n}
    assert trains(freeze=("decoder.",), trainable=("decoder.layers.1.",),
                  trainable_regex="final") == ALL - {"decoder.layers.0.input_layernorm.weight",
                                                     "decoder.layers.0.mlp.linear_fc1.weight"}


def test_ratio_cuts_where_the_running_sum_passes_it():
    """310 elements: 0.5 allows 155, and the embedding (100) plus layer 0's norm (110) and fc1
    (150) fit, layer 1's norm (160) not: ms-swift's bisect_right of the running sum."""
    assert ALL - trains(ratio=0.5) == {EMB, "decoder.layers.0.input_layernorm.weight",
                                       "decoder.layers.0.mlp.linear_fc1.weight"}
    assert ALL - trains(ratio=0.33) == {EMB}           # 102 of 310
    assert trains(ratio=0.32) == ALL                   # 99: not even the embedding (100) fits
    assert trains(ratio=1.0, trainable=(OUT,)) == {OUT}


def test_tied_embeddings_are_one_matrix():
    """Either name freezes both copies; the ratio counts the matrix once."""
    assert trains(tied=True, freeze=("output_layer",)) == ALL - {EMB, OUT}
    table = TABLE[:-1]    # pipeline size 1: the tied output layer has no weight of its own
    assert trains(tied=True, table=table, freeze=("output_layer",)) == {n for n, _ in table} - {EMB}
    # 210 elements without the copy: 0.5 = 105 takes the embedding, and its copy with it
    assert ALL - trains(tied=True, ratio=0.5) == {EMB, OUT}


def test_names_that_match_nothing_and_nothing_to_train_are_errors():
    with pytest.raises(UserError, match=r"--freeze_parameters model.embed_tokens: matches no "
                                        r"parameter.*model.embed_tokens is embedding"):
        trains(freeze=("model.embed_tokens",))
    with pytest.raises(UserError, match="--trainable_parameters_regex lm_head"):
        trains(ratio=1.0, trainable_regex="lm_head")
    with pytest.raises(UserError, match="leave no parameter to train"):
        trains(ratio=1.0)


# ---- the dry run's memory estimate --------------------------------------------------------------

HF = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          intermediate_size=128, num_hidden_layers=4, vocab_size=1000, tie_word_embeddings=False)
# attention 12288 (qkv 8192, proj 4096); mlp 24576 (fc1 16384, fc2 8192); norms 2 x 64


def test_estimated_table_holds_the_parameters_the_estimate_counts():
    table = dict(estimated_table(HF))
    assert sum(table.values()) == rank_parameters(HF, RunShape()) + 64   # + the final norm
    assert table["decoder.layers.3.self_attention.linear_qkv.weight"] == 8192
    assert table["decoder.layers.0.mlp.linear_fc1.weight"] == 16384


def test_frozen_parameters_on_the_counted_rank():
    rules = FreezeRules(freeze=("embedding.", "decoder.layers.0."))
    layer = 12288 + 24576 + 128
    assert frozen_on_first_stage(HF, rules, tp=1, pp=1, ep=1) == 64000 + layer
    # TP 2: the embedding and matrices halve, the norms not; PP 2: the first stage's share
    assert frozen_on_first_stage(HF, rules, tp=2, pp=1, ep=1) == 32000 + (12288 + 24576) // 2 + 128
    assert frozen_on_first_stage(HF, FreezeRules(freeze=("output_layer",)), 1, 2, 1) == 0
    assert frozen_on_first_stage(HF, FreezeRules(freeze=("decoder.layers.3.",)), 1, 2, 1) == 0
    # names the estimate does not list (q/k norms) freeze nothing there, without an error
    assert frozen_on_first_stage(HF, FreezeRules(freeze=("decoder.layers.0.self_attention."
                                                         "q_layernorm",)), 1, 1, 1) == 0


def test_frozen_parameters_have_no_gradient_or_optimizer_state():
    """4 bytes of float32 gradient and 12 of float32 main copy + Adam moments per trainable
    parameter, the latter split over DP by the distributed optimizer."""
    run = RunShape(dp=2, micro_batch_tokens=64)
    frozen = frozen_on_first_stage(HF, FreezeRules(freeze=("embedding.",)), 1, 1, 1)
    base, less = estimate(HF, run), estimate(HF, RunShape(dp=2, micro_batch_tokens=64,
                                                          frozen_parameters=frozen))
    assert frozen == 64000
    assert (base["gradients"] - less["gradients"]) * (1 << 30) == pytest.approx(4 * 64000)
    assert (base["optimizer"] - less["optimizer"]) * (1 << 30) == pytest.approx(12 * 64000 / 2)
    assert less["weights"] == base["weights"]
    # nor the embedding's dense bf16 gradient of the backward
    frozen_embedding = estimate(HF, RunShape(micro_batch_tokens=64, embedding_trains=False))
    assert base["embedding_grad"] * (1 << 30) == pytest.approx(2 * 64000)
    assert frozen_embedding["embedding_grad"] == 0


def test_modules_to_save_train_in_full_beside_the_adapters():
    """LoRA with --modules_to_save: the embedding trains (gradient, optimizer state) and keeps
    a base copy (weights); tied, the output layer is the same matrix."""
    saved = saved_on_first_stage(HF, ["embedding.word_embeddings", "output_layer"], tp=2, pp=1)
    assert saved == (64000 + 64000) // 2
    assert saved_on_first_stage(HF, ["output_layer"], tp=1, pp=2) == 0
    assert saved_on_first_stage(dict(HF, tie_word_embeddings=True), ["output_layer"], 1, 2) == 64000
    run = dict(lora=True, micro_batch_tokens=64, distributed_optimizer=False)
    base = estimate(HF, RunShape(**run))
    more = estimate(HF, RunShape(**run, saved_parameters=64000))
    assert (more["gradients"] - base["gradients"]) * (1 << 30) == pytest.approx(4 * 64000)
    assert (more["optimizer"] - base["optimizer"]) * (1 << 30) == pytest.approx(12 * 64000)
    assert (more["weights"] - base["weights"]) * (1 << 30) == pytest.approx(2 * 64000)


def test_the_dry_run_counts_them_from_the_flags():
    from swift_megatron.preflight import embedding_trains, frozen_parameters, saved_parameters

    args = parse("--freeze_parameters", "embedding.", "--tensor_model_parallel_size", 2)
    assert frozen_parameters(args, HF) == 32000
    assert frozen_parameters(parse("--freeze_parameters", "embedding.", "--train_type", "lora"),
                             HF) == 0
    lora = parse("--train_type", "lora", "--modules_to_save", "embed_tokens")
    assert saved_parameters(lora, HF) == 64000 and saved_parameters(parse(), HF) == 0
    assert [embedding_trains(a, HF) for a in (parse(), args, lora)] == [None, False, True]
    assert embedding_trains(parse("--freeze_parameters", "decoder."), HF) is True
    head_only = parse("--train_type", "lora", "--modules_to_save", "lm_head")
    assert embedding_trains(head_only, HF) is False
    assert embedding_trains(head_only, dict(HF, tie_word_embeddings=True)) is True
