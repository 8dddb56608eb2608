"""benchmarks/host_profile.py's reduction of py-spy's raw output: stacks in py-spy 0.4's form
(nested process frames with --subprocesses, a thread frame with --threads, methods named
`Class.method`, paths relative to sys.path) are split by thread, the training worker's main thread
by phase, with self and inclusive shares."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
host_profile = pytest.importorskip("host_profile")

LAUNCH = 'process 10:"python3 benchmarks/trl_compare.py --tool ours";' \
         'process 11:"python3 -m torch.distributed.run --nproc_per_node=1 -m swift_megatron"'
WORKER = LAUNCH + ';process 12:"python3 -u -m swift_megatron.cli.main rlhf";thread (12): MainThread'
BATCH = WORKER + ';main (swift_megatron/cli/main.py:47);' \
    'GRPOTrainer.train_rollout_batch (swift_megatron/rlhf/grpo/trainer.py:136)'
RAW = f"""{BATCH};GRPOTrainer.collect (swift_megatron/rlhf/grpo/trainer.py:180);generate (vllm/entrypoints/llm.py:400) 30
{BATCH};GRPOTrainer.collect (swift_megatron/rlhf/grpo/trainer.py:180);score (swift_megatron/rewards/registry.py:344) 10
{BATCH};GRPOTrainer.fill_logprobs (swift_megatron/rlhf/grpo/trainer.py:250);forward (megatron/core/models/gpt/gpt_model.py:300) 20
{BATCH};GRPOTrainer.optimizer_step (swift_megatron/rlhf/grpo/trainer.py:270);forward (megatron/core/models/gpt/gpt_model.py:300) 15
{BATCH};GRPOTrainer.optimizer_step (swift_megatron/rlhf/grpo/trainer.py:270);AdapterBranch.backward (swift_megatron/lora/branch.py:80) 45
{BATCH};GRPOTrainer.sync_weights (swift_megatron/rlhf/grpo/trainer.py:320) 5
{WORKER};main (swift_megatron/cli/main.py:47);build (swift_megatron/model/build.py:10) 25
{LAUNCH};thread (11): MainThread;wait (subprocess.py:1264) 150
process 10:"python3 benchmarks/trl_compare.py --tool ours";thread (10): MainThread;wait (subprocess.py:1264) 150
not a stack line
"""


def test_phases_of_the_workers_main_thread():
    summary = host_profile.summarize(host_profile.parse_raw(RAW.splitlines()))
    assert summary["total"] == 450
    assert summary["worker"] == "process 12: thread (12): MainThread"
    phases = summary["phases"]
    assert {name: p["samples"] for name, p in phases.items()} == \
        {"rollout": 40, "logprobs": 20, "train": 60, "sync": 5, "other": 25}
    assert phases["train"]["self"] == [
        ("AdapterBranch.backward (swift_megatron/lora/branch.py:80)", 45),
        ("forward (megatron/core/models/gpt/gpt_model.py:300)", 15)]
    inclusive = dict(phases["rollout"]["inclusive"])
    assert inclusive["GRPOTrainer.collect (swift_megatron/rlhf/grpo/trainer.py:180)"] == 40
    assert inclusive["generate (vllm/entrypoints/llm.py:400)"] == 30
    # the launchers' threads are reported apart, self frames only
    assert summary["other_threads"]["process 11: thread (11): MainThread"] == \
        [("wait (subprocess.py:1264)", 150)]


def test_render_gives_each_phase_its_shares():
    text = host_profile.render(host_profile.summarize(host_profile.parse_raw(RAW.splitlines())))
    train = text[text.index("== phase train"):text.index("== phase sync")]
    assert "60 samples" in train
    assert " 75.0%  AdapterBranch.backward (swift_megatron/lora/branch.py:80)" in train
    assert text.index("== phase rollout") < text.index("== phase logprobs") \
        < text.index("== phase train") < text.index("== phase sync") < text.index("== phase other")


def test_short_drops_the_install_prefix():
    assert host_profile.short("f (/opt/venv/lib/python3.12/site-packages/vllm/x.py:3)") == \
        "f (vllm/x.py:3)"
    assert host_profile.short("g (/work/main/swift_megatron/lora/branch.py:9)") == \
        "g (swift_megatron/lora/branch.py:9)"
    assert host_profile.short("thread (12): MainThread") == "thread (12): MainThread"
