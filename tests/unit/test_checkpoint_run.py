"""What a run saves and where it starts from (checkpoint/run.py, checkpoint/start.py), on
directories laid out as the trainer writes them: --save_total_limit keeps the latest and the
best, final_hf hard-links the last save, and ms-swift's --mcore_model / --mcore_adapter /
--finetune map onto weights, adapters and resumed state."""
import json
import os

import pytest

from swift_megatron.arguments.lora import LoraArguments
from swift_megatron.arguments.training import TrainingArguments
from swift_megatron.checkpoint import run
from swift_megatron.checkpoint.start import plan_start
from swift_megatron.errors import UserError


def fake_save(save_dir, step, hf=True, lora=False):
    """The files the trainer writes for one save (markers only)."""
    iteration = os.path.join(save_dir, f"iter_{step:07d}")
    os.makedirs(iteration)
    open(os.path.join(iteration, "swift_megatron.json"), "w").write("{}")
    if lora:
        os.makedirs(os.path.join(iteration, "adapter"))
        open(os.path.join(iteration, "adapter", "adapter_config.json"), "w").write("{}")
    if hf:
        os.makedirs(run.hf_dir(save_dir, step))
        open(os.path.join(run.hf_dir(save_dir, step), "model.safetensors"), "w").write(str(step))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(step))


def test_rotation_keeps_the_newest_and_the_best(tmp_path):
    save = str(tmp_path)
    rewards = {10: 0.1, 20: 0.9, 30: 0.3, 40: 0.2, 50: 0.4}
    deleted = []
    for step, reward in rewards.items():
        fake_save(save, step)
        run.record_best(save, step, reward)
        deleted += run.rotate(save, limit=3)
    assert run.saved_steps(save) == [20, 40, 50]  # best 20, then the newest
    assert deleted == [10, 30]
    assert not os.path.exists(run.hf_dir(save, 10))
    assert json.load(open(os.path.join(save, run.BEST_FILE))) == {"step": 20, "reward": 0.9}
    assert run.rotate(save, limit=None) == []


def test_best_ignores_non_finite_rewards(tmp_path):
    fake_save(str(tmp_path), 1)
    run.record_best(str(tmp_path), 1, float("nan"))
    assert not os.path.exists(os.path.join(tmp_path, run.BEST_FILE))


def test_link_tree_makes_hard_links(tmp_path):
    fake_save(str(tmp_path), 4)
    final = str(tmp_path / "final_hf")
    run.link_tree(run.hf_dir(str(tmp_path), 4), final)
    source = os.path.join(run.hf_dir(str(tmp_path), 4), "model.safetensors")
    assert os.path.samefile(source, os.path.join(final, "model.safetensors"))
    run.link_tree(run.hf_dir(str(tmp_path), 4), final)  # replacing works too
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-4", "final_hf", "iter_0000004",
                                            "latest_checkpointed_iteration.txt"]


def start(lora=(), **training):
    return plan_start(TrainingArguments(**training), LoraArguments(adapters=list(lora)))


def test_starting_points(tmp_path):
    from swift_megatron.checkpoint.sources import AdapterSource, WeightsSource

    save = str(tmp_path / "ckpt")
    fake_save(save, 2, lora=True)
    full = str(tmp_path / "full")
    fake_save(full, 3)
    iteration = os.path.join(save, "iter_0000002")
    full_iteration = os.path.join(full, "iter_0000003")
    weights = WeightsSource("mcore", full_iteration, os.path.join(full_iteration, "hf"))
    peft = tmp_path / "peft_dir"
    peft.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (peft / name).write_text("{}")
    adapter = AdapterSource(os.path.join(iteration, "adapter"),
                            base=WeightsSource("mcore", iteration, os.path.join(iteration, "hf")))
    assert start() == run_start(None, None, None)
    assert start(load=save) == run_start(None, None, iteration)
    assert start(mcore_model=full) == run_start(weights, None, None)       # finetune: weights
    assert start(mcore_model=full, finetune=False) == run_start(weights, None, full_iteration)
    assert start(mcore_adapter=save) == run_start(None, adapter, None)
    assert start(mcore_adapter=iteration, finetune=False) == run_start(None, adapter, iteration)
    assert start(lora=[str(peft)]) == run_start(None, AdapterSource(str(peft)), None)


