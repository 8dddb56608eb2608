"""GRPO runs under TP=2, PP=2 and DP=2 reproduce the single-process run: the same rollouts
(per-request seeds), so the same rewards, advantages, losses and grad norms, to 1e-5.

Each run is the real command, `megatron rlhf`, relaunched under torchrun through NPROC_PER_NODE,
with the old-policy pass (steps_per_generation 2) and the reference model (beta > 0) active."""
import json
import os
import subprocess
import sys

import pytest

from tests.distributed.launch import REPO, free_port

pytestmark = pytest.mark.slow

COMMON = ["--num_generations", "4", "--global_batch_size", "8", "--micro_batch_size", "2",
          "--steps_per_generation", "2", "--max_completion_length", "12", "--train_iters", "4",
          "--beta", "0.04", "--lr", "1e-3", "--reward_funcs", "accuracy", "digit_ratio",
          "--log_interval", "1", "--report_to", "none", "--add_version", "false", "--seed", "3"]
LAYOUTS = {"tp2": ["--tensor_model_parallel_size", "2"],
           "pp2": ["--pipeline_model_parallel_size", "2"], "dp2": []}


def run_rlhf(model, dataset, out_dir, extra, nproc):
    plugin = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")
    cmd = [sys.executable, "-m", "swift_megatron.cli.main", "rlhf", "--model", model,
           "--dataset", dataset, "--external_plugins", plugin, "--output_dir", str(out_dir),
           *COMMON, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               MASTER_PORT=str(free_port()))
    if nproc > 1:
        env["NPROC_PER_NODE"] = str(nproc)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def setup(tiny_model_dir, math_dataset_path, tmp_path_factory):
    return tiny_model_dir("qwen3"), math_dataset_path, tmp_path_factory.mktemp("grpo_layouts")


_REFERENCES = {}


def reference(setup, loss_type):
    """The single-process run for a loss type (run once per module)."""
    if loss_type not in _REFERENCES:
        model, dataset, root = setup
        _REFERENCES[loss_type] = run_rlhf(model, dataset, root / f"single_{loss_type}",
                                          ["--loss_type", loss_type], 1)
    return _REFERENCES[loss_type]


KEYS = ["loss/policy", "grad_norm", "reward/mean", "kl", "entropy", "rollout/completion_tokens"]
# dapo normalises by the token count of the whole step (all DP ranks): the most layout-
# sensitive loss, run under every layout; grpo under DP=2.
CASES = [("dapo", "tp2"), ("dapo", "pp2"), ("dapo", "dp2"), ("grpo", "dp2")]


@pytest.mark.parametrize("loss_type,layout", CASES)
def test_layout_reproduces_single_process(setup, loss_type, layout):
    expected = reference(setup, loss_type)
    model, dataset, root = setup
    got = run_rlhf(model, dataset, root / f"{layout}_{loss_type}",
                   LAYOUTS[layout] + ["--loss_type", loss_type], 2)
    assert len(got) == len(expected) == 2
    for mine, ref in zip(got, expected):
        for key in KEYS:
            assert mine[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (layout, key)
    assert expected[1]["kl"] > 0 and expected[0]["grad_norm"] > 0  # the policy really moved
