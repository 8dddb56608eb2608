"""ms-swift's `megatron rlhf` arguments (tests/data/ms_swift_rlhf_flags.txt, derived from its
source by scripts/ms_swift_flags.py) as our parser answers them: accepted, refused with a reason,
or unknown ("no such flag"). Few stay unknown, and each answer is the one a user needs."""
import os
import runpy

import pytest

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command, unknown_flag_message
from swift_megatron.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = runpy.run_path(os.path.join(REPO, "scripts", "ms_swift_flags.py"))
MAX_UNKNOWN = 0
# the names issue 58 lists
ISSUE_58 = {
    "freeze_parameters", "freeze_parameters_regex", "freeze_parameters_ratio",
    "trainable_parameters", "trainable_parameters_regex", "modules_to_save", "target_regex",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
    "pipeline_model_parallel_layout", "exp_avg_dtype", "exp_avg_sq_dtype",
    "use_precision_aware_optimizer", "overlap_grad_reduce", "overlap_param_gather", "ddp_timeout",
    "agent_template", "attn_impl", "max_model_len", "move_model_batches", "moe_layer_recompute",
    "local_rank", "eval_iters", "muon_momentum", "fp8_param_gather", "masked_softmax_fusion"}


def _counts():
    result = SCRIPT["classify"](SCRIPT["read_list"]())
    return {kind: len(names) for kind, names in result.items()}, result


def test_the_list_records_its_source_and_rule():
    with open(SCRIPT["LIST"]) as f:
        header = f.read().split("\n", 3)[:3]
    assert SCRIPT["COMMIT"] in header[0] and "--derive" in header[1]
    names = SCRIPT["read_list"]()
    assert len(names) == len(set(names)) > 300
    assert not set(names) & set(SCRIPT["EXCLUDED"])


def test_few_ms_swift_arguments_are_unknown(capsys):
    counts, result = _counts()
    SCRIPT["main"]([])
    printed = capsys.readouterr().out
    assert f"{counts['accepted']} accepted, {counts['refused']} refused, " \
           f"{counts['unknown']} unknown" in printed
    assert counts["unknown"] <= MAX_UNKNOWN, result["unknown"]
    assert counts["accepted"] > 181
    assert not ISSUE_58 & set(result["unknown"])


@pytest.mark.parametrize("name,answer", [
    ("local_rank", "torchrun sets each process's LOCAL_RANK"),
    ("muon_momentum", "only Adam(W) is supported"),
    ("muon_scalar_optimizer", "only Adam(W) is supported"),
    ("fp8_param_gather", "Transformer Engine"),
    ("fp4_recipe", "Transformer Engine"),
    ("packing_length", "--padding_free true"),
    ("mtp_num_layers", "multi-token prediction"),
    ("max_model_len", "--vllm_max_model_len"),
    ("move_model_batches", "--weight_sync_bucket_mb"),
    ("sequence_parallel_size", "--context_parallel_size"),
])
def test_a_refused_name_gets_its_familys_reason(name, answer):
    message = unknown_flag_message(name, ["lora_rank", "eval_steps"])
    assert "did you mean" not in message and answer in message, message
    with pytest.raises(UserError, match=answer.replace("(", r"\(").replace(")", r"\)")):
        parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", f"--{name}", "1"], "rlhf")


def test_the_pipeline_layout_names_the_uneven_split_flags():
    message = unknown_flag_message("pipeline_model_parallel_layout", [])
    assert "--decoder_first_pipeline_num_layers" in message and \
        "--decoder_last_pipeline_num_layers" in message
