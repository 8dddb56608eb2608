"""tests/gpu/matrix.py, the GPU gate, where no GPU is needed: it covers every model family the
fixtures build (so a new family cannot skip the gate), its presets exist, its commands pass the
CLI's own up-front checks, and its verdict fails a case on each of the things it checks (exit
code, rollout batches logged, non-finite loss or grad norm, sync gap, memory estimate)."""
import json
import math
import os
import sys
import time

import pytest

from tests.gpu import matrix


def test_every_family_runs_full_and_lora():
    from grpo_step import PRESETS

    from swift_megatron.fixtures.models import FAMILIES, VISION_FAMILIES

    types = {PRESETS[f.preset]["model_type"] for f in matrix.FAMILIES.values()}
    assert types == set(FAMILIES + VISION_FAMILIES)
    images = {name for name, f in matrix.FAMILIES.items() if "image_size" in PRESETS[f.preset]}
    assert images == {"qwen2_5_vl", "qwen3_vl", "qwen3_5_vl"}   # Qwen3.5 with its tower too
    cases = matrix.all_cases()
    assert len(cases) == 2 * len(matrix.FAMILIES) and {c.gpus for c in cases} == {1}
    assert {(c.family, c.mode) for c in cases} == {(f, m) for f in matrix.FAMILIES
                                                  for m in ("full", "lora")}
    assert {c.gpus for c in matrix.all_cases("matrix_2gpu")} == {2}
    assert {c.gpus for c in matrix.all_cases("matrix_4gpu")} == {4}


def test_select_takes_cases_and_families():
    cases = matrix.all_cases()
    assert [c.name for c in matrix.select(cases, ["qwen3_5", "llama3_lora"])] == \
        ["qwen3_5_full", "qwen3_5_lora", "llama3_lora"]
    assert matrix.select(cases, []) == cases
    with pytest.raises(SystemExit, match="unknown matrix case"):
        matrix.select(cases, ["qwen4"])


def _parsed(case):
    from swift_megatron.arguments.batch_plan import make_batch_plan
    from swift_megatron.arguments.commands import RlhfArguments, batch_inputs
    from swift_megatron.arguments.parser import parse_command

    cmd = matrix.command(case, "/m", ["--dataset", "d.jsonl", "--reward_funcs", "accuracy"],
                         "/o", 8123)
    args = parse_command(RlhfArguments, cmd[cmd.index("rlhf") + 1:], "megatron rlhf")
    trainer_ranks = case.gpus - case.server
    return args, make_batch_plan(batch_inputs(args, world_size=trainer_ranks, num_experts=64,
                                              colocate_vllm=not case.server))


@pytest.mark.parametrize("part", ["matrix", "matrix_2gpu", "matrix_4gpu", "what_trains"])
def test_commands_pass_the_argument_checks(part):
    """Each case's flags parse and satisfy the batch rules on its GPUs (the CLI's parser, no
    model): 64 completions per rollout batch and data-parallel rank, the weight-sync check."""
    for case in matrix.all_cases(part):
        args, plan = _parsed(case)
        assert plan.dp_size == case.dp, case.name
        assert plan.generation_batch_size == 64 * case.dp and args.rollout.check_weight_sync
        assert args.training.train_type == case.mode
        assert args.rollout.vllm_mode == ("server" if case.server else "colocate")
        if case.server:
            assert args.rollout.vllm_server_port == [8123]
        assert args.grpo.reward_funcs == ["accuracy", "first_token_even"]   # a reward with signal
        assert args.grpo.external_plugins[0].endswith("demo/rewards.py")


def test_image_tasks_keep_their_reward():
    task = ["--dataset", "c.jsonl", "--external_plugins", "r.py", "--reward_funcs",
            "colour_parity"]
    assert matrix.with_signal(task) == task