def run_start(weights, adapter, resume):
    from swift_megatron.checkpoint.start import Start

    return Start(weights, adapter, resume)


def test_bad_starting_points(tmp_path):
    with pytest.raises(UserError, match="--mcore_model .*missing: no such directory"):
        start(mcore_model=str(tmp_path / "missing"))
    with pytest.raises(UserError, match="--load .*: neither a save directory"):
        start(load=str(tmp_path))
    save = str(tmp_path / "full")
    fake_save(save, 1)
    with pytest.raises(UserError, match="no adapter/ directory"):
        start(mcore_adapter=save)
    with pytest.raises(UserError, match="not both"):
        start(load=save, mcore_model=save)


def test_resuming_the_optimizer_needs_the_saved_layout(tmp_path):
    from types import SimpleNamespace

    from swift_megatron.checkpoint.start import check_resume_layout

    (tmp_path / "optimizer").mkdir()
    (tmp_path / "swift_megatron.json").write_text(json.dumps(
        {"saved_with": {"tp": 2, "pp": 1, "ep": 1, "etp": 2}}))

    def layout(tp=2, pp=1, ep=1, etp=None, first=None):
        return SimpleNamespace(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp,
                               decoder_first_pipeline_num_layers=first,
                               decoder_last_pipeline_num_layers=None)

    check_resume_layout(str(tmp_path), layout(), load_optim=True)           # same layout
    check_resume_layout(str(tmp_path), layout(tp=1), load_optim=False)      # --no_load_optim
    with pytest.raises(UserError, match=r"--tensor_model_parallel_size 2 \(this run: 1\): its "
                                        r"optimizer state resumes only in that layout.*"
                                        r"--no_load_optim"):
        check_resume_layout(str(tmp_path), layout(tp=1), load_optim=True)
    with pytest.raises(UserError, match=r"--pipeline_model_parallel_size 1 \(this run: 2\)$"
                                        r"|--pipeline_model_parallel_size 1 \(this run: 2\):"):
        check_resume_layout(str(tmp_path), layout(pp=2), load_optim=True)
    with pytest.raises(UserError, match=r"--expert_model_parallel_size 1 \(this run: 2\), "
                                        r"--expert_tensor_parallel_size 2 \(this run: 1\)"):
        check_resume_layout(str(tmp_path), layout(ep=2, etp=1), load_optim=True)
    with pytest.raises(UserError, match=r"--decoder_first_pipeline_num_layers none \(this "
                                        r"run: 3\)"):    # the stages' shards differ
        check_resume_layout(str(tmp_path), layout(first=3), load_optim=True)
    (tmp_path / "swift_megatron.json").write_text(json.dumps(
        {"saved_with": {"tp": 2, "pp": 2, "ep": 1, "etp": 2, "first": 3}}))
    check_resume_layout(str(tmp_path), layout(pp=2, first=3), load_optim=True)
    with pytest.raises(UserError, match=r"--decoder_first_pipeline_num_layers 3 \(this run: "
                                        r"none\)"):
        check_resume_layout(str(tmp_path), layout(pp=2), load_optim=True)
    (tmp_path / "optimizer").rmdir()                                        # saved without it
    check_resume_layout(str(tmp_path), layout(tp=1), load_optim=True)


