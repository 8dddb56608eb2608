"""`megatron rlhf` as a subprocess on the tiny model: the first step's KL is exactly 0 (the
reference equals the policy), checkpoints resume bit-identically, the final HF export loads in
transformers, completions are logged, the run report is written (at the end and at a save),
user mistakes exit 2 without a traceback, --reward_error_policy skip trains on, a run without
learning signal says so, and `kill -9` leaves no process behind."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.distributed.launch import REPO, free_port, run_cli_together

pytestmark = pytest.mark.slow
PLUGIN = os.path.join(REPO, "swift_megatron", "demo", "rewards.py")


def rlhf(*argv, check=True):
    return rlhf_together([argv], check)[0]


def rlhf_together(argvs, check=True):
    """`megatron rlhf ARGV` for each ARGV in `argvs`, all at once; their CompletedProcess."""
    procs = run_cli_together([(["rlhf", *argv], {}) for argv in argvs])
    for proc in procs if check else ():
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return procs


def logged(out_dir):
    with open(os.path.join(out_dir, "logging.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def base(tiny_model_dir, math_dataset_path):
    return ["--model", tiny_model_dir("qwen3"), "--dataset", math_dataset_path,
            "--external_plugins", PLUGIN, "--reward_funcs", "digit_ratio", "contains_answer",
            "--num_generations", "4", "--global_batch_size", "16", "--micro_batch_size", "4",
            "--max_completion_length", "16", "--beta", "0.1", "--lr", "1e-3", "--report_to", "none",
            "--logging_steps", "1", "--add_version", "false"]


def test_first_step_kl_is_exactly_zero_and_outputs(base, tmp_path):
    out = tmp_path / "run"
    proc = rlhf(*base, "--train_iters", 2, "--output_dir", out, "--log_completions", "true",
                "--split_dataset_ratio", "0.1", "--eval_interval", 2, "--check_weight_sync",
                "true", "--num_generations_eval", 2, "--save_steps", 1,
                "--max_shard_size", "100KB")
    # the run's last words: where its model, checkpoints and report are (issue 57)
    last = proc.stdout.splitlines()[-5:]
    assert last[0].startswith("INFO finished: 2 optimizer steps in "), proc.stdout[-2000:]
    best = json.load(open(out / "best_checkpoint.json"))
    assert last[1:] == [f"INFO final model (Hugging Face): {out}/final_hf",
                        f"INFO last checkpoint: {out}/iter_0000002 (Hugging Face copy: "
                        f"{out}/checkpoint-2)",
                        f"INFO best checkpoint: {out}/checkpoint-{best['step']} (step "
                        f"{best['step']}, reward/mean {best['reward']:.4g})",
                        f"INFO report: {out}/report/summary.md"]
    rows = logged(out)
    assert all(r["sync/logprob_abs_diff_mean"] < 1e-5 for r in rows)  # fp32: engine == trainer
    assert all(r["time/sync_s"] > 0 and r["time/sync_check_s"] > 0 for r in rows)  # timed apart
    assert all(0 <= r["perf/gc_pause_s"] < r["time/rollout_s"] + r["time/train_s"] for r in rows)
    assert "eval/reward/mean" in rows[1] and "eval/reward/mean" not in rows[0]
    assert 0.0 <= rows[1]["eval/reward/digit_ratio/mean"] <= 1.0
    assert rows[1]["eval/num_completions"] == 7 * 2  # ceil(0.1 x 64) prompts x num_generations_eval
    assert [r["step"] for r in rows] == [1, 2]
    # each step's own rate (issue 57; Megatron's convention logged the next: 5e-4, then 0):
    # --lr 1e-3 decayed over 2 steps by a cosine to 0, at 0 and 1 step of decay
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 5e-4], rel=1e-9)
    assert rows[0]["grad_norm"] > 0      # the rewards had signal: the first step updated
    assert rows[0]["kl"] == 0.0          # reference == policy before the first update
    # the numerics gate ran on the first step only: qwen3 is dense, fp32 engine == trainer
    assert rows[0]["numerics/tolerance"] == 0.05 and rows[0]["numerics/first_step_gap"] < 1e-5
    assert "numerics/first_step_gap" not in rows[1]
    assert rows[1]["kl"] > 0.0
    completions = [json.loads(line) for line in open(out / "completions.jsonl")]
    assert len(completions) == 2 * 16 and {"prompt", "completion", "reward", "advantage"} <= set(completions[0])
    report = set(os.listdir(out / "report"))
    assert {"overview.png", "engine_gap.png", "summary.md", "completions.html"} <= report
    summary = open(out / "report" / "summary.md").read()
    assert "- 2 logged steps, step 1 to 2 of 2: finished" in summary
    # evaluated once: its value written out, no eval.png of one dot per panel (issue 57)
    assert "eval.png" not in report and "- `eval/reward/mean`: " in summary
    assert f"{rows[1]['eval/reward/mean']:.4g}, logged once (step 2)" in summary
    from transformers import AutoModelForCausalLM
    assert (out / "final_hf" / "model.safetensors.index.json").is_file()   # --max_shard_size
    model = AutoModelForCausalLM.from_pretrained(out / "final_hf")
    assert model(torch.tensor([[1, 2, 3]])).logits.shape[-1] == model.config.vocab_size


def test_resume_continues_bit_identically(base, tmp_path):
    straight, save = tmp_path / "straight", tmp_path / "ckpt"
    rlhf_together([[*base, "--train_iters", 4, "--output_dir", straight],
                   [*base, "--train_iters", 4, "--output_dir", tmp_path / "first", "--save", save,
                    "--save_interval", 2, "--exit_interval", 2]])
    assert open(save / "latest_checkpointed_iteration.txt").read() == "2"
    summary = open(tmp_path / "first" / "report" / "summary.md").read()  # written at the save
    assert "- 2 logged steps, step 1 to 2 of 4: stopped or still running" in summary
    assert {"model", "optimizer", "rng", "hf", "trainer_state.json", "swift_megatron.json"} <= \
        set(os.listdir(save / "iter_0000002"))
    assert os.path.isfile(save / "checkpoint-2" / "model.safetensors")  # --save_safetensors
    # without --save the output directory holds the checkpoints; final_hf links the last one
    assert os.path.samefile(straight / "checkpoint-4" / "model.safetensors",
                            straight / "final_hf" / "model.safetensors")
    resuming, late = rlhf_together([[*base, "--train_iters", 4, "--output_dir", tmp_path / "resumed",
                                     "--load", save],
                                    [*base, "--train_iters", 1, "--output_dir", tmp_path / "late",
                                     "--load", save]], check=False)
    assert resuming.returncode == 0, resuming.stdout[-3000:] + resuming.stderr[-5000:]
    assert late.returncode == 2 and "is at step 2, beyond this run's 1 optimizer steps" in \
        late.stderr and "Traceback" not in late.stderr
    expected, resumed = logged(straight)[2:], logged(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for mine, ref in zip(resumed, expected):
        for key in ("loss/policy", "grad_norm", "reward/mean", "kl", "lr"):
            assert mine[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), key


def test_moe_resume_continues_bit_identically(base, tiny_model_dir, tmp_path):
    """Grouped experts (the default): their optimizer state saves and resumes; a resume with
    the experts in the other form is refused before anything loads."""
    moe = [*base[2:], "--model", tiny_model_dir("qwen3_moe")]
    straight, save = tmp_path / "straight", tmp_path / "ckpt"
    rlhf_together([[*moe, "--train_iters", 3, "--output_dir", straight],
                   [*moe, "--train_iters", 3, "--output_dir", tmp_path / "first", "--save", save,
                    "--save_interval", 2, "--exit_interval", 2, "--save_safetensors", "false"]])
    meta = json.load(open(save / "iter_0000002" / "swift_megatron.json"))
    assert meta["saved_with"]["grouped_experts"] is True
    resuming, other_form = rlhf_together(
        [[*moe, "--train_iters", 3, "--output_dir", tmp_path / "resumed", "--load", save],
         [*moe, "--train_iters", 3, "--output_dir", tmp_path / "other", "--load", save,
          "--moe_grouped_gemm", "false"]], check=False)
    assert resuming.returncode == 0, resuming.stdout[-3000:] + resuming.stderr[-5000:]
    assert other_form.returncode == 2 and "--moe_grouped_gemm true (this run: false)" in \
        other_form.stderr
    (expected,), (resumed,) = logged(straight)[2:], logged(tmp_path / "resumed")
    assert resumed["step"] == 3
    for key in ("loss/policy", "grad_norm", "reward/mean", "kl", "lr"):
        assert resumed[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key


def test_dynamic_sampling_and_overlong_filter(base, tmp_path):
    """Both filters run end to end (their logic is unit-tested in test_grpo_filtering.py and
    test_grpo_batch.py): completions of at most 4 tokens are mostly truncated, zero-std groups
    are resampled once and what remains is counted."""
    out = tmp_path / "run"
    rlhf(*base, "--train_iters", 1, "--output_dir", out, "--max_completion_length", 4,
         "--dynamic_sample", "true", "--max_resample_times", 1, "--overlong_filter", "true")
    row = logged(out)[0]
    assert row["rollout/truncated_fraction"] > 0.5
    assert row["rollout/unresolved_zero_std_groups"] >= 0


def test_non_finite_updates_are_skipped_then_stop(base, tmp_path):
    """--lr 1e30: the first update makes the weights huge, the next steps (on the same rollout:
    3 steps per generation) have NaN gradients and are skipped; the second skip in a row stops
    the run (exit 2, no traceback) before any save (saves come at rollout-batch ends; weights are
    checked before every save: tests/unit/test_guard.py)."""
    out = tmp_path / "run"
    proc = rlhf(*base, "--train_iters", 3, "--steps_per_generation", 3, "--output_dir", out,
                "--lr", "1e30", "--max_skipped_steps", 2, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "step 3: the gradient norm was nan for 2 optimizer steps in a row " \
           "(--max_skipped_steps 2)" in proc.stderr
    assert "step 2: gradient norm nan: update skipped (1 in a row" in proc.stderr + proc.stdout
    assert not any(name.startswith(("iter_", "checkpoint-", "final")) for name in os.listdir(out))


def test_weight_sync_check_fails_loudly(base, tmp_path):
    """An impossible tolerance: the very first sync's check stops the run with the numbers."""
    proc = rlhf(*base, "--train_iters", 1, "--output_dir", tmp_path, "--check_weight_sync", "true",
                "--check_weight_sync_atol", "1e-30", check=False)
    assert proc.returncode != 0
    assert "weight sync check failed at step 0" in proc.stderr