def test_the_pool_hands_out_free_gpus():
    pool = matrix.GpuPool([80.0] * 4)
    one, two = matrix.all_cases()[0], matrix.all_cases("matrix_2gpu")[0]
    assert pool.take(two) == ((0, 1), 0) and pool.take(one) == ((2,), 1)
    assert pool.take(two) is None
    pool.give(0)
    assert pool.take(two) == ((0, 1), 0) and pool.take(one) == ((3,), 2)
    assert pool.take(one) is None
    with pytest.raises(SystemExit, match="need 4 GPUs; 2 visible"):
        matrix.GpuPool([80.0] * 2).check(matrix.all_cases("matrix_4gpu"))
    cpu = matrix.GpuPool([])   # the harness's smoke test: one-GPU cases, one at a time
    assert cpu.take(one) == ((), 0) and cpu.take(one) is None
    with pytest.raises(SystemExit, match="need 2 GPUs; 0 visible"):
        cpu.check([two])


def test_the_pool_packs_one_gpu_cases_by_memory():
    """A one-GPU case with a reservation goes where the most memory is unreserved, while it fits
    and the GPU runs fewer than per_gpu cases; a multi-GPU case waits for idle GPUs; each
    running case has a slot of its own, reused once given back."""
    pool = matrix.GpuPool([80.0, 80.0], per_gpu=3)
    one, two = matrix.all_cases()[0], matrix.all_cases("matrix_2gpu")[0]
    assert pool.take(one, 70.0) == ((0,), 0)                   # 10 GiB left on GPU 0
    assert pool.take(one, 20.0) == ((1,), 1) and pool.take(one, 20.0) == ((1,), 2)
    assert pool.take(one, 50.0) is None and pool.take(two) is None
    assert pool.take(one, 10.0) == ((1,), 3)                   # the most unreserved: GPU 1
    assert pool.take(one, 5.0) == ((0,), 4)                    # GPU 1 runs 3 cases
    assert pool.take(one, 6.0) is None                         # 5 GiB left on GPU 0
    assert pool.unreserved == [5.0, 30.0] and pool.cases == [2, 3]
    pool.give(1)
    assert pool.take(one, 200.0) is None                       # neither GPU is idle
    assert pool.take(one, 45.0) == ((1,), 1)
    for slot in (0, 1, 2, 3, 4):
        pool.give(slot)
    assert pool.unreserved == [80.0, 80.0]
    assert pool.take(one, 200.0) == ((0,), 0)   # larger than a GPU: it runs alone there
    assert pool.unreserved[0] == 0.0


ESTIMATE_PARTS = {"weights": 6.0, "train": 57.6, "logprobs": 40.0, "vllm": 42.0,
                  "generate": 42.0 + 30.0}   # generate: 30 GiB resident + the 0.3 share


def test_a_packed_case_gets_an_engine_of_its_size():
    """Weights + KV_CACHE_GIB + ENGINE_EXTRA_GIB, as a share of the GPU rounded up, and the KV
    cache in bytes; the reservation: the peak with that engine, with the margins."""
    engine = 6.0 + matrix.KV_CACHE_GIB + matrix.ENGINE_EXTRA_GIB
    assert matrix.engine_gib(ESTIMATE_PARTS) == engine == 11.0
    flags = matrix.engine_flags(ESTIMATE_PARTS, 140.0)
    assert flags[:2] == ["--vllm_gpu_memory_utilization", "0.08"]   # 11 / 140 = 0.0786
    assert json.loads(flags[3]) == {"kv_cache_memory_bytes": 2 * 2**30}
    assert matrix.reservation(ESTIMATE_PARTS, 140.0) == pytest.approx(57.6 * 1.15 + 2)
    lora = {"weights": 6.0, "train": 7.0, "logprobs": 6.5, "vllm": 42.0, "generate": 49.0}
    assert matrix.reservation(lora, 140.0) == pytest.approx((7.0 + 11.0) * 1.15 + 2)
    assert matrix.reservation(ESTIMATE_PARTS, 40.0) == 40.0


