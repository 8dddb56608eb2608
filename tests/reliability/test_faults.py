"""The fault corpus: real `megatron` runs on the tiny model meeting a full disk, a file size limit
(`ulimit -f`) and a `kill -9` in the middle of a save. A failed save ends with exit 2, one error
naming the path, the cause and what was kept, no traceback, the partial directory removed and
the last good checkpoint intact; a resume finishes what a killed save left undone. (Bad inputs
refused before anything loads: test_bad_inputs.py.)

The faults come from fault_worker.py (a kill -9 at a chosen point, a file size limit set in the
process), and the full disk from a small tmpfs where this machine lets the tests mount one (as
root); without it those cases are skipped with the reason."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from swift_megatron.checkpoint.integrity import check_checkpoint_files
from tests.distributed.launch import REPO, free_port, run_together

pytestmark = pytest.mark.slow
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_worker.py")
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")
LIMIT = 400 * 1024   # bytes (ulimit -f): below a tiny model's weight files, above its logs


def with_fault(fault, *argv):
    """The command of `megatron ARGV` with FAULT injected (fault_worker.py), as a torchrun
    worker script, which the tests' warm process forks."""
    return ([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
             "--master_addr=127.0.0.1", f"--master_port={free_port()}", WORKER, fault,
             *map(str, argv)], {"SWIFT_MEGATRON_NO_BAR": "1"})


def plain(*argv):
    return ([sys.executable, "-m", "swift_megatron.cli.main", *map(str, argv)],
            {"SWIFT_MEGATRON_NO_BAR": "1", "MASTER_PORT": str(free_port())})


def mount_tmpfs(path, size: str):
    """`path` made a tmpfs of `size` (True), or the reason it cannot be (it needs root and
    CAP_SYS_ADMIN)."""
    if os.geteuid() != 0:
        return "a full disk is simulated with a small tmpfs, which needs root to mount"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    return True if proc.returncode == 0 else f"cannot mount a tmpfs here: {proc.stderr.strip()}"


@pytest.fixture(scope="module")
def disks(tmp_path_factory):
    """{"save": a 6 MiB disk, "export": a 300 KiB disk}, each a path or why it is missing."""
    root = tmp_path_factory.mktemp("disks")
    found = {}
    for name, size in (("save", "6m"), ("export", "300k")):
        (root / name).mkdir()
        mounted = mount_tmpfs(root / name, size)
        found[name] = root / name if mounted is True else mounted
    yield found
    for path in found.values():
        if not isinstance(path, str):
            subprocess.run(["umount", str(path)], check=False)


def on_disk(disks, name):
    if isinstance(disks[name], str):
        pytest.skip(disks[name])
    return disks[name]


@pytest.fixture(scope="module")
def base(tiny_model_dir, math_dataset_path):
    return ["rlhf", "--model", tiny_model_dir("qwen3"), "--dataset", math_dataset_path,
            "--external_plugins", PLUGIN, "--reward_funcs", "digit_ratio", "contains_answer",
            "--num_generations", "4", "--global_batch_size", "8", "--micro_batch_size", "2",
            "--max_completion_length", "8", "--lr", "1e-3", "--report_to", "none",
            "--logging_steps", "1", "--save_steps", "1", "--add_version", "false"]


def run_all(commands: dict) -> dict:
    """Each command of `commands` (name -> (cmd, env)), all at once: name -> CompletedProcess."""
    return dict(zip(commands, run_together(list(commands.values()), timeout=900, cwd=REPO)))


@pytest.fixture(scope="module")
def runs(base, disks, tmp_path_factory):
    """The runs, at once: `straight` (3 steps, a save each), `killed` (the same, killed -9 in
    the HF copy of save 2), `fsize` (a file size limit after its first save), `full` (--save on
    the 6 MiB disk: the first save, about 4 MiB, fits, the second does not); then, at once,
    `resumed` (killed's resume into its directory) and `export_fsize` / `export_full`
    (`megatron export --to_hf` of straight's last checkpoint past the size limit / onto the
    300 KiB disk). Also what `killed` left in its directory before its resume."""
    root = tmp_path_factory.mktemp("faults")
    first = {"straight": plain(*base, "--train_iters", 3, "--output_dir", root / "straight"),
             "killed": with_fault("kill_in_hf_copy:2", *base, "--train_iters", 3,
                                  "--output_dir", root / "killed"),
             "fsize": with_fault(f"fsize_after_save:{LIMIT}", *base, "--train_iters", 2,
                                 "--output_dir", root / "fsize")}
    if not isinstance(disks["save"], str):
        first["full"] = plain(*base, "--train_iters", 2, "--output_dir", root / "full",
                              "--save", disks["save"] / "ckpt")
    procs = run_all(first)
    killed_left = sorted(os.listdir(root / "killed"))   # what the kill left, before the resume
    mcore = root / "straight" / "iter_0000003"
    then = {"resumed": plain(*base, "--train_iters", 3, "--output_dir", root / "killed",
                             "--load", root / "killed"),
            "export_fsize": with_fault(f"fsize:{LIMIT}", "export", "--mcore_model", mcore,
                                       "--to_hf", "true", "--output_dir", root / "limited_hf")}
    if not isinstance(disks["export"], str):
        then["export_full"] = plain("export", "--mcore_model", mcore, "--to_hf", "true",
                                    "--output_dir", disks["export"] / "hf")
    return root, {**procs, **run_all(then)}, killed_left


