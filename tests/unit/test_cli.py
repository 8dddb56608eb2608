"""The `megatron` command line: router, help, flag parsing, config files, errors, launching."""
import json
import os
import subprocess
import sys
import time

import pytest

from swift_megatron.arguments import commands
from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import command_groups, group_specs, parse_command
from swift_megatron.cli.main import run
from swift_megatron.errors import UserError
from swift_megatron.launch import planned_world_size, torchrun_argv
from tests.distributed.launch import free_port


def rlhf(*argv):
    return parse_command(RlhfArguments, ["--model", "org/m", "--dataset", "d", *argv], "megatron rlhf")


def cli(*argv, env=None, timeout=60):
    """Run the installed console script's entry point as a subprocess."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "swift_megatron.cli.main", *argv],
                          capture_output=True, text=True, env=full_env, timeout=timeout)


# ---- router and help ------------------------------------------------------------------------

def test_router_lists_commands(capsys):
    assert run(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("rlhf", "export", "rollout", "demo"):
        assert name in out


def test_rlhf_without_arguments_points_at_help_and_the_demo():
    with pytest.raises(UserError, match=r"megatron rlhf --help.*megatron demo"):
        run(["rlhf"])


def test_unknown_command_suggests():
    with pytest.raises(UserError, match="did you mean 'rlhf'"):
        run(["rlfh"])


@pytest.mark.parametrize("command", ["rlhf", "export", "rollout"])
def test_help_exits_zero(command):
    proc = cli(command, "--help")
    assert proc.returncode == 0
    assert "--model" in proc.stdout


def test_rlhf_help_lists_every_flag_with_type_and_default():
    out = cli("rlhf", "--help").stdout
    for _, group in command_groups(RlhfArguments):
        for spec in group_specs(group):
            assert f"--{spec.name}" in out, spec.name
    # every flag's help carries "[type: ...; default: ...]"
    assert out.count("[type:") == sum(len(group_specs(g)) for _, g in command_groups(RlhfArguments))
    assert "--tuner_type" in out  # the alias is shown too


HEAVY = ("torch", "megatron", "vllm", "transformers", "matplotlib")


@pytest.mark.parametrize("argv", [["rlhf", "--help"], ["export", "--help"], ["rollout", "--help"],
                                  ["plot", "--help"], ["demo", "--help"], ["--version"]])
def test_help_and_version_import_nothing_heavy(argv):
    """What keeps `--help` instant (issue 57: not a wall-clock limit, which failed on a loaded
    machine): the router and the flag parsing import none of torch, megatron, vLLM,
    transformers or matplotlib, checked in a fresh interpreter."""
    code = ("import sys, contextlib, io\n"
            "from swift_megatron.cli.main import run\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out:\n"
            "    try: code = run(sys.argv[1:])\n"
            "    except SystemExit as exc: code = exc.code\n"
            "assert code in (0, None) and out.getvalue(), (code, out.getvalue())\n"
            f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
            "assert not heavy, f'imported at parse time: {heavy}'\n")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_version(capsys):
    """issue 57: `megatron --version` was an unknown command."""
    from swift_megatron import __version__

    assert run(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"swift-megatron {__version__} (megatron-core ") and "torch " in out
    assert cli("-V").stdout.strip() == out


# ---- parsing -----------------------------------------------------------------------------------

def test_flat_flags_land_in_groups():
    args = rlhf("--micro_batch_size", "2", "--global_batch_size", "32", "--tensor_model_parallel_size",
                "2", "--num_generations", "4", "--beta", "0", "--reward_funcs", "accuracy", "format",
                "--reward_weights", "1", "0.5", "--loss_type", "dapo")
    assert args.batch.micro_batch_size == 2 and args.batch.global_batch_size == 32
    assert args.parallel.tensor_model_parallel_size == 2
    assert args.grpo.num_generations == 4 and args.grpo.beta == 0.0
    assert args.grpo.reward_funcs == ["accuracy", "format"]
    assert args.grpo.reward_weights == [1.0, 0.5]
    assert args.grpo.loss_type == "dapo"
    assert args.grpo.epsilon_high == args.grpo.epsilon  # defaulted from epsilon


@pytest.mark.parametrize("argv,value", [([], False), (["--sequence_parallel"], True),
                                        (["--sequence_parallel", "true"], True),
                                        (["--sequence_parallel", "false"], False)])
def test_bool_flags(argv, value):
    args = rlhf("--tensor_model_parallel_size", "2", *argv)
    assert args.parallel.sequence_parallel is value


def test_tuner_type_alias_and_lr_default():
    assert rlhf("--tuner_type", "full").training.train_type == "full"
    assert rlhf().training.lr == 1e-5


@pytest.mark.parametrize("argv", [
    ["--rlhf_type", "dpo", "--model", "m", "--rpo_alpha", "1"],   # dpo's own flag: not reported
    ["--rlhf_type=kto", "--desirable_weight", "1.0"],
    ["CONFIG", "--lr", "1e-6"]])
def test_other_rlhf_types_are_refused_first(argv, tmp_path):
    """ms-swift's other algorithms (issue 40): one clear error, before any flag complaint,
    whether the type comes on the command line or from a config file."""
    config = tmp_path / "gkd.yaml"
    config.write_text("rlhf_type: gkd\nmodel: m\nteacher_model: t\n")
    argv = [str(config) if a == "CONFIG" else a for a in argv]
    with pytest.raises(UserError, match=r"^--rlhf_type (dpo|kto|gkd): only grpo is supported .*"
                                        r"migrating-from-ms-swift.md#not-supported"):
        run(["rlhf", *argv])


def test_unknown_flag_suggests_closest():
    with pytest.raises(UserError, match="did you mean --micro_batch_size"):
        rlhf("--micro_batch_sise", "2")


def test_bad_value_names_flag():
    with pytest.raises(UserError, match="--micro_batch_size: invalid value 'two'"):
        rlhf("--micro_batch_size", "two")
    with pytest.raises(UserError, match="--loss_type: invalid choice 'ppo'"):
        rlhf("--loss_type", "ppo")


def test_interleaved_pipeline_of_one_chunk_is_none():
    args = rlhf("--virtual_pipeline_model_parallel_size", "1")
    assert args.parallel.virtual_pipeline_model_parallel_size is None


def test_columns_json():
    assert rlhf("--columns", '{"question": "query"}').data.columns == {"question": "query"}


@pytest.mark.parametrize("argv,match", [
    (["--virtual_pipeline_model_parallel_size", "2"], "needs --pipeline_model_parallel_size > 1"),
    (["--virtual_pipeline_model_parallel_size", "2", "--pipeline_model_parallel_size", "2",
      "--train_type", "lora"], "--train_type lora with --virtual_pipeline"),
    (["--virtual_pipeline_model_parallel_size", "2", "--pipeline_model_parallel_size", "2",
      "--max_tokens_per_micro_batch", "512"], "use --micro_batch_size"),
])
def test_interleaved_pipeline_rules(argv, match):
    with pytest.raises(UserError, match=match):
        rlhf(*argv)


@pytest.mark.parametrize("argv,match", [
    (["--num_generations", "1"], "num_generations must be >= 2"),
    (["--reward_funcs", "accuracy", "--reward_weights", "1", "2"], "2 values"),
    (["--delta", "1.1"], "--delta must exceed"),
    (["--temperature", "0"], "--temperature must be > 0"),
])
def test_group_validation(argv, match):
    with pytest.raises(UserError, match=match):
        rlhf(*argv)


def test_the_dry_run_requires_what_a_run_requires():
    """issue 40: a dry run that passes means the run starts; it passed without --model."""
    for missing, argv in (("--model", ["--dataset", "d"]), ("--dataset", ["--model", "m"])):
        with pytest.raises(UserError, match=f"^{missing} is required"):
            parse_command(RlhfArguments, [*argv, "--dry_run", "true"], "megatron rlhf")


def test_model_and_dataset_required():
    with pytest.raises(UserError, match="--model is required"):
        parse_command(RlhfArguments, ["--dataset", "d"], "megatron rlhf")


# ---- config files -------------------------------------------------------------------------------

def test_config_file_and_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: m\ndataset: [a.jsonl, b.jsonl]\nmicro_batch_size: 2\n"
                    "global_batch_size: 32\nreward_funcs: accuracy\nsequence_parallel: false\n")
    args = parse_command(RlhfArguments, ["--config", str(path), "--micro_batch_size", "4"], "x")
    assert args.batch.micro_batch_size == 4          # the flag wins
    assert args.batch.global_batch_size == 32        # from the file
    assert args.data.dataset == ["a.jsonl", "b.jsonl"]
    assert args.grpo.reward_funcs == ["accuracy"]    # a scalar becomes a one-item list


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("micro_batch_sise: 2\n")
    with pytest.raises(UserError, match="1 unknown key:\n  --micro_batch_sise: did you mean "
                                        "--micro_batch_size"):
        parse_command(RlhfArguments, ["--config", str(bad)], "x")
    with pytest.raises(UserError, match="file not found"):
        parse_command(RlhfArguments, ["--config", str(tmp_path / "nope.yaml")], "x")


# ---- dry run and exit codes --------------------------------------------------------------------

HUB = ["--model", "Qwen/Qwen3-8B", "--dataset", "AI-MO/NuminaMath-TIR"]   # never downloaded


def test_dry_run_prints_plan_for_launch_world():
    proc = cli("rlhf", "--dry_run", "true", *HUB, "--reward_funcs", "accuracy",
               "--micro_batch_size", "4",
               "--global_batch_size", "128",
               "--num_generations", "8", "--steps_per_generation", "4", env={"NPROC_PER_NODE": "8"})
    assert proc.returncode == 0, proc.stderr
    assert "dp_size" in proc.stdout and " 512 " in proc.stdout


def test_invalid_batch_exits_2_without_traceback():
    proc = cli("rlhf", "--dry_run", "true", *HUB, "--micro_batch_size", "1",
               "--global_batch_size", "12", "--num_generations", "4", env={"NPROC_PER_NODE": "8"})
    assert proc.returncode == 2
    assert "global_batch_size=12" in proc.stderr and "Traceback" not in proc.stderr


def test_dry_run_checks_the_model(tmp_path):
    config = dict(model_type="qwen3_moe", num_experts=6, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=4, moe_intermediate_size=32,
                  vocab_size=64, hidden_size=32, intermediate_size=64, num_experts_per_tok=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    base = ["rlhf", "--dry_run", "true", "--model", str(tmp_path), "--dataset", HUB[-1],
            "--global_batch_size", "32", "--reward_funcs", "accuracy", "--check_model", "false"]
    bad = cli(*base, "--expert_model_parallel_size", "4", env={"NPROC_PER_NODE": "4"})
    assert bad.returncode == 2 and "num_experts=6" in bad.stderr
    bad_tp = cli(*base, "--tensor_model_parallel_size", "4", env={"NPROC_PER_NODE": "4"})
    assert bad_tp.returncode == 2 and "num_key_value_heads=2" in bad_tp.stderr
    ok = cli(*base, "--expert_model_parallel_size", "2", env={"NPROC_PER_NODE": "4"})
    assert ok.returncode == 0, ok.stderr
    no_sp = cli(*base, "--tensor_model_parallel_size", "2", env={"NPROC_PER_NODE": "4"})
    assert no_sp.returncode == 2 and "--sequence_parallel true" in no_sp.stderr


def test_dry_run_checks_multi_turn_names():
    base = ["rlhf", "--dry_run", "true", *HUB, "--micro_batch_size", "4", "--global_batch_size",
            "32", "--multi_turn_scheduler", "gym_scheduler", "--max_turns", "5"]
    ok = cli(*base, "--gym_env", "grid_world")
    assert ok.returncode == 0, ok.stderr
    assert "checked rewards: gym_reward" in ok.stdout
    assert "checked multi-turn scheduler: gym_scheduler, gym env grid_world" in ok.stdout
    typo = cli(*base, "--gym_env", "grid_wrld")
    assert typo.returncode == 2 and "--gym_env: unknown gym env 'grid_wrld'. Did you mean " \
        "'grid_world'?" in typo.stderr and "Traceback" not in typo.stderr
    no_reward = cli(*base[:-4], "--multi_turn_scheduler", "calculator")
    assert no_reward.returncode == 2 and "--use_gym_env true" in no_reward.stderr


# ---- launching ---------------------------------------------------------------------------------

def test_torchrun_argv():
    env = {"NPROC_PER_NODE": "4", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29555"}
    cmd = torchrun_argv("rlhf", ["--model", "m"], env)
    assert cmd[1:3] == ["-m", "swift_megatron.launch"]   # torchrun, ending as one process
    assert cmd[3:8] == ["--nproc_per_node=4", "--nnodes=2", "--node_rank=1",
                        "--master_addr=10.0.0.1", "--master_port=29555"]
    assert cmd[8:] == ["-m", "swift_megatron.cli.main", "rlhf", "--model", "m"]
    assert planned_world_size(env) == 8


def test_no_relaunch_without_nproc_or_inside_launcher():
    assert torchrun_argv("rlhf", [], {}) is None
    assert torchrun_argv("rlhf", [], {"NPROC_PER_NODE": "2", "LOCAL_RANK": "0",
                                      "WORLD_SIZE": "2"}) is None
    assert planned_world_size({"LOCAL_RANK": "0", "WORLD_SIZE": "6"}) == 6


WORKER = ("import sys, time; from swift_megatron.launch import stop_with_launcher; "
          "stop_with_launcher(); print('up', flush=True); time.sleep(60)")


@pytest.mark.parametrize("codes,code", [([2], 2), ([2, 2], 2), ([2, -15], 2), ([143, 2], 2),
                                        ([2, 1], 1), ([-15, 3], 3), ([-9], 137), ([143], 143),
                                        ([], 1)])
def test_launcher_exit_code(codes, code):
    from swift_megatron.launch import launcher_exit_code

    assert launcher_exit_code(codes) == code


@pytest.mark.parametrize("worker_exit,code", [(2, 2), (3, 3)])
def test_a_failed_launch_ends_as_one_process_would(tmp_path, worker_exit, code):
    """Rank 0 fails while rank 1 trains on (torchrun then stops it): a user error (exit 2, its
    `error:` line printed) ends the launch with 2 and no torchrun traceback or failure table;
    another failure names each failed rank."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['RANK'] != '0':\n    time.sleep(60)\n"
                      f"print('error: bad input', file=sys.stderr)\nsys.exit({worker_exit})\n")
    done = subprocess.run([sys.executable, "-m", "swift_megatron.launch", "--nproc_per_node=2",
                           "--master_addr=127.0.0.1", f"--master_port={free_port()}",
                           str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, done.stderr[-2000:]
    assert done.stderr.count("error: bad input") == 1
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    named = [line for line in done.stderr.splitlines() if line.startswith("error: rank ")]
    assert len(named) == (0 if code == 2 else 2)


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    return int(done.stdout)


@pytest.mark.parametrize("run_id,stops", [("rid", True), (None, False)])
def test_a_torchrun_worker_of_a_dead_launcher_stops(run_id, stops):
    """A worker started after its launching command died (the launcher killed while torchrun
    was starting its workers) stops at once, by SIGTERM; outside torchrun nothing happens."""
    env = dict(os.environ, SWIFT_MEGATRON_LAUNCHER_PID=str(_dead_pid()))
    env.pop("TORCHELASTIC_RUN_ID", None)
    if run_id:
        env["TORCHELASTIC_RUN_ID"] = run_id
    proc = subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        code = proc.wait(timeout=20) if stops else None
        up = proc.stdout.readline() if not stops else ""
    finally:
        proc.kill()
        proc.wait()
    assert code == (-15 if stops else None) and up == ("" if stops else "up\n")


def test_a_torchrun_worker_stops_when_its_parent_is_killed():
    """torchrun killed with -9 cannot stop its workers: each gets SIGTERM from Linux instead."""
    parent = ("import os, subprocess, sys, time; "
              f"w = subprocess.Popen([sys.executable, '-c', {WORKER!r}], "
              "env=dict(os.environ, TORCHELASTIC_RUN_ID='rid')); "
              "print(w.pid, flush=True); time.sleep(60)")
    env = {k: v for k, v in os.environ.items() if k != "SWIFT_MEGATRON_LAUNCHER_PID"}
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True,
                            env=env)
    lines = sorted(proc.stdout.readline().strip() for _ in range(2))   # either order
    assert lines[1] == "up"   # the worker set its death signal
    worker = int(lines[0])
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while _running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _running(worker)
    if alive:
        os.kill(worker, 9)
    assert not alive


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("env,match", [({"NPROC_PER_NODE": "x"}, "must be an integer"),
                                       ({"NPROC_PER_NODE": "2", "NNODES": "2", "NODE_RANK": "2"},
                                        "NODE_RANK=2 must be smaller")])
def test_bad_launch_variables(env, match):
    with pytest.raises(UserError, match=match):
        torchrun_argv("rlhf", [], env)


def test_batch_inputs_reads_every_flag():
    args = rlhf("--tensor_model_parallel_size", "2", "--generation_batch_size", "64",
                "--vllm_tensor_parallel_size", "2")
    inputs = commands.batch_inputs(args, world_size=8, num_experts=None, colocate_vllm=True)
    assert (inputs.world_size, inputs.tensor_model_parallel_size, inputs.generation_batch_size,
            inputs.vllm_tensor_parallel_size, inputs.colocate_vllm) == (8, 2, 64, 2, True)


def test_sleep_level_2_is_kept_on_cuda():
    """ms-swift's scripts use --sleep_level 2 everywhere; it runs as given (the trainer's flow
    keeps vLLM 0.26's greedy output identical through a level-2 sleep and a full weight update
    on an H200: tests/gpu/test_vllm_gpu.py, docs/gpu.md)."""
    from swift_megatron.arguments.parser import notices
    from swift_megatron.preflight import preflight_rlhf

    args = rlhf("--use_vllm", "true", "--sleep_level", "2", "--global_batch_size", "8")
    preflight_rlhf(args, world_size=1)
    assert args.rollout.sleep_level == 2
    assert not any("--sleep_level" in line for line in notices(args))


def test_expert_tensor_parallel_follows_tp_without_expert_parallelism():
    """megatron-core reduces expert gradients over expert-parallel groups only when EP > 1: with
    EP 1, experts replicated over TP ranks would drift apart, so ETP follows TP (measured: the
    packed-vs-padded test's expert gradients differed per TP rank with ETP 1)."""
    assert rlhf("--tensor_model_parallel_size", "2").parallel.expert_tensor_parallel_size == 2
    args = rlhf("--tensor_model_parallel_size", "2", "--expert_model_parallel_size", "2")
    assert args.parallel.expert_tensor_parallel_size == 1


def test_exit_without_teardown_stops_idle_thread_pools():
    """A finished run exits with its code although an idle thread-pool worker (non-daemon) is
    alive, as the one torch._dynamo's import starts in torch 2.13: a plain join of every
    non-daemon thread waited on it forever (a CPU e2e run hung at exit). Joins real threads
    first: a worker still writing finishes its file."""
    script = (
        "import threading, time\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from swift_megatron.cli.main import exit_without_teardown\n"
        "pool = ThreadPoolExecutor(2)\n"
        "pool.submit(lambda: None).result()\n"
        "def late():\n"
        "    time.sleep(0.5)\n"
        "    open(r'%s', 'w').write('done')\n"
        "threading.Thread(target=late).start()\n"
        "exit_without_teardown(3)\n")
    marker = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"exit_marker_{os.getpid()}")
    try:
        result = subprocess.run([sys.executable, "-c", script % marker], timeout=60,
                                capture_output=True, text=True)
        assert result.returncode == 3, result.stderr
        assert open(marker).read() == "done"
    finally:
        if os.path.exists(marker):
            os.remove(marker)