def test_packing_orders_full_before_lora_largest_first():
    cases = matrix.select(matrix.all_cases(), ["qwen2", "qwen3_5"])
    planned = {"qwen2_full": dict(ESTIMATE_PARTS, train=9.0), "qwen2_lora": ESTIMATE_PARTS,
               "qwen3_5_full": ESTIMATE_PARTS, "qwen3_5_lora": {}}   # a failed dry run
    pool = matrix.GpuPool([140.0], per_gpu=4)
    need, engine, order = matrix.packing(cases, planned, pool, engines_pack=True)
    assert [c.name for c in order] == ["qwen3_5_lora", "qwen3_5_full", "qwen2_full",
                                       "qwen2_lora"]
    assert need["qwen3_5_lora"] is None and engine["qwen3_5_lora"] == matrix.SHARE
    assert need["qwen2_full"] < need["qwen3_5_full"] and "--vllm_engine_kwargs" in \
        engine["qwen2_full"]
    need, engine, _ = matrix.packing(cases, planned, pool, engines_pack=False)
    assert set(need.values()) == {None} and engine["qwen2_full"] == matrix.SHARE


def test_all_puts_the_largest_cases_first():
    sizes = [c.gpus for c in matrix.all_cases("all")]
    assert sizes == sorted(sizes, reverse=True) and sizes.count(1) == 18


def test_run_all_packs_cases_and_runs_lora_after_full():
    """Every case runs once, concurrently on GPUs of its own; a family's LoRA case starts after
    its full case ended (the compile caches); a case whose harness raises fails alone; no
    case starts once the start budget is spent."""
    import threading

    cases = [*matrix.all_cases("matrix_2gpu")[:2],
             *matrix.select(matrix.all_cases(), ["qwen3_5", "qwen2", "llama3"])]
    starts, ends, held, lock = {}, {}, [], threading.Lock()

    def run(case, gpus, slot):
        with lock:
            starts[case.name] = time.monotonic()
            held.append(set(gpus))
            busy = [g for name, (s, e, gs) in spans.items() if e is None for g in gs]
            assert not set(gpus) & set(busy), "a GPU handed out twice"
            spans[case.name] = (starts[case.name], None, gpus)
        assert len(gpus) == case.gpus
        time.sleep(0.05)
        with lock:
            ends[case.name] = time.monotonic()
            spans[case.name] = (starts[case.name], ends[case.name], ())
        if case.name == "llama3_full":
            raise RuntimeError("boom")
        return dict(case=case.name, failed=[])

    spans = {}
    results = matrix.run_all(cases, matrix.GpuPool([80.0] * 3), run)
    assert set(results) == {c.name for c in cases}
    assert results["llama3_full"]["failed"] == ["harness: RuntimeError('boom')"]
    assert results["qwen2_full"]["failed"] == []
    assert any(len(h) == 1 for h in held) and max(len(h) for h in held) == 2
    for family in ("qwen3_5", "qwen2"):
        assert ends[f"{family}_full"] <= starts[f"{family}_lora"]
    assert "llama3_lora" in starts   # ran after its failed full case
    assert matrix.run_all(cases, matrix.GpuPool([80.0] * 3), run, may_start=lambda: False) == {}


def test_run_all_starts_lora_once_its_full_case_is_warm(monkeypatch):
    """Packed, a LoRA case starts beside its full case as soon as that one is warm (logged a
    step: the compile caches are filled), not only after it ended."""
    import threading

    monkeypatch.setattr(matrix, "POLL_S", 0.05)
    cases = matrix.select(matrix.all_cases(), ["qwen2"])
    warm, lora_started, overlapped = threading.Event(), threading.Event(), []

    def run(case, gpus, slot):
        if case.mode == "full":
            warm.set()
            overlapped.append(lora_started.wait(30))   # the LoRA case starts meanwhile
        else:
            lora_started.set()
        return dict(case=case.name, failed=[])

    results = matrix.run_all(cases, matrix.GpuPool([80.0], per_gpu=2), run,
                             need=lambda case: 10.0, warm=lambda case: warm.is_set())
    assert set(results) == {"qwen2_full", "qwen2_lora"} and overlapped == [True]


def _rows(**changes):
    row = {"loss/policy": 0.01, "grad_norm": 0.5, "sync/logprob_abs_diff_mean": 0.02,
           "memory/train_peak_gib": 12.0, "memory/logprobs_peak_gib": 11.0,
           "memory/engine_asleep_gib": 2.0}
    return [dict(row, **{"numerics/first_step_gap": 0.01}), dict(row, **changes)]


ESTIMATE = {"train": 10.5, "logprobs": 9.0}   # measured training: 12 - 2 = 10 GiB


