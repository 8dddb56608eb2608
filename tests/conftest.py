"""Shared pytest configuration. Markers: `gpu` tests need CUDA and run on the GPU machine only;
`quick` marks the fast development subset (`python -m pytest tests/unit -m quick -n 2`): every
tests/unit test but those of NOT_QUICK.

Session fixtures (swift_megatron.fixtures, built offline into a tmp dir): `tiny_model_dir(family)`
-> path of a tiny seed-0 checkpoint, `math_dataset_path` -> a 64-row math jsonl.
Per test: `single_process_group` -> a one-process torch.distributed world (reused when an
earlier test of the worker left one up), `swift_logs` -> caplog on our logger.
"""
import json
import os
from pathlib import Path

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (runs on the GPU machine, skipped elsewhere)")
    config.addinivalue_line("markers", "slow: multi-process or end-to-end test (seconds to minutes)")
    config.addinivalue_line("markers", "quick: the fast development subset (tests/unit but its "
                                       "slowest tests, tests/conftest.py NOT_QUICK)")


# The slowest tests/unit tests, left out of `-m quick`: a file, or `file::name` for the tests of
# that file named `name` or using a fixture named `name`. Every package of swift_megatron keeps
# quick tests (tests/unit/test_quick_subset.py checks it).
NOT_QUICK = frozenset({
    "tests/unit/test_examples.py",            # each example script's dry run, a subprocess each
    "tests/unit/test_export_scripts.py",      # scripts/export/*.sh, converting checkpoints
    "tests/unit/test_export_forms.py",        # every export form, converted and read back
    "tests/unit/test_recompute.py",           # each layout and family in worker processes
    "tests/unit/test_moe_numerics.py",        # one MoE training run in a subprocess
    "tests/unit/test_layer_time.py",          # a Qwen3.5 stack's layers timed in a subprocess
    "tests/unit/test_moe_layer_bench.py",     # MoE models' train steps timed in a subprocess
    "tests/unit/test_moe_grouped.py::world",  # tiny MoE models built and run in both forms
    "tests/unit/test_lora.py::checks",        # every family's LoRA model in worker processes
    # every family's GRPO step on the CUDA paths: Inductor compiles for about a minute when cold
    "tests/unit/test_cuda_paths.py::test_cuda_paths_give_the_cpu_defaults_grpo_step",
    "tests/unit/test_export_cli.py::test_nproc_per_node_relaunches_under_torchrun",
    "tests/unit/test_cli.py::test_dry_run_checks_the_model",
    "tests/unit/test_moe_flags.py::cpu_state",         # tiny MoE models trained in-process
    "tests/unit/test_routing_replay.py::cpu_state",    # and replayed, against transformers
})


@pytest.hookimpl(tryfirst=True)   # before pytest's own hook deselects by -m
def pytest_collection_modifyitems(config, items):
    _mark_quick(items)
    _longest_files_first(items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run tests/gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _mark_quick(items) -> None:
    root = Path(__file__).parent.parent
    for item in items:
        if not item.path.is_relative_to(root):
            continue
        path = item.path.relative_to(root).as_posix()
        names = (getattr(item, "originalname", item.name), *getattr(item, "fixturenames", ()))
        if path.startswith("tests/unit/") and path not in NOT_QUICK \
                and not any(f"{path}::{name}" in NOT_QUICK for name in names):
            item.add_marker(pytest.mark.quick)


def _longest_files_first(items) -> None:
    """Order the test files by the seconds tests/durations.json gives them, longest first (a file
    missing there counts 30 s), each file's tests kept together and in order. With
    `--dist loadfile --no-loadscope-reorder` (.ci/run) pytest-xdist hands out files in this
    order, so the last ones to start are short. scripts/test_durations.py refreshes the table."""
    table = json.loads((Path(__file__).parent / "durations.json").read_text())
    root = Path(__file__).parent.parent

    def seconds(item):
        path = item.path.relative_to(root) if item.path.is_relative_to(root) else item.path
        return table.get(path.as_posix(), 30)

    items.sort(key=lambda item: -seconds(item))   # stable: a file's tests stay in order


def _restore(before: dict) -> None:
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def _environment_kept():
    """Each test leaves os.environ as it found it: an in-process ParallelState sets RANK /
    WORLD_SIZE / MASTER_* (a later `megatron rlhf` subprocess with NPROC_PER_NODE would take itself
    for an already launched worker of world size 1), and megatron-core's GPTModel records its
    attention backend in NVTE_* (a later subprocess choosing another backend fails its check)."""
    before = dict(os.environ)
    yield
    _restore(before)


@pytest.fixture(scope="module", autouse=True)
def _environment_kept_by_module():
    """The same for a test module: its module-scoped fixtures (set up before the per-test
    snapshot above) may build models in this process too."""
    before = dict(os.environ)
    yield
    _restore(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory `family -> path` of a tiny seed-0 float32 checkpoint, built once per session."""
    from swift_megatron.fixtures import build_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    built = {}

    def get(family: str) -> str:
        if family not in built:
            built[family] = build_tiny_model(family, str(root / family))
        return built[family]

    return get


@pytest.fixture(scope="session")
def math_dataset_path(tmp_path_factory):
    """Path of the default 64-row fixtures math dataset (jsonl), built once per session."""
    from swift_megatron.fixtures import build_math_dataset

    return build_math_dataset(str(tmp_path_factory.mktemp("data") / "math.jsonl"))


@pytest.fixture
def swift_logs(caplog):
    """caplog for the `swift_megatron` logger, which does not propagate to the root logger."""
    import logging

    logger = logging.getLogger("swift_megatron")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="swift_megatron")
    yield caplog
    logger.removeHandler(caplog.handler)


@pytest.fixture
def single_process_group():
    """A one-process world: the one an earlier test of this process left up on purpose
    (tests/vllm/test_colocate.py: vLLM's in-process engines keep it), else a new gloo world."""
    import torch.distributed as dist

    from tests.distributed.launch import free_port

    if dist.is_initialized():
        assert dist.get_world_size() == 1
        yield dist.group.WORLD
        return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
