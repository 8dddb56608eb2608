"""--vllm_max_num_seqs and --vllm_engine_kwargs without starting vLLM: the LLM(...) keywords of
the colocate engine (built by the trainer's factory) and of the `megatron rollout` replicas, the
precedence (flags over the kwargs dict, swift-megatron's required keywords over both), and the
UserErrors for keys vLLM does not take or that would break weight sync / logprobs; the sampled
logprobs read from vLLM's flat container. An engine really started with them: tests/vllm/test_colocate.py and tests/vllm/test_server.py."""
import logging
from types import SimpleNamespace

import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments, RolloutCommandArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.errors import UserError
from swift_megatron.rollout import vllm_compat
from swift_megatron.rollout.vllm_compat import EngineSettings, check_engine_kwargs, engine_kwargs
from swift_megatron.rollout.weight_sync import WORKER_EXTENSION

KWARGS = '{"max_num_batched_tokens": 1024, "block_size": 32}'


def rlhf(*argv):
    return parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", *argv], "megatron rlhf")


@pytest.fixture
def model_dir(tmp_path):
    """A model directory as far as the engine settings read it (the model type decides the
    model-specific engine keywords: none for qwen2)."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    return str(tmp_path)


@pytest.fixture
def colocate_settings(monkeypatch, model_dir):
    """Build the trainer's colocate engine with a stand-in LLM, in a process without a
    torch.distributed world (an earlier test of this pytest worker may have left one: vLLM's
    in-process engines keep theirs); returns the EngineSettings the engine asked vLLM for."""
    from swift_megatron.rollout import factory

    seen = {}
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(vllm_compat, "create_llm", lambda s: seen.setdefault("settings", s))
    monkeypatch.setattr(vllm_compat, "version", lambda: (0, 0, 0))

    def build(*argv):
        args = rlhf("--use_vllm", "true", "--vllm_mode", "colocate", *argv)
        factory.build_engine(args, model_dir=model_dir, device=torch.device("cpu"),
                             dtype=torch.float32, eos_token_ids=[2], pad_token_id=0)
        return seen["settings"]

    return build


def test_colocate_engine_gets_both_flags(colocate_settings, model_dir):
    settings = colocate_settings("--vllm_max_num_seqs", "16", "--vllm_engine_kwargs", KWARGS,
                                 "--seed", "3", "--max_length", "512")
    assert engine_kwargs(settings, sleep_mode_available=False) == dict(
        model=model_dir, dtype="float32", seed=3, tensor_parallel_size=1,
        gpu_memory_utilization=0.9, max_model_len=512, max_num_seqs=16, enforce_eager=False,
        enable_prefix_caching=True, load_format="dummy", disable_log_stats=True,
        max_num_batched_tokens=1024, block_size=32, logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION)


def test_without_the_flags_vllm_keeps_its_defaults(colocate_settings):
    kwargs = engine_kwargs(colocate_settings(), sleep_mode_available=False)
    assert "max_num_seqs" not in kwargs and "max_num_batched_tokens" not in kwargs


def test_rollout_server_replicas_get_both_flags(model_dir):
    from swift_megatron.rollout.server import engine_settings

    args = parse_command(RolloutCommandArguments,
                         ["--model", "m", "--vllm_max_num_seqs", "8", "--vllm_engine_kwargs",
                          KWARGS], "megatron rollout")
    kwargs = engine_kwargs(engine_settings(args, model_dir), sleep_mode_available=True)
    assert kwargs == dict(model=model_dir, tensor_parallel_size=1, gpu_memory_utilization=0.9,
                          max_num_seqs=8, enforce_eager=False, enable_prefix_caching=True,
                          load_format="auto", disable_log_stats=True,
                          max_num_batched_tokens=1024, block_size=32,
                          logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION)


def test_disable_cascade_attn_reaches_both_engines(colocate_settings, model_dir):
    """--vllm_disable_cascade_attn (ms-swift's): vLLM's EngineArgs field, set on the colocate
    engine and the rollout server's replicas (unnamed, vLLM's default, without the flag:
    test_colocate_engine_gets_both_flags)."""
    from swift_megatron.rollout.server import engine_settings

    assert "disable_cascade_attn" in vllm_compat.accepted_engine_keys()
    on = colocate_settings("--vllm_disable_cascade_attn", "true")
    assert engine_kwargs(on, sleep_mode_available=False)["disable_cascade_attn"] is True
    args = parse_command(RolloutCommandArguments, ["--model", "m", "--vllm_disable_cascade_attn",
                                                   "true"], "megatron rollout")
    assert engine_kwargs(engine_settings(args, model_dir), True)["disable_cascade_attn"] is True


@pytest.mark.parametrize("argv, env, expected", [
    ([], None, None), ([], "50176", 50176), (["--max_pixels", "12544"], "50176", 12544)])
def test_rollout_server_max_pixels_flag_over_environment(tmp_path, monkeypatch, argv, env,
                                                         expected):
    """`megatron rollout --max_pixels` (ms-swift's rollout takes it too) caps the replicas'
    images as the trainer's does: vLLM's mm_processor_kwargs, the flag over MAX_PIXELS; without
    either the model's processor decides."""
    from swift_megatron.rollout.server import engine_settings

    (tmp_path / "config.json").write_text('{"model_type": "qwen2_5_vl"}')
    monkeypatch.delenv("MAX_PIXELS", raising=False)
    if env is not None:
        monkeypatch.setenv("MAX_PIXELS", env)
    args = parse_command(RolloutCommandArguments, ["--model", "m", *argv], "megatron rollout")
    kwargs = engine_kwargs(engine_settings(args, str(tmp_path)), sleep_mode_available=True)
    assert kwargs.get("mm_processor_kwargs") == (expected and {"max_pixels": expected})


def test_rollout_max_pixels_is_checked_at_parse_time():
    with pytest.raises(UserError, match=r"^--max_pixels must be >= 1, got 0$"):
        parse_command(RolloutCommandArguments, ["--model", "m", "--max_pixels", "0"],
                      "megatron rollout")


def test_a_set_flag_wins_over_the_same_key_and_says_so(swift_logs):
    settings = EngineSettings(model="m", max_num_seqs=16, gpu_memory_utilization=0.5,
                              extra={"max_num_seqs": 4, "gpu_memory_utilization": 0.5})
    assert engine_kwargs(settings, False)["max_num_seqs"] == 16
    assert [(r.levelno, r.getMessage()) for r in swift_logs.records] == [
        (logging.WARNING, "--vllm_engine_kwargs max_num_seqs=4 is overridden by "
                          "--vllm_max_num_seqs (16)")]   # the same value: nothing to say


def test_an_unset_flag_leaves_the_key_to_the_kwargs_dict(swift_logs):
    settings = EngineSettings(model="m", extra={"max_num_seqs": 4, "max_model_len": 128,
                                                "seed": 9, "load_format": "auto"})
    kwargs = engine_kwargs(settings, False)
    assert (kwargs["max_num_seqs"], kwargs["max_model_len"], kwargs["seed"],
            kwargs["load_format"]) == (4, 128, 9, "auto")
    assert swift_logs.records == []


def test_sleep_mode_only_where_vllm_has_it():
    settings = EngineSettings(model="m", sleep_level=1)
    assert engine_kwargs(settings, True)["enable_sleep_mode"] is True
    assert "enable_sleep_mode" not in engine_kwargs(settings, False)


@pytest.mark.parametrize("key, value, external, reason", [
    ("logprobs_mode", "raw_logprobs", False, "the GRPO loss compares"),
    ("worker_extension_cls", "my.Ext", False, "weight sync runs through"),
    ("distributed_executor_backend", "mp", True, "colocate mode runs one engine per"),
])
def test_keys_swift_megatron_depends_on_are_user_errors(key, value, external, reason):
    settings = EngineSettings(model="m", worker_extension_cls=WORKER_EXTENSION,
                              external_launcher=external, extra={key: value})
    with pytest.raises(UserError, match=rf"^--vllm_engine_kwargs: {key} must stay .*\({reason}"):
        engine_kwargs(settings, False)


def test_the_servers_backend_is_the_users_to_choose():
    settings = EngineSettings(model="m", extra={"distributed_executor_backend": "mp"})
    assert engine_kwargs(settings, False)["distributed_executor_backend"] == "mp"


def test_keys_vllm_does_not_take_are_user_errors():
    accepted = ["max_num_seqs", "max_num_batched_tokens", "block_size"]
    check_engine_kwargs({"max_num_batched_tokens": 1, "block_size": 16}, accepted)
    with pytest.raises(UserError, match=r"^--vllm_engine_kwargs: vLLM's engine takes no "
                                        r"max_num_batch_tokens \(did you mean "
                                        r"max_num_batched_tokens\?\), colour; see vLLM's "
                                        r"EngineArgs"):
        check_engine_kwargs({"max_num_batch_tokens": 1, "block_size": 16, "colour": 1}, accepted)


@pytest.fixture
def failing_llm(monkeypatch):
    """create_llm with a stand-in vLLM whose engine start raises `error`."""
    def fail_with(error):
        def llm(**kwargs):
            raise error
        monkeypatch.setattr(vllm_compat, "import_vllm", lambda: SimpleNamespace(LLM=llm))
        monkeypatch.setattr(vllm_compat, "check_model_supported", lambda model, dtype=None: None)
        monkeypatch.setattr(vllm_compat, "model_defaults", lambda model: {})
        monkeypatch.setattr(vllm_compat, "accepted_engine_keys", lambda: ["block_size"])
        monkeypatch.setattr(vllm_compat, "sleep_mode_available", lambda: False)
    return fail_with


def test_a_value_vllm_rejects_at_start_is_a_user_error(failing_llm):
    failing_llm(ValueError("block_size must be a power of two, got 7"))
    with pytest.raises(UserError, match=r"^--vllm_engine_kwargs: vLLM rejected block_size: "
                                        r"ValueError: block_size must be a power of two, got 7$"):
        vllm_compat.create_llm(EngineSettings(model="m", extra={"block_size": 7}))


def test_a_start_failure_that_names_no_key_still_points_at_the_kwargs(failing_llm):
    # what vLLM 0.32 raises for {"max_num_batched_tokens": "abc"}
    failing_llm(TypeError("'<' not supported between instances of 'str' and 'int'"))
    with pytest.raises(UserError, match=r'^--vllm_engine_kwargs: vLLM could not start with '
                                        r'\{"block_size": "abc"\} \(check their values\): '
                                        r"TypeError: '<' not supported"):
        vllm_compat.create_llm(EngineSettings(model="m", extra={"block_size": "abc"}))


def test_without_engine_kwargs_start_failures_keep_their_traceback(failing_llm):
    failing_llm(TypeError("a bug"))
    with pytest.raises(TypeError, match="^a bug$"):
        vllm_compat.create_llm(EngineSettings(model="m"))


@pytest.fixture(scope="module")
def qwen3_5_dirs(tmp_path_factory):
    """Tiny Qwen3.5 checkpoints with a vision tower: with and without an image processor."""
    from swift_megatron.fixtures import build_tiny_model

    root = tmp_path_factory.mktemp("qwen3_5_engine")
    with_processor = build_tiny_model("qwen3_5", str(root / "images"), images=True)
    without = build_tiny_model("qwen3_5", str(root / "images_no_processor"), images=True)
    (root / "images_no_processor" / "preprocessor_config.json").unlink()
    return with_processor, without


@pytest.mark.parametrize("images, expected", [(None, False), (True, False), (False, None)])
def test_qwen3_5_engine_starts_its_tower_only_for_images(qwen3_5_dirs, images, expected):
    """language_model_only (vllm_compat.model_defaults: True for Qwen3.5) is turned off when
    the trainer's prompts hold images (True) or, for a rollout server (None), when the
    checkpoint takes images; a text-only run keeps the default (no key here)."""
    pytest.importorskip("vllm")
    from swift_megatron.rollout.factory import vision_engine_kwargs

    kwargs = vision_engine_kwargs(qwen3_5_dirs[0], None, dummy_weights=True, images=images)
    assert kwargs.get("language_model_only") is expected
    assert vllm_compat.model_defaults(qwen3_5_dirs[0]) == {"language_model_only": True}
    # a server for a checkpoint without an image processor: text only
    assert "language_model_only" not in vision_engine_kwargs(qwen3_5_dirs[1], None, False)


def test_images_with_a_language_only_engine_are_refused(monkeypatch, qwen3_5_dirs):
    pytest.importorskip("vllm")
    from swift_megatron.rollout import factory

    monkeypatch.setattr(vllm_compat, "create_llm", lambda s: pytest.fail("engine started"))
    args = rlhf("--use_vllm", "true", "--vllm_mode", "colocate", "--vllm_engine_kwargs",
                '{"language_model_only": true}')
    with pytest.raises(UserError, match="language_model_only.*holds images"):
        factory.build_engine(args, model_dir=qwen3_5_dirs[0], device=torch.device("cpu"),
                             dtype=torch.float32, eos_token_ids=[2], pad_token_id=0, images=True)


def test_sampled_logprobs_come_flat_and_sampled_first():
    """`sampling_params` asks vLLM for FlatLogprobs; `completion_fields` takes each position's
    first entry (vLLM puts the sampled token first, then any top-k), one per token."""
    from vllm.logprobs import FlatLogprobs, Logprob

    params = vllm_compat.sampling_params(8, 1.0, 1.0, 0, 1.0, seed=1)
    assert params.flat_logprobs and params.logprobs == 0
    plain = vllm_compat.sampling_params(8, 1.0, 1.0, 0, 1.0, seed=1, logprobs=False)
    assert not plain.flat_logprobs and plain.logprobs is None
    flat = FlatLogprobs()
    flat.append({5: Logprob(-0.5, rank=2), 9: Logprob(-0.1, rank=1)})   # sampled 5, top-1 9
    flat.append({7: Logprob(-1.25, rank=1)})
    sample = SimpleNamespace(token_ids=[5, 7], logprobs=flat, finish_reason="stop")
    assert vllm_compat.completion_fields(SimpleNamespace(outputs=[sample])) == (
        [5, 7], [-0.5, -1.25], "stop")
    sample.token_ids = [5, 7, 3]
    with pytest.raises(RuntimeError, match="2 logprobs for 3 tokens"):
        vllm_compat.completion_fields(SimpleNamespace(outputs=[sample]))