def test_verdict_passes_a_good_run():
    result = matrix.verdict(0, _rows(), ESTIMATE, 0.05)
    assert result["failed"] == []
    assert result["estimate_vs_training"] == pytest.approx(1.05)
    assert result["sync_gap"] == 0.02 and result["training_gib"] == 10.0
    assert result["first_gap"] == 0.01


@pytest.mark.parametrize("returncode, rows, atol, estimate, reason", [
    (1, _rows(), 0.05, ESTIMATE, "exit 1"),
    (0, _rows()[:1], 0.05, ESTIMATE, "1 of 2 rollout batches"),
    (0, _rows(**{"loss/policy": math.nan}), 0.05, ESTIMATE, "not finite"),
    (0, _rows(grad_norm=math.inf), 0.05, ESTIMATE, "not finite"),
    (0, _rows(**{"sync/logprob_abs_diff_mean": 0.3}), 0.05, ESTIMATE, "sync gap 0.3"),
    (0, [{k: v for k, v in r.items() if not k.startswith("sync/")} for r in _rows()], 0.5,
     ESTIMATE, "sync gap None"),
    (0, _rows(), 0.05, {"train": 12.0}, "estimate / measured 1.2"),
    (0, _rows(), 0.05, {}, "estimate / measured None"),
    (0, [dict(r, grad_norm=0.0) for r in _rows()], 0.05, ESTIMATE, "nothing trained"),
    (0, [{k: v for k, v in r.items() if not k.startswith("numerics/")} for r in _rows()], 0.05,
     ESTIMATE, "the numerics gate did not run"),
], ids=["exit", "batches", "nan-loss", "inf-grad", "gap", "no-check", "estimate", "no-dry-run",
        "no-gradient", "no-gate"])
def test_verdict_fails_each_check(returncode, rows, atol, estimate, reason):
    assert any(reason in f for f in matrix.verdict(returncode, rows, estimate, atol)["failed"])


def test_table_has_a_row_per_case():
    results = [dict(case="qwen2_full", seconds=41.2, **matrix.verdict(0, _rows(), ESTIMATE, 0.05)),
               dict(case="qwen2_lora", seconds=30.0, **matrix.verdict(1, [], {}, 0.05))]
    lines = matrix.table(results).splitlines()
    assert len(lines) == 4 and "| qwen2_full | pass | 41 |" in lines[2]
    assert lines[3].startswith("| qwen2_lora | exit 1; 0 of 2 rollout batches logged |")


@pytest.fixture
def ran(monkeypatch):
    """The names of the cases main() ran, each passing at once, on one GPU."""
    names = Ran()

    def fake_case(case, inputs, estimate, a, gpus, slot, engine):
        names.append(case.name)
        names.slots.add(slot)
        names.engines[case.name] = engine
        time.sleep(0.2)
        return dict(case=case.name, gpus="0", seconds=1.0,
                    **dict(matrix.verdict(0, _rows(), ESTIMATE, 0.05)))

    monkeypatch.setattr(matrix, "gpu_memory_gib", lambda: [80.0])
    monkeypatch.setattr(matrix, "packs_engines", lambda: True)   # (no vLLM import per call)
    monkeypatch.setattr(matrix, "prepare", lambda cases, *_: {c.family: ("m", []) for c in cases})
    monkeypatch.setattr(matrix, "estimates", lambda cases, *_: [ESTIMATE] * len(cases))
    monkeypatch.setattr(matrix, "run_case", fake_case)
    return names


class Ran(list):
    """The names of the cases run, in order; the slots they ran in, the engine flags each got."""

    def __init__(self):
        super().__init__()
        self.slots, self.engines = set(), {}


def test_main_packs_the_cases_onto_one_gpu(monkeypatch, tmp_path, ran):
    """With --per_gpu 2 the full cases run two at a time on the one GPU (each reserving its
    estimate: 10.5 x 1.15 + 2 GiB of 80), each with an engine of its own size."""
    monkeypatch.setattr(sys, "argv", ["matrix.py", "--cases", "qwen2_full", "llama3_full",
                                      "qwen3_full", "--work_dir", str(tmp_path / "w"), "--out",
                                      str(tmp_path / "o"), "--per_gpu", "2"])
    with pytest.raises(SystemExit) as stop:
        matrix.main()
    assert stop.value.code == 0 and sorted(ran) == ["llama3_full", "qwen2_full", "qwen3_full"]
    assert ran.slots == {0, 1}   # two ran side by side
    assert all("--vllm_engine_kwargs" in flags for flags in ran.engines.values())


