"""`megatron rlhf --multi_turn_scheduler` as a subprocess on the tiny model, with the embedded
engine: the two-turn task of scripts/grpo/cpu_multi_turn.sh (the demo's lookup_tool answers the
first turn with the row's solution as a tool message; the second turn is scored). Every episode
has two model turns with the tool's tokens between them, the metrics and completions log say
so, and the model learns the task within 40 steps (the reward rises from ~0.01 to ~1; the
answer is only in the tool's message)."""
import json
import os

import pytest

from tests.distributed.launch import REPO
from tests.e2e.test_rlhf_e2e import logged, rlhf

pytestmark = pytest.mark.slow
DEMO = os.path.join(REPO, "swift_megatron", "demo")


def test_two_turn_tool_task_is_learned(tiny_model_dir, tmp_path):
    from swift_megatron.fixtures import build_math_dataset

    out = tmp_path / "run"
    rlhf("--model", tiny_model_dir("qwen3"),
         "--dataset", build_math_dataset(str(tmp_path / "math.jsonl"), num_rows=256),
         "--external_plugins", os.path.join(DEMO, "rewards.py"), os.path.join(DEMO, "multi_turn.py"),
         "--multi_turn_scheduler", "lookup_tool", "--max_turns", 2,
         "--reward_funcs", "contains_answer", "digit_ratio",
         "--num_generations", 4, "--global_batch_size", 32, "--micro_batch_size", 8,
         "--max_completion_length", 8, "--max_length", 128, "--beta", 0, "--lr", "3e-3",
         "--lr_decay_style", "constant", "--train_iters", 40, "--report_to", "none",
         "--logging_steps", 1, "--add_version", "false", "--log_completions", "true",
         "--output_dir", out)
    rows = logged(out)
    assert [r["step"] for r in rows] == list(range(1, 41))
    for row in rows:
        assert row["multi_turn/num_turns_mean"] == 2.0 and row["multi_turn/num_turns_max"] == 2.0
        assert 0 < row["multi_turn/model_tokens_mean"] <= 2 * 8
        assert row["multi_turn/env_tokens_mean"] >= 8   # "<|im_end|>\n<|im_start|>tool\n<result>..."
        assert row["multi_turn/turn_2_reward_mean"] == 0.0   # lookup_tool gives no turn rewards
    first = sum(r["reward/mean"] for r in rows[:4]) / 4
    last = sum(r["reward/mean"] for r in rows[-4:]) / 4
    print(f"reward/mean: first 4 steps {first:.3f}, last 4 steps {last:.3f}")
    assert first < 0.05 and last > 0.4
    assert max(r["reward/contains_answer/mean"] for r in rows[-4:]) > 0.2
    completions = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert len(completions) == 40 * 32
    for c in completions:
        assert c["rollout_infos"]["num_turns"] == 2
        assert "<result>" in c["completion"]          # the tool's message sits between the turns


def test_grid_world_gym_reward_wiring(tiny_model_dir, tmp_path):
    """gym_scheduler + grid_world with only the environment's reward (--use_gym_env, implied by
    --gym_env): the environment writes the prompt, its total reward is the reward column
    gym_reward. (The random model's turns hit the length limit, which ends each episode after
    its first turn; the multi-turn loop itself is covered above and in the unit tests.)"""
    data = tmp_path / "lake.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "<placeholder>"}],
                                        "env_config": {"seed": i, "size": 3}}) + "\n"
                            for i in range(16)))
    out = tmp_path / "run"
    rlhf("--model", tiny_model_dir("qwen3"), "--dataset", data,
         "--multi_turn_scheduler", "gym_scheduler", "--gym_env", "grid_world", "--max_turns", 3,
         "--num_generations", 4, "--global_batch_size", 8, "--micro_batch_size", 2,
         "--max_completion_length", 8, "--max_length", 256, "--beta", 0, "--train_iters", 1,
         "--report_to", "none", "--logging_steps", 1, "--add_version", "false",
         "--log_completions", "true", "--output_dir", out)
    [row] = logged(out)
    assert row["reward/gym_reward/mean"] == 0.0 and row["multi_turn/turn_1_reward_mean"] == 0.0
    assert row["multi_turn/num_turns_mean"] == 1.0 and row["rollout/truncated_fraction"] == 1.0
    completions = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert len(completions) == 8
    for c in completions:
        assert c["prompt"].startswith("<|im_start|>system\nYou are walking on a frozen lake")
        assert "P" in c["prompt"] and "<placeholder>" not in c["prompt"]
        assert c["rewards"] == {"gym_reward": 0.0} and c["rollout_infos"]["status"] == "invalid"
