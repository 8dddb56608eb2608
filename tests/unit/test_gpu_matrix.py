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
    assert len(cases) == 2 * len(matrix.FAMILIES) and {c.gpus for c in cases} == {1}
    assert {(c.family, c.mode) for c in cases} == {(f, m) for f in matrix.FAMILIES
                                                  for m in ("full", "lora")}
    assert {c.gpus for c in matrix.all_cases("matrix_2gpu")} == {2}
    assert {c.gpus for c in matrix.all_cases("matrix_4gpu")} == {4}


def test_select_takes_cases_and_families():
    cases = matrix.all_cases()
    assert [c.name for c in matrix.select(cases, ["qwen3_5", "llama3_lora"])] == \
        ["qwen3_5_full", "qwen3_5_lora", "llama3_lora"]
    assert matrix.select(cases, []) == cases
    with pytest.raises(SystemExit, match="unknown matrix case"):
        matrix.select(cases, ["qwen4"])


def _parsed(case):
    from swift_megatron.arguments.batch_plan import make_batch_plan
    from swift_megatron.arguments.commands import RlhfArguments, batch_inputs
    from swift_megatron.arguments.parser import parse_command

    cmd = matrix.command(case, "/m", ["--dataset", "d.jsonl", "--reward_funcs", "accuracy"],
                         "/o", 8123)
    args = parse_command(RlhfArguments, cmd[cmd.index("rlhf") + 1:], "megatron rlhf")
    trainer_ranks = case.gpus - case.server
    return args, make_batch_plan(batch_inputs(args, world_size=trainer_ranks, num_experts=64,
                                              colocate_vllm=not case.server))


@pytest.mark.parametrize("part", ["matrix", "matrix_2gpu", "matrix_4gpu"])
def test_commands_pass_the_argument_checks(part):
    """Each case's flags parse and satisfy the batch rules on its GPUs (the CLI's parser, no
    model): 64 completions per rollout batch and data-parallel rank, the weight-sync check."""
    for case in matrix.all_cases(part):
        args, plan = _parsed(case)
        assert plan.dp_size == case.dp, case.name
        assert plan.generation_batch_size == 64 * case.dp and args.rollout.check_weight_sync
        assert args.training.train_type == case.mode
        assert args.rollout.vllm_mode == ("server" if case.server else "colocate")
        if case.server:
            assert args.rollout.vllm_server_port == [8123]


def test_lanes_split_the_gpus():
    one, two = matrix.all_cases(), matrix.all_cases("matrix_2gpu")
    assert matrix.lanes(one, 1) == [(0,)]
    assert matrix.lanes(one, 4) == [(0,), (1,), (2,), (3,)]
    assert matrix.lanes(two, 4) == [(0, 1), (2, 3)] and matrix.lanes(two, 3) == [(0, 1)]
    with pytest.raises(SystemExit, match="need 2 GPUs; 1 visible"):
        matrix.lanes(two, 1)


def test_run_all_spreads_cases_and_runs_lora_after_full():
    """Every case runs once, on one lane at a time; a family's LoRA case starts after its full
    case ended (the compile caches); a case whose harness raises fails alone."""
    import threading
    import time

    cases = matrix.select(matrix.all_cases(), ["qwen3_5", "qwen2", "llama3"])
    starts, ends, lanes_used, lock = {}, {}, set(), threading.Lock()

    def run(case, gpus, lane):
        with lock:
            starts[case.name] = time.monotonic()
            lanes_used.add(gpus)
        time.sleep(0.05)
        if case.name == "llama3_full":
            raise RuntimeError("boom")
        ends[case.name] = time.monotonic()
        return dict(case=case.name, failed=[])

    results = matrix.run_all(cases, matrix.lanes(cases, 2), run)
    assert [r["case"] for r in results] == [c.name for c in cases]
    by_name = {r["case"]: r for r in results}
    assert by_name["llama3_full"]["failed"] == ["harness: RuntimeError('boom')"]
    assert by_name["qwen2_full"]["failed"] == []
    assert set(starts) == {c.name for c in cases} and lanes_used == {(0,), (1,)}
    for family in ("qwen3_5", "qwen2"):
        assert ends[f"{family}_full"] <= starts[f"{family}_lora"]
    assert "llama3_lora" in starts   # ran after its failed full case


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