def test_resume_runs_the_rest_and_tables_every_case(monkeypatch, tmp_path, capsys, ran):
    """A call that ran out of start budget leaves cases for the next (`--resume`, same
    --work_dir), whose table shows the earlier call's cases too; the exit code says whether
    every case ran and passed."""
    base = ["matrix.py", "--cases", "qwen2", "llama3", "--work_dir", str(tmp_path / "w"),
            "--out", str(tmp_path / "o"), "--carried", str(tmp_path / "carried.jsonl")]

    def call(*extra):
        monkeypatch.setattr(sys, "argv", [*base, *extra])
        with pytest.raises(SystemExit) as stop:
            matrix.main()
        return stop.value.code, capsys.readouterr().out

    code, out = call("--start_within", "0")
    assert code == 1 and ran == [] and "not run yet (start budget): llama3_full" in out
    run_all = matrix.run_all
    monkeypatch.setattr(matrix, "run_all", _first_only(run_all))
    code, out = call("--resume")
    assert code == 1 and ran == ["llama3_full"]
    monkeypatch.setattr(matrix, "run_all", run_all)
    code, out = call("--resume")
    assert code == 0 and ran == ["llama3_full", "qwen2_full", "llama3_lora", "qwen2_lora"]
    assert [line.split(" | ")[0] for line in out.splitlines() if line.startswith("| ")][1:] == \
        ["| llama3_full", "| qwen2_full", "| llama3_lora", "| qwen2_lora"]
    with open(tmp_path / "o" / "results.jsonl") as f:
        assert len(f.readlines()) == 4


def test_resume_takes_carried_results_of_the_same_code_only(monkeypatch, tmp_path, capsys,
                                                             ran):
    """Another lease's results (carried with the checkout) count only when they ran the same
    code: the combined table is one code's."""
    earlier = dict(gpus="0", seconds=1.0, **dict(matrix.verdict(0, _rows(), ESTIMATE, 0.05)))
    carried = tmp_path / "carried.jsonl"
    carried.write_text("".join(json.dumps(dict(earlier, case=name, code=code)) + "\n" for name, code
                               in [("llama3_full", matrix.code_version()), ("qwen2_full", "0ld")]))
    monkeypatch.setattr(sys, "argv", ["matrix.py", "--cases", "qwen2_full", "llama3_full",
                                      "--work_dir", str(tmp_path / "w"), "--out",
                                      str(tmp_path / "o"), "--resume", "--carried", str(carried)])
    with pytest.raises(SystemExit) as stop:
        matrix.main()
    out = capsys.readouterr().out
    assert stop.value.code == 0 and ran == ["qwen2_full"]
    assert f"not resumed (run on other code than {matrix.code_version()}): qwen2_full" in out
    with open(tmp_path / "o" / "results.jsonl") as f:
        assert {r["code"] for r in map(json.loads, f)} == {matrix.code_version()}


def test_code_version_follows_the_code_only(tmp_path):
    (tmp_path / "swift_megatron").mkdir()
    source = tmp_path / "swift_megatron" / "a.py"
    source.write_text("x = 1\n")
    first = matrix.code_version(str(tmp_path))
    (tmp_path / "swift_megatron" / "a.cpython-311.pyc").write_bytes(b"\0")
    (tmp_path / "README.md").write_text("docs")
    assert matrix.code_version(str(tmp_path)) == first
    source.write_text("x = 2\n")
    assert matrix.code_version(str(tmp_path)) != first


def _first_only(run_all):
    """run_all that starts one case only (a start budget spent after the first)."""
    def wrapped(cases, pool, run, may_start=lambda: True, need=None, warm=None):
        started = []
        return run_all(cases, pool, lambda *a: started.append(1) or run(*a),
                       lambda: not started)
    return wrapped