def test_numerics_gate_stops_before_the_first_update(base, tmp_path):
    """An impossible tolerance: the first step's engine vs trainer gap stops the run before
    its update, exit 1 without a traceback, naming the family and the gap; nothing saved."""
    proc = rlhf(*base, "--train_iters", 1, "--output_dir", tmp_path,
                "--numerics_check_atol", "1e-30", check=False)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "numerics check (before the first optimizer step)" in proc.stderr
    assert "(qwen3, dense model), past --numerics_check_atol 1e-30" in proc.stderr
    assert not any(name.startswith(("iter_", "checkpoint-", "final")) for name in os.listdir(tmp_path))


@pytest.mark.parametrize("extra,message", [
    (["--reward_funcs", "acuracy"], "Did you mean 'accuracy'"),
    (["--dataset", "missing.jsonl"], "missing.jsonl"),
    (["--model", "/nonexistent/model"], "/nonexistent/model"),
    # issue 57: blamed the reward function (values up to 1), not the weight
    (["--reward_weights", "1e308", "1"], "--reward_weights gives reward function 'digit_ratio' "
                                         "the weight 1e+308"),
])
def test_user_errors_exit_2(base, tmp_path, extra, message):
    proc = rlhf(*base, "--train_iters", 1, "--output_dir", tmp_path, *extra, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_reward_error_policy_skip_trains_on(base, tmp_path):
    """A reward function that raises on odd-length completions: by default the run stops
    (exit 2, naming it); with --reward_error_policy skip it trains on, those completions score
    missing, and reward/odd_fails/errors counts them."""
    plugin = tmp_path / "odd.py"
    plugin.write_text("def odd_fails(completions, **kwargs):\n"
                      "    if any(len(c) % 2 for c in completions):\n"
                      "        raise ValueError('odd length')\n"
                      "    return [1.0] * len(completions)\n")
    flags = [*base, "--train_iters", 1, "--external_plugins", PLUGIN, plugin,
             "--reward_funcs", "digit_ratio", "odd_fails"]
    stopped = rlhf(*flags, "--output_dir", tmp_path / "stopped", check=False)
    assert stopped.returncode == 2 and "reward function 'odd_fails' raised ValueError: odd " \
        "length" in stopped.stderr and "Traceback" not in stopped.stderr
    skipped = rlhf(*flags, "--output_dir", tmp_path / "skipped", "--reward_error_policy", "skip")
    assert "reward function 'odd_fails' raised on" in skipped.stdout + skipped.stderr
    [step] = logged(tmp_path / "skipped")
    assert 0 < step["reward/odd_fails/errors"] <= 16
    assert step["reward/odd_fails/mean"] == 1.0   # the completions it scored


def test_a_run_without_learning_signal_is_told(base, tmp_path):
    """issue 57: a constant reward gives every group equal rewards, every advantage 0: the run
    trained nothing and exited 0 without a word; now it warns, naming the constant function."""
    plugin = tmp_path / "flat.py"
    plugin.write_text("def flat(completions, **kwargs):\n    return [0.5] * len(completions)\n")
    proc = rlhf(*base, "--train_iters", 1, "--output_dir", tmp_path / "run", "--beta", 0,
                "--external_plugins", plugin, "--reward_funcs", "flat")
    assert "WARNING no learning signal in the last 1 rollout batch(es) (step 1): in every " \
           "group the 4 completions of a prompt got the same reward" in proc.stdout
    assert "(flat: the same value for every completion of the batch)" in proc.stdout
    assert logged(tmp_path / "run")[0]["grad_norm"] == 0.0


def test_kill_9_leaves_no_processes_behind(base, tmp_path):
    """A trainer killed with `kill -9` after its first checkpoint leaves no process behind
    (megatron's checkpoint writer would start a Manager and a resource tracker that survive
    it; ours hands its results over in-process and starts none)."""
    import time

    import psutil

    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1",
               MASTER_PORT=str(free_port()))
    save = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "swift_megatron.cli.main", "rlhf", *map(str, base),
                             "--train_iters", "50", "--output_dir", str(tmp_path / "run"),
                             "--save", str(save), "--save_interval", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 300
        while not (save / "latest_checkpointed_iteration.txt").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        helpers = [p.pid for p in children if "multiprocessing" in " ".join(_cmdline(p))]
        assert not helpers, "a multiprocessing helper (megatron's writer Manager?) was started"
    finally:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(children, timeout=15)
    left = [" ".join(p.cmdline())[:120] for p in alive]
    for survivor in alive:
        survivor.kill()
    assert not left, left