def test_resuming_a_moe_optimizer_needs_the_same_form_of_experts(tmp_path):
    from types import SimpleNamespace

    from swift_megatron.checkpoint.start import check_resume_layout

    (tmp_path / "optimizer").mkdir()
    (tmp_path / "swift_megatron.json").write_text(json.dumps(
        {"saved_with": {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "grouped_experts": True}}))
    layout = SimpleNamespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                             expert_model_parallel_size=1, expert_tensor_parallel_size=1,
                             decoder_first_pipeline_num_layers=None,
                             decoder_last_pipeline_num_layers=None)
    check_resume_layout(str(tmp_path), layout, load_optim=True, grouped_experts=True)
    check_resume_layout(str(tmp_path), layout, load_optim=True)    # LoRA: experts not trained
    check_resume_layout(str(tmp_path), layout, load_optim=False, grouped_experts=False)
    with pytest.raises(UserError, match=r"--moe_grouped_gemm true \(this run: false\): its "
                                        r"optimizer state resumes only in that layout"):
        check_resume_layout(str(tmp_path), layout, load_optim=True, grouped_experts=False)


def test_resuming_past_the_runs_steps_is_refused(tmp_path):
    """The step in trainer_state.json against this run's optimizer steps (--train_iters, or
    what --num_train_epochs gives): equal resumes as a finished run, beyond is an error."""
    from swift_megatron.checkpoint.start import check_resume_step

    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 6}))
    check_resume_step(str(tmp_path), 6)
    check_resume_step(str(tmp_path), 0)        # not known yet (derived from the dataset later)
    check_resume_step(None, 3)                 # nothing to resume
    check_resume_step(str(tmp_path / "weights_only"), 3)   # no trainer state: weights only
    with pytest.raises(UserError, match=f"{tmp_path} is at step 6, beyond this run's 5 optimizer "
                                        r"steps \(--train_iters / --num_train_epochs\)"):
        check_resume_step(str(tmp_path), 5)


def test_staging_directories_of_dead_runs_are_swept(tmp_path):
    """A killed run leaves final_hf.tmp-PID; the next link (or export) to final_hf removes it,
    but never the staging directory of a live process."""
    import subprocess
    import sys

    from swift_megatron.paths import sweep_stale

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"final_hf.tmp-{dead}"
    live = tmp_path / f"final_hf.tmp-{os.getppid()}"
    other = tmp_path / f"final_hf_other.tmp-{dead}"
    for directory in (stale, live, other):
        directory.mkdir()
    fake_save(str(tmp_path / "save"), 3)
    run.link_tree(run.hf_dir(str(tmp_path / "save"), 3), str(tmp_path / "final_hf"))
    assert not stale.exists() and live.exists() and other.exists()
    assert sweep_stale(str(tmp_path / "final_hf")) == []
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == \
        sorted([live.name, other.name])


def test_the_hf_writer_sweeps_what_a_killed_export_staged(tiny_model_dir, tmp_path):
    """issue 40: a killed `megatron export --to_hf` left OUT.tmp-PID, which a later export to
    the same OUT kept for good (the HF writer did not sweep)."""
    import json
    import subprocess
    import sys

    import torch

    from swift_megatron.bridge.hf_checkpoint import write_hf_checkpoint

    model = tiny_model_dir("qwen3")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = tmp_path / f"out.tmp-{dead}"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"partial")
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    write_hf_checkpoint([("w", torch.zeros(2))], str(tmp_path / "out"), hf_config=config,
                        source_dir=model)
    assert not stale.exists() and (tmp_path / "out" / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("saving", [True, False])
def test_checkpoint_writer_children_die_with_the_trainer(saving):
    """issue 40: megatron's torch_dist writer forks copies of the trainer; a trainer killed
    during a shard write left them running with PPID 1. Children forked inside the save
    (writer_children_die_with_us) are killed with it; others are not touched."""
    import signal
    import subprocess
    import sys
    import time

    script = f"""
import os, signal, sys, time
import swift_megatron.checkpoint.forks as d
with (d.writer_children_die_with_us() if {saving} else open(os.devnull)):
    pid = os.fork()
    if pid == 0:   # let go of the test's pipes, then wait to be killed (or 60 s)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
print(pid, flush=True)
time.sleep(0.5)
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    child = int(proc.stdout.split()[0])

    def alive():
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.time() + 10
    while alive() and saving and time.time() < deadline:
        time.sleep(0.1)
    try:
        assert alive() != saving
    finally:
        if alive():
            os.kill(child, signal.SIGKILL)
