"""`megatron rlhf` on the tiny qwen3_moe with ms-swift's MoE flags, as a subprocess, the
embedded engine (CPU): R3 routing replay with the load-balancing and z-losses on (the losses
logged under moe/, the weight-sync check replaying the engine's routes), and R2 with two
passes over each rollout batch (the old-policy pass records, both passes replay)."""
import json
import math
import os

import pytest

from tests.distributed.launch import REPO, run_cli_together

pytestmark = pytest.mark.slow
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")


@pytest.fixture(scope="module")
def runs(tiny_model_dir, math_dataset_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_e2e")
    common = ["--model", tiny_model_dir("qwen3_moe"), "--dataset", math_dataset_path,
              "--external_plugins", PLUGIN, "--reward_funcs", "digit_ratio", "contains_answer",
              "--num_generations", "4", "--global_batch_size", "8", "--micro_batch_size", "4",
              "--steps_per_generation", "2", "--max_completion_length", "12", "--beta", "0.1",
              "--lr", "1e-3", "--report_to", "none", "--logging_steps", "1",
              "--add_version", "false", "--use_vllm", "false"]
    cases = {"r3": ["--router_replay_mode", "R3", "--moe_aux_loss_coeff", "0.01",
                    "--moe_z_loss_coeff", "0.001", "--check_weight_sync", "true",
                    "--train_iters", "4"],
             "r2": ["--router_replay_mode", "R2", "--num_iterations", "2", "--train_iters", "4"]}
    procs = run_cli_together([(["rlhf", *common, "--output_dir", root / name, *extra], {})
                              for name, extra in cases.items()])
    rows = {}
    for name, proc in zip(cases, procs):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        with open(root / name / "logging.jsonl") as f:
            rows[name] = [json.loads(line) for line in f]
    return rows


def test_r3_with_aux_and_z_losses(runs):
    rows = runs["r3"]
    assert [r["step"] for r in rows] == [2, 4]
    for row in rows:
        # E x sum_e f_e P_e is 1 for perfectly balanced routing, at most E = 8
        assert 0.5 < row["moe/load_balancing_loss"] < 8
        assert row["moe/z_loss"] > 0 and math.isfinite(row["loss/policy"])
        assert row["sync/logprob_abs_diff_mean"] < 1e-5   # float32 engine, its routes replayed
    assert rows[0]["numerics/first_step_gap"] < 1e-5


def test_r2_over_two_passes(runs):
    rows = runs["r2"]
    assert [r["step"] for r in rows] == [4]      # one rollout batch: 2 steps x 2 passes
    assert math.isfinite(rows[0]["loss/policy"]) and rows[0]["grad_norm"] > 0
    assert not any(key.startswith("moe/") for key in rows[0])   # no aux loss asked for