def _launch_two_workers(base, tmp_path, **popen):
    """`megatron rlhf` under NPROC_PER_NODE=2, once both workers run: (the command, every
    process below it)."""
    import time

    import psutil

    env = dict(os.environ, OMP_NUM_THREADS="1", SWIFT_MEGATRON_NO_BAR="1", NPROC_PER_NODE="2",
               MASTER_PORT=str(free_port()))
    proc = subprocess.Popen([sys.executable, "-m", "swift_megatron.cli.main", "rlhf",
                             *map(str, base), "--micro_batch_size", "2", "--train_iters", "50",
                             "--output_dir", str(tmp_path / "run")], env=env, cwd=REPO, **popen)
    deadline = time.monotonic() + 120
    while True:   # until both workers run (torchrun's children)
        children = psutil.Process(proc.pid).children(recursive=True)
        workers = [p for p in children if "swift_megatron.cli.main" in _cmdline(p)
                   and "swift_megatron.launch" not in _cmdline(p)]   # exec'd, not forking
        if len(workers) >= 2:
            return proc, children
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("no workers started")
        time.sleep(0.5)


def _survivors(children) -> list:
    import psutil

    _, alive = psutil.wait_procs(children, timeout=30)
    left = [f"{p.pid} {_status(p)} {' '.join(_cmdline(p))[:120]}" for p in alive]
    for survivor in alive:
        survivor.kill()
    return left


def test_kill_9_of_a_torchrun_launch_stops_its_workers(base, tmp_path):
    """With NPROC_PER_NODE the command relaunches itself under torchrun: killing the command
    (`kill -9`) stops torchrun and its training processes too, instead of leaving them
    training in the background."""
    proc, children = _launch_two_workers(base, tmp_path, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
    proc.kill()
    proc.wait()
    left = _survivors(children)
    assert not left, left


def test_ctrl_c_of_a_torchrun_launch_ends_it_cleanly(base, tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) stops torchrun and its workers, each
    worker says `interrupted`, and the command exits 130 without a traceback."""
    import signal
    import time

    proc, children = _launch_two_workers(base, tmp_path, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True,
                                         start_new_session=True)
    time.sleep(2)   # past the workers' interpreter start-up, into the command
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    left = _survivors(children)
    assert proc.returncode == 130 and not left, (left, out[-3000:])
    assert out.count("interrupted") == 2 and "Traceback" not in out, out[-3000:]


def _cmdline(process) -> list:
    import psutil

    try:
        return process.cmdline()
    except psutil.Error:   # exited meanwhile
        return []


def _status(process) -> str:
    import psutil

    try:
        return process.status()
    except psutil.Error:
        return "gone"