def test_launch_env_gives_each_case_its_gpus_and_port():
    one, two = matrix.all_cases()[0], matrix.all_cases("matrix_2gpu")
    env = matrix.launch_env(one, (3,), 3)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and "NPROC_PER_NODE" not in env
    tp2 = next(c for c in two if c.name == "tp2_qwen3_5")
    env = matrix.launch_env(tp2, (2, 3), 2)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["NPROC_PER_NODE"] == "2"
    assert env["MASTER_PORT"] != matrix.launch_env(tp2, (0, 1), 0)["MASTER_PORT"]
    server = next(c for c in two if c.server)   # the trainer on the first, the server the last
    env = matrix.launch_env(server, (0, 1), 0)
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and "NPROC_PER_NODE" not in env


def test_background_runs_outlast_the_call(tmp_path):
    """tests/gpu/background.sh: `start` returns at once with the phases running from a copy of
    the checkout (without .vparts) in their own session, `wait` returns when they end and
    lists the finished cases, `collect` packs the logs into $OUT."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "gpu", "background.sh")
    tree = tmp_path / "checkout"
    (tree / "tests" / "gpu").mkdir(parents=True)
    (tree / ".vparts").mkdir()
    (tree / ".vparts" / "p00").write_text("a vLLM part")
    case = json.dumps({"name": "matrix_case", "case": "qwen2_full", "seconds": 1.0,
                       "failed": []})
    (tree / "tests" / "gpu" / "device_run.sh").write_text(
        f"sleep 2; echo '{case}' > \"$OUT/$1.log\"\n")
    env = dict(os.environ, BG_DIR=str(tmp_path / "bg"), OUT=str(tmp_path / "out"))

    def run(*argv):
        return subprocess.run(["bash", os.path.abspath(script), *argv], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=60)

    assert "started in the background: matrix" in run("start", "matrix").stdout
    assert not (tmp_path / "bg" / "out" / "matrix.log").exists()   # running: start returned
    assert not (tmp_path / "bg" / "tree" / ".vparts").exists()
    waited = run("wait", "30").stdout
    assert waited.splitlines() == ["finished", "qwen2_full pass 1.0 s"]
    run("collect")
    assert (tmp_path / "out" / "background_logs.tgz").stat().st_size > 0


def test_the_dry_runs_run_in_one_process_and_are_kept(tiny_model_dir, math_dataset_path,
                                                       tmp_path, monkeypatch):
    """estimates(): every case's dry run in one worker process gives the numbers the same
    command's own dry run gives; a failed dry run gives {} for its case alone; a later call of
    the same code finds the others in --work_dir without running anything, and tries the failed
    one again."""
    import subprocess

    from dry_run_memory import memory_estimate

    cases = matrix.select(matrix.all_cases(), ["llama3_full", "qwen3_full", "qwen2_lora"])
    task = ["--dataset", math_dataset_path, "--reward_funcs", "accuracy"]
    inputs = {"llama3": (tiny_model_dir("llama"), task), "qwen2": (tiny_model_dir("qwen2"), task),
              "qwen3": (str(tmp_path / "missing"), task)}
    found = matrix.estimates(cases, inputs, str(tmp_path))
    alone = memory_estimate(matrix.command(cases[0], *inputs["llama3"], str(tmp_path / "x")),
                            matrix._dry_run_env(cases[0]))
    assert [c.name for c in cases] == ["llama3_full", "qwen3_full", "qwen2_lora"]
    assert found[0] == alone and found[0]["train"] > 0 and found[2]["train"] > 0
    assert found[1] == {}
    kept = [cases[0], cases[2]]
    monkeypatch.setattr(subprocess, "run", None)   # nothing runs the second time
    assert matrix.estimates(kept, inputs, str(tmp_path)) == [found[0], found[2]]
    with pytest.raises(TypeError):                 # the failed one would run again
        matrix.estimates(cases, inputs, str(tmp_path))


def test_optional_parts_stay_out_of_the_gate():
    gate = {c.name for c in matrix.all_cases("all")}
    assert gate and not gate & {c.name for c in matrix.all_cases("what_trains")}