def test_a_missing_sink_package_stops_the_preflight(monkeypatch):
    """--report_to swanlab without swanlab installed: an error before anything loads (it came
    after the model and the rollout servers' connection)."""
    from swift_megatron.preflight import preflight_rlhf

    monkeypatch.setitem(sys.modules, "swanlab", None)   # `import swanlab` raises ImportError
    with pytest.raises(UserError, match=r"^--report_to swanlab: swanlab is not installed"):
        preflight_rlhf(rlhf("--report_to", "tensorboard", "swanlab"), world_size=1)


def test_a_sigterm_swallowed_in_a_gc_callback_still_stops_the_trainer():
    """Python drops an exception raised inside a garbage-collector callback (and a __del__ or
    a weakref callback): a SIGTERM handled there went on training (seen in the full suite:
    training/gc_pauses.py's callback). The trainer's check between rollout batches
    (launch.raise_if_stopping) then stops it with exit 143."""
    code = ("import gc, os, signal, sys, time\n"
            "from swift_megatron import launch\n"
            "signal.signal(signal.SIGTERM, launch.exit_on_sigterm)\n"
            "def callback(phase, info):\n"
            "    if phase == 'start':\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        for _ in range(1000): pass   # the handler runs here, inside the callback\n"
            "gc.callbacks.append(callback)\n"
            "gc.collect()\n"
            "gc.callbacks.remove(callback)\n"
            "print('went on', flush=True)\n"
            "launch.raise_if_stopping()\n"
            "print('not stopped', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Exception ignored" in proc.stderr and "SystemExit: 143" in proc.stderr
    assert proc.stdout == "went on\n" and proc.returncode == 143