def failed_cleanly(proc, *expected):
    """Exit 2, one error line holding each of `expected`, no traceback."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-4000:]
    for text in expected:
        assert text in errors[0], errors[0]
    return errors[0]


def staging_left(directory) -> list:
    return [name for name in os.listdir(directory) if re.search(r"\.tmp(-\d+)?$", name)]


def logged(out):
    with open(os.path.join(out, "logging.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_kill_9_during_an_hf_copy_is_finished_by_the_resume(runs):
    """issue 57: killed while checkpoint-2 was staged, the run left checkpoint-2.tmp-PID for
    good and never wrote checkpoint-2, and best_checkpoint.json never saw step 2. A resume into
    the same directory writes checkpoint-2 (the weights a straight run saved there), sweeps the
    staging directory, and the best save is the best of steps 1-3."""
    root, procs, left = runs
    killed = root / "killed"
    assert procs["killed"].returncode == -9, procs["killed"].stderr[-3000:]
    assert "iter_0000002" in left and "checkpoint-2" not in left
    assert [name for name in left if name.startswith("checkpoint-2.tmp-")], left
    resumed = procs["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert "writing the HF copies of step 2, which the run that saved" in resumed.stdout
    assert staging_left(killed) == []
    for step in (1, 2, 3):
        assert (killed / f"checkpoint-{step}" / "model.safetensors").is_file(), step
    from safetensors.torch import load_file

    mine = load_file(killed / "checkpoint-2" / "model.safetensors")
    straight = load_file(root / "straight" / "checkpoint-2" / "model.safetensors")
    assert mine.keys() == straight.keys()
    assert all(torch.equal(mine[name], straight[name]) for name in mine)
    rewards = {row["step"]: row["reward/mean"] for row in logged(killed)}
    assert sorted(rewards) == [1, 2, 3]
    best = json.load(open(killed / "best_checkpoint.json"))
    assert best["step"] == max(rewards, key=rewards.get)
    assert best["reward"] == pytest.approx(rewards[best["step"]])


def test_a_file_size_limit_during_a_save_keeps_the_last_checkpoint(runs):
    """issue 57: `ulimit -f` during a save was `unexpected pos 704 vs 598` and a traceback, the
    partial iter_*.tmp left behind."""
    root, procs, _ = runs
    out = root / "fsize"
    failed_cleanly(procs["fsize"], f"could not write {out}/iter_0000002: file too large: this "
                   f"process may write files of at most {LIMIT} bytes (ulimit -f)",
                   f"Removed the partial {out}/iter_0000002.tmp-",
                   f"the last checkpoint {out}/iter_0000001 (step 1) is intact: resume from it "
                   f"with --load {out}")
    assert staging_left(out) == [] and not (out / "iter_0000002").exists()
    assert open(out / "latest_checkpointed_iteration.txt").read() == "1"
    check_checkpoint_files(str(out / "iter_0000001"))


def test_a_full_disk_during_a_save_keeps_the_last_checkpoint(runs, disks):
    """issue 57: a save onto a full disk was a CheckpointException traceback, and the partial
    iter_0000002.tmp kept the disk full."""
    save = on_disk(disks, "save") / "ckpt"
    failed_cleanly(runs[1]["full"], f"could not write {save}/iter_0000002: no space left on "
                   "device", f"the last checkpoint {save}/iter_0000001 (step 1) is intact")
    assert staging_left(save) == [] and not (save / "iter_0000002").exists()
    assert open(save / "latest_checkpointed_iteration.txt").read() == "1"
    check_checkpoint_files(str(save / "iter_0000001"))


def test_export_past_the_file_size_limit(runs):
    """issue 57: `megatron export --to_hf` past `ulimit -f` was a SafetensorError traceback and
    left an empty OUT.tmp-PID."""
    root, procs, _ = runs
    out = root / "limited_hf"
    failed_cleanly(procs["export_fsize"], f"could not write {out}: file too large",
                   f"nothing was written at {out}")
    assert not out.exists() and staging_left(root) == []


def test_export_onto_a_full_disk(runs, disks):
    out = on_disk(disks, "export") / "hf"
    failed_cleanly(runs[1]["export_full"], f"could not write {out}: no space left on device",
                   f"nothing was written at {out}")
    assert os.listdir(out.parent) == []
