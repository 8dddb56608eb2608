"""`megatron rlhf --multi_turn_scheduler` as a subprocess on the tiny model: a two-turn task
(the demo's lookup_tool: the answer arrives in a tool message after the first turn) trains
end to end with the embedded engine; every episode has two model turns with the tool's tokens
between them, and the metrics and completions log say so."""
import json
import os

import pytest

from tests.distributed.launch import REPO
from tests.e2e.test_rlhf_e2e import logged, rlhf

pytestmark = pytest.mark.slow
DEMO = os.path.join(REPO, "swift_megatron", "demo")


def test_two_turn_tool_task_trains(tiny_model_dir, math_dataset_path, tmp_path):
    out = tmp_path / "run"
    rlhf("--model", tiny_model_dir("qwen3"), "--dataset", math_dataset_path,
         "--external_plugins", os.path.join(DEMO, "rewards.py"), os.path.join(DEMO, "multi_turn.py"),
         "--multi_turn_scheduler", "lookup_tool", "--max_turns", 2,
         "--reward_funcs", "contains_answer", "digit_ratio",
         "--num_generations", 4, "--global_batch_size", 8, "--micro_batch_size", 2,
         "--max_completion_length", 8, "--max_length", 96, "--beta", 0.1, "--lr", "1e-3",
         "--train_iters", 2, "--report_to", "none", "--logging_steps", 1, "--add_version", "false",
         "--log_completions", "true", "--output_dir", out)
    rows = logged(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["multi_turn/num_turns_mean"] == 2.0 and row["multi_turn/num_turns_max"] == 2.0
        assert 0 < row["multi_turn/model_tokens_mean"] <= 2 * 8
        assert row["multi_turn/env_tokens_mean"] >= 8   # "\n<|im_start|>tool\n<result>N</result>..."
        assert row["multi_turn/turn_2_reward_mean"] == 0.0   # lookup_tool gives no turn rewards
        assert 0.0 <= row["reward/contains_answer/mean"] <= 1.0
    assert rows[0]["grad_norm"] > 0 and rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0
    completions = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert len(completions) == 2 * 8
    for c in completions:
        assert c["rollout_infos"]["num_turns"] == 2
        assert "<result>" in c["completion"]          # the tool's message sits between the turns
