"""tests/gpu/device_run.sh's phases build the command lines they mean: run on the CPU with
stand-ins for python3, curl and nvidia-smi that record their arguments, so a quoting mistake
(a JSON object of TRL's settings split into words, an environment knob dropped) shows here and
not after a GPU lease's install. The harness explains itself: each phase is one line of its case
table and docs/gpu.md names it; each benchmark's docstring names the docs section it feeds and
benchmarks/README.md lists it."""
import ast
import glob
import json
import os
import re
import shutil
import subprocess

import pytest

pytestmark = pytest.mark.quick
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tests", "gpu", "device_run.sh")
PHASE = re.compile(r"^ {8}([a-z0-9_|]+)\) +(.*)$")   # a phase's line of the case table
# python3's stand-in: a call's arguments on one line after CALL, each after a unit separator
# (grpo_server takes one call's output as its model path: any word serves), then FAKE_LINE if
# set (what the real call would print). A shell script: a phase's calls cost no interpreter.
# It ignores SIGTERM: the script kills the rollout server's stand-in once the trainers are done,
# which under load came before the stand-in had written its line (a CI failure)
RECORDER = """#!/bin/sh
trap '' TERM
printf 'CALL'; printf '\\037%s' "$@"; printf '\\n'
[ -z "$FAKE_LINE" ] || echo "$FAKE_LINE"
"""


