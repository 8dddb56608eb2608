"""The first-step numerics gate's rule (rlhf/grpo/numerics.py): the model kinds, their measured-gap
tolerances, --numerics_check_atol, and the message that stops a run."""
import math

import pytest

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo import numerics

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("experts, hybrid, kind", [
    (None, False, "dense"), (0, False, "dense"), (None, True, "hybrid"), (8, False, "moe"),
    (64, True, "moe")])
def test_model_kind(experts, hybrid, kind):
    assert numerics.model_kind(experts, hybrid) == kind


@pytest.mark.parametrize("top_p, top_k, penalty, named", [
    (1.0, -1, 1.0, None), (1.0, 0, 1.0, None), (0.9, -1, 1.0, "--top_p"), (1.0, 50, 1.0, "--top_k"),
    (1.0, -1, 1.1, "--repetition_penalty"), (0.95, 20, 1.0, "--top_p and --top_k")])
def test_sampling_filters_skip_the_gate(top_p, top_k, penalty, named):
    reason = numerics.sampling_skip(top_p, top_k, penalty)
    assert (reason is None) == (named is None)
    if named:
        assert reason.startswith(f"numerics check skipped: with {named} the engine's logprobs")


def test_tolerances_and_override():
    assert [numerics.tolerance(k, None) for k in ("dense", "hybrid", "moe")] == [0.05, 0.1, 0.5]
    assert numerics.tolerance("moe", 0.01) == 0.01


@pytest.mark.parametrize("gap, kind, atol, fails", [
    (0.05, "dense", None, False), (0.0501, "dense", None, True), (0.09, "hybrid", None, False),
    (0.11, "hybrid", None, True), (0.49, "moe", None, False), (0.2, "dense", 0.3, False),
    (0.2, "moe", 0.1, True), (math.nan, "dense", None, True), (math.inf, "moe", None, True)])
def test_gate_failure_threshold(gap, kind, atol, fails):
    assert (numerics.gate_failure(gap, "qwen2", kind, atol) is not None) == fails


def test_gate_failure_message_names_family_gap_and_remedies():
    message = numerics.gate_failure(0.8123, "qwen3_5", "hybrid", None)
    assert "by 0.8123 on average per completion token (qwen3_5, hybrid model), past the hybrid " \
           "tolerance 0.1" in message
    for remedy in ("--torch_dtype", "--numerics_check_atol", "--numerics_check false",
                   "--test_convert_precision"):
        assert remedy in message


def rollout_flags(*argv):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *argv],
                         "megatron rlhf").rollout


def test_flags():
    args = rollout_flags()
    assert args.numerics_check is True and args.numerics_check_atol is None
    args = rollout_flags("--numerics_check", "false", "--numerics_check_atol", "0.2")
    assert args.numerics_check is False and args.numerics_check_atol == 0.2
    with pytest.raises(UserError, match="--numerics_check_atol must be > 0"):
        rollout_flags("--numerics_check_atol", "0")
