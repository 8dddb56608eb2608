"""tests/gpu/matrix.py, the GPU gate, where no GPU is needed: it covers every model family the
fixtures build (so a new family cannot skip the gate), its presets exist, its commands pass the
CLI's own up-front checks, and its verdict fails a case on each of the things it checks (exit
code, rollout batches logged, non-finite loss or grad norm, sync gap, memory estimate)."""
import math

import pytest

from tests.gpu import matrix


def test_every_family_runs_full_and_lora():
    from grpo_step import PRESETS

    from swift_megatron.fixtures.models import FAMILIES, VISION_FAMILIES

    types = {PRESETS[f.preset]["model_type"] for f in matrix.FAMILIES.values()}
    assert types == set(FAMILIES + VISION_FAMILIES)
    images = {name for name, f in matrix.FAMILIES.items() if "image_size" in PRESETS[f.preset]}
    assert images == {"qwen2_5_vl", "qwen3_vl", "qwen3_5_vl"}   # Qwen3.5 with its tower too
    cases = matrix.all_cases()
    assert len(cases) == 2 * len(matrix.FAMILIES)
    assert {c.mode for c in cases} == {"full", "lora"}


def test_select_takes_cases_and_families():
    cases = matrix.all_cases()
    assert [c.name for c in matrix.select(cases, ["qwen3_5", "llama3_lora"])] == \
        ["llama3_lora", "qwen3_5_full", "qwen3_5_lora"]
    assert matrix.select(cases, []) == cases
    with pytest.raises(SystemExit, match="unknown matrix case"):
        matrix.select(cases, ["qwen4"])


def test_commands_pass_the_argument_checks():
    """Each case's flags parse and satisfy the batch rules (the CLI's parser, no model)."""
    from swift_megatron.arguments.batch_plan import make_batch_plan
    from swift_megatron.arguments.commands import RlhfArguments, batch_inputs
    from swift_megatron.arguments.parser import parse_command

    for case in matrix.all_cases():
        cmd = matrix.command(case, "/m", ["--dataset", "d.jsonl", "--reward_funcs", "accuracy"],
                             "/o")
        args = parse_command(RlhfArguments, cmd[cmd.index("rlhf") + 1:], "megatron rlhf")
        plan = make_batch_plan(batch_inputs(args, world_size=1))
        assert plan.generation_batch_size == 64 and args.rollout.check_weight_sync
        assert args.training.train_type == case.mode


def _rows(**changes):
    row = {"loss/policy": 0.01, "grad_norm": 0.5, "sync/logprob_abs_diff_mean": 0.02,
           "memory/train_peak_gib": 12.0, "memory/logprobs_peak_gib": 11.0,
           "memory/engine_asleep_gib": 2.0}
    return [row, dict(row, **changes)]


ESTIMATE = {"train": 10.5, "logprobs": 9.0}   # measured training: 12 - 2 = 10 GiB


def test_verdict_passes_a_good_run():
    result = matrix.verdict(0, _rows(), ESTIMATE, 0.05)
    assert result["failed"] == []
    assert result["estimate_vs_training"] == pytest.approx(1.05)
    assert result["sync_gap"] == 0.02 and result["training_gib"] == 10.0


@pytest.mark.parametrize("returncode, rows, atol, estimate, reason", [
    (1, _rows(), 0.05, ESTIMATE, "exit 1"),
    (0, _rows()[:1], 0.05, ESTIMATE, "1 of 2 rollout batches"),
    (0, _rows(**{"loss/policy": math.nan}), 0.05, ESTIMATE, "not finite"),
    (0, _rows(grad_norm=math.inf), 0.05, ESTIMATE, "not finite"),
    (0, _rows(**{"sync/logprob_abs_diff_mean": 0.3}), 0.05, ESTIMATE, "sync gap 0.3"),
    (0, [{k: v for k, v in r.items() if not k.startswith("sync/")} for r in _rows()], 0.5,
     ESTIMATE, "sync gap None"),
    (0, _rows(), 0.05, {"train": 12.0}, "estimate / measured 1.2"),
    (0, _rows(), 0.05, {}, "estimate / measured None"),
], ids=["exit", "batches", "nan-loss", "inf-grad", "gap", "no-check", "estimate", "no-dry-run"])
def test_verdict_fails_each_check(returncode, rows, atol, estimate, reason):
    assert any(reason in f for f in matrix.verdict(returncode, rows, estimate, atol)["failed"])


def test_table_has_a_row_per_case():
    results = [dict(case="qwen2_full", seconds=41.2, **matrix.verdict(0, _rows(), ESTIMATE, 0.05)),
               dict(case="qwen2_lora", seconds=30.0, **matrix.verdict(1, [], {}, 0.05))]
    lines = matrix.table(results).splitlines()
    assert len(lines) == 4 and "| qwen2_full | pass | 41 |" in lines[2]
    assert lines[3].startswith("| qwen2_lora | exit 1; 0 of 2 rollout batches logged |")