@pytest.fixture
def device_run(tmp_path):
    """Run phases of a copy of device_run.sh; returns {phase: [argv of each python3 call]}."""
    tree, bin_dir, out = tmp_path / "tree", tmp_path / "bin", tmp_path / "out"
    (tree / "tests" / "gpu").mkdir(parents=True)
    (tree / "swift_megatron").mkdir()
    shutil.copy(SCRIPT, tree / "tests" / "gpu" / "device_run.sh")
    bin_dir.mkdir()
    for name, body in (("python3", RECORDER), ("curl", "#!/bin/sh\nexit 0\n"),
                       ("nvidia-smi", "#!/bin/sh\necho 'NVIDIA H200, 143771 MiB'\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)

    def run(*phases, **knobs):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # as on a bare GPU
        env.update(knobs, PATH=f"{bin_dir}:{os.environ['PATH']}", OUT=str(out))
        proc = subprocess.run(["bash", "tests/gpu/device_run.sh", *phases], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        run.stdout = proc.stdout
        calls = {}
        for log in [*phases, "grpo_server.server"]:   # the rollout server logs apart
            path = out / f"{log}.log"
            lines = path.read_text().splitlines() if path.exists() else []
            calls[log] = [line.split("\x1f")[1:] for line in lines if line.startswith("CALL")]
        return calls

    return run


def flag(argv, name):
    """The words after `name` up to the next option."""
    i = argv.index(name) + 1
    end = next((j for j in range(i, len(argv)) if argv[j].startswith("--")), len(argv))
    return argv[i:end]


def test_trl_settings_and_the_sweeps_choice_reach_each_workload(device_run):
    fastest = '{"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4}'
    phases = ["trl_both", "trl_reasoning", "trl_lora8b", "trl_vl", "trl_qwen3_5",
              "trl_qwen3_5_lora"]
    calls = device_run(*phases, TRL_SETTINGS="fastest", TRL_FASTEST=fastest)
    for phase in phases:
        [argv] = calls[phase]
        assert flag(argv, "--trl_settings") == ["fastest"], phase
        assert flag(argv, "--trl_fastest") == [fastest], phase   # one word, unsplit
    defaults = device_run("trl_vl")["trl_vl"][0]
    assert flag(defaults, "--trl_settings") == ["defaults", "fastest"]
    assert flag(defaults, "--trl_fastest") == ["{}"]


def test_trls_fastest_setting_runs_again_without_the_sweeps_fields_where_they_failed(device_run):
    failed = json.dumps({"name": "failed", "tool": "trl_fastest", "returncode": 1})
    fastest = '{"per_device_train_batch_size": 32, "gradient_accumulation_steps": 2}'
    first, again = device_run("trl_reasoning", TRL_FASTEST=fastest,
                              FAKE_LINE=failed)["trl_reasoning"]
    assert flag(first, "--trl_fastest") == [fastest]
    assert flag(again, "--tool") == ["trl"] and flag(again, "--trl_settings") == ["fastest"]
    assert flag(again, "--trl_fastest") == ["{}"]
    assert flag(again, "--completion_length") == ["4096"]   # the same workload
    # no second run where nothing failed, or where the failed setting was {} already
    assert len(device_run("trl_reasoning", TRL_FASTEST=fastest)["trl_reasoning"]) == 1
    assert len(device_run("trl_reasoning", FAKE_LINE=failed)["trl_reasoning"]) == 1


def test_the_sweep_runs_trl_alone_once_per_setting_and_later_phases_take_its_pick(device_run,
                                                                                 tmp_path):
    calls = device_run("trl_fastest_sweep", "trl_both")
    runs = calls["trl_fastest_sweep"]
    assert [flag(argv, "--tool") for argv in runs] == [["trl"]] * 5
    assert [json.loads(flag(argv, "--trl_fastest")[0]) for argv in runs] == [
        {}, {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 4},
        {"per_device_train_batch_size": 32, "gradient_accumulation_steps": 2},
        {"vllm_enable_sleep_mode": False}, {"torch_compile": True}]
    # the pick's output (here the stand-in's record of the pick's own command) is what the
    # next phase passes as --trl_fastest
    picked = (tmp_path / "out" / "trl_fastest.json").read_text().strip()
    assert picked.split("\x1f")[1:] == ["benchmarks/trl_sweep_pick.py",
                                        str(tmp_path / "out" / "trl_fastest_sweep.log")]
    [both] = calls["trl_both"]
    assert "\x1f".join(flag(both, "--trl_fastest")) == picked   # (the record has separators)


def test_profile_workload_takes_its_workload_from_the_environment(device_run):
    [argv] = device_run("profile_workload", PROFILE_PRESET="qwen3-8b", PROFILE_ARGS="--lora 16",
                        PROFILE_FLAGS="--lora_dropout 0")["profile_workload"]
    assert flag(argv, "--preset") == ["qwen3-8b"] and flag(argv, "--lora") == ["16"]
    ours = argv[argv.index("--") + 1:]
    assert ours == ["--max_tokens_per_micro_batch", "8192", "--lora_dropout", "0"]


def test_async_reasoning_runs_the_trainer_twice_against_one_server(device_run):
    calls = device_run("async_reasoning")
    trainers = calls["async_reasoning"]
    assert [flag(argv, "--async_generate") for argv in trainers] == [["false"], ["true"]]
    for argv in trainers:
        assert flag(argv, "--completion_length") == ["4096"]
        assert flag(argv, "--vllm_mode") == ["server"]
    [server] = calls["grpo_server.server"]
    assert server[:3] == ["-m", "swift_megatron.cli.main", "rollout"]
    assert flag(server, "--vllm_max_model_len") == ["4608"]


def test_scale_8b_runs_three_layouts_in_one_command(device_run):
    [argv] = device_run("scale_8b")["scale_8b"]
    assert flag(argv, "--nproc") == ["2"]
    variants = dict(v.split("=", 1) for v in (argv[i + 1] for i, word in enumerate(argv)
                                              if word == "--variant"))
    assert variants["pp2"].split() == ["--tensor_model_parallel_size", "1", "--sequence_parallel",
                                       "false", "--pipeline_model_parallel_size", "2",
                                       "--max_tokens_per_micro_batch", "3072"]
    assert "--offload_optimizer true" in variants["dp2"]
    ours = argv[argv.index("--") + 1:]
    assert ours[:2] == ["--tensor_model_parallel_size", "2"]


def test_the_matrix_takes_its_cases_and_options_from_the_environment(device_run):
    [argv] = device_run("matrix", MATRIX_CASES="qwen2_lora llama3",
                        MATRIX_ARGS="--resume --start_within 900")["matrix"]
    assert argv[0] == "tests/gpu/matrix.py" and flag(argv, "--part") == ["matrix"]
    assert flag(argv, "--cases") == ["qwen2_lora", "llama3"]
    assert "--resume" in argv and flag(argv, "--start_within") == ["900"]


def test_trl_fast_runs_ours_at_both_budgets_against_trls_fastest_alone(device_run):
    fastest = '{"per_device_train_batch_size": 32, "gradient_accumulation_steps": 2}'
    [argv] = device_run("trl_fast", TRL_FASTEST=fastest)["trl_fast"]
    assert flag(argv, "--trl_settings") == ["fastest"] and flag(argv, "--trl_fastest") == [fastest]
    assert flag(argv, "--variant") == ["16k=--max_tokens_per_micro_batch 16384"]
    extra = argv[argv.index("--") + 1:]
    assert extra == ["--max_tokens_per_micro_batch", "8192"]   # no $BOTH memory flags


def test_gpu_tests_run_pytest_on_tests_gpu_or_the_chosen_files(device_run):
    assert device_run("gpu_tests")["gpu_tests"] == [["-m", "pytest", "tests/gpu", "-q", "-s"]]
    [argv] = device_run("gpu_tests", GPU_TESTS="tests/gpu/test_bridge_gpu.py -k qwen3_5")["gpu_tests"]
    assert argv[2:5] == ["tests/gpu/test_bridge_gpu.py", "-k", "qwen3_5"]


def test_every_phase_runs_its_commands(device_run):
    """Every phase of the case table, with the stand-ins: exit 0 and at least one python3 call
    (an unknown or mistyped phase exits 2)."""
    table = _read("tests", "gpu", "device_run.sh").split("\nphase() {\n", 1)[1]
    names = [name for line in table.split("\n}\n")[0].splitlines() if PHASE.match(line)
             for name in PHASE.match(line).group(1).split("|")]
    calls = device_run(*names)
    for name in names:
        assert f"== {name}: exit 0 " in device_run.stdout, name
        assert calls[name], name


def _read(*path) -> str:
    with open(os.path.join(REPO, *path)) as f:
        return f.read()


def test_each_phase_is_one_line_that_docs_gpu_names():
    table = _read("tests", "gpu", "device_run.sh").split("\nphase() {\n", 1)[1].split("\n}\n")[0]
    phases = [PHASE.match(line) for line in table.splitlines() if PHASE.match(line)]
    assert len(phases) > 30
    doc = _read("docs", "gpu.md")
    for match in phases:
        assert match.group(2).endswith(";;"), match.group(0)   # the whole command on its line
        for name in match.group(1).split("|"):
            assert re.search(rf"\b{name}\b", doc), f"docs/gpu.md does not name the phase {name}"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py"))),
                         ids=os.path.basename)
def test_each_benchmark_names_the_docs_section_it_feeds(path):
    with open(path) as f:
        first = " ".join(ast.get_docstring(ast.parse(f.read())).split("\n\n")[0].split())
    feeds = re.search(r'Feeds (docs/[\w-]+\.md), "([^"]+)"', first)
    assert feeds, f"{path}: its docstring's first paragraph says `Feeds docs/X.md, \"section\"`"
    doc = _read(*feeds.group(1).split("/"))
    assert re.search(rf"^#+ {re.escape(feeds.group(2))}$", doc, re.M), feeds.group(0)
    name = os.path.basename(path)
    assert f"[{name}]({name})" in _read("benchmarks", "README.md")
