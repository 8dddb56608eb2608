"""The colocate engine as the flags build it, without starting vLLM (a stand-in LLM).

Which vLLM sleep level it uses: a level-1 sleep discards the weights (vLLM's level 2) when every
weight sync sends every weight (`full_syncs`, the trainer's case unless a frozen vision tower is
left out of the syncs), keeps them in host memory otherwise; a discarding sleep leaves the engine
refusing to wake until the next update. Which seeds its requests carry: one per request by
default, none with `--vllm_request_seeds false`, whose generate call runs with torch's RNG seeded
from the call's seeds and restored after. A real engine through the same cycles:
tests/vllm/test_colocate.py."""
from types import SimpleNamespace

import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.rollout import factory, vllm_compat
from swift_megatron.rollout.engine import SamplingConfig


@pytest.fixture
def build(monkeypatch, tmp_path):
    """build(sleep_level, full_syncs) -> (the engine, the levels vLLM's sleep was called with)."""
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    levels = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(vllm_compat, "create_llm", lambda settings: object())
    monkeypatch.setattr(vllm_compat, "version", lambda: (0, 0, 0))
    monkeypatch.setattr(vllm_compat, "sleep", lambda llm, level: levels.append(level))
    monkeypatch.setattr(vllm_compat, "wake_up", lambda llm, tags=None: None)

    def make(sleep_level: int, full_syncs: bool, *flags: str):
        args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--use_vllm",
                                             "true", "--sleep_level", str(sleep_level), *flags],
                             "megatron rlhf")
        engine = factory.build_engine(args, model_dir=str(tmp_path), device=torch.device("cpu"),
                                      dtype=torch.float32, eos_token_ids=[2], pad_token_id=0,
                                      full_syncs=full_syncs)
        return engine, levels

    return make


@pytest.mark.parametrize("sleep_level, full_syncs, vllm_level", [
    (1, True, 2),    # the host copy would be overwritten unread: discarded
    (1, False, 1),   # a sync leaves weights out: they must survive the sleep
    (2, True, 2), (2, False, 2), (0, True, None)])
def test_sleep_level_passed_to_vllm(build, sleep_level, full_syncs, vllm_level):
    engine, levels = build(sleep_level, full_syncs)
    engine.sleep()
    engine.sleep()   # asleep already: nothing more
    assert levels == ([] if vllm_level is None else [vllm_level])
    assert engine.weights_discarded == (vllm_level == 2)


def test_discarded_weights_refuse_the_wake_up_until_an_update(build, monkeypatch):
    engine, _ = build(1, True)
    engine.sleep()
    with pytest.raises(RuntimeError, match="update_weights must come before wake_up"):
        engine.wake_up()
    monkeypatch.setattr(engine, "llm", type("LLM", (), {
        "collective_rpc": lambda self, *a, **k: None, "reset_prefix_cache": lambda self: None})())
    engine.update_weights(iter([]))
    assert not engine.weights_discarded
    engine.wake_up()
    assert engine._asleep == []


@pytest.mark.parametrize("flags, per_request", [((), True),
                                                (("--vllm_request_seeds", "false"), False)])
def test_request_seeds_flag(build, monkeypatch, flags, per_request):
    engine, _ = build(0, True, *flags)
    calls = []   # (each request's seed, a draw from torch's RNG inside the call)

    class StandIn:
        llm_engine = SimpleNamespace(add_request=None, step=None)   # the step hook's target

        def generate(self, inputs, params, use_tqdm):
            calls.append(([p.seed for p in params], torch.rand(1).item()))
            return [None] * len(inputs)

    monkeypatch.setattr(engine, "llm", StandIn())
    monkeypatch.setattr(vllm_compat, "completion_fields", lambda out: ([1], [0.0], "stop"))
    torch.manual_seed(0)
    outside = torch.rand(1).item()
    torch.manual_seed(0)
    sampling = SamplingConfig(max_tokens=4)
    for seeds in ([5, 6], [5, 6], [7, 8]):
        engine.generate([[1, 2], [3]], sampling, seeds)
    assert [seeds for seeds, _ in calls] == ([[5, 6], [5, 6], [7, 8]] if per_request
                                             else [[None, None]] * 3)
    draws = [draw for _, draw in calls]
    if per_request:   # torch's RNG untouched: the calls draw on from the caller's stream
        assert draws[0] == outside and len(set(draws)) == 3
    else:   # seeded per call from its seeds, and the caller's stream restored after
        assert draws[0] == draws[1] != draws[2]
        assert torch.rand(1).item() == outside


def test_wake_up_hands_torchs_cached_blocks_back_first(monkeypatch):
    """vLLM 0.26's allocator maps the engine's memory beside whatever torch still caches for
    the trainer; vllm_compat.wake_up empties that cache first, on CUDA."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    llm = type("LLM", (), {"wake_up": lambda self, tags=None: calls.append(("wake_up", tags))})()
    vllm_compat.wake_up(llm, ["kv_cache"])
    assert calls == ["empty_cache", ("wake_up", ["kv_cache"])]
