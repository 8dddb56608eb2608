"""Which vLLM sleep level the colocate engine uses, without starting vLLM (a stand-in LLM): a
level-1 sleep discards the weights (vLLM's level 2) when every weight sync sends every weight
(`full_syncs`, the trainer's case unless a frozen vision tower is left out of the syncs), keeps
them in host memory otherwise; a discarding sleep leaves the engine refusing to wake until the
next update. A real engine through the same cycle: tests/vllm/test_colocate.py."""
import pytest
import torch

from swift_megatron.arguments.commands import RlhfArguments
from swift_megatron.arguments.parser import parse_command
from swift_megatron.rollout import factory, vllm_compat


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

    def make(sleep_level: int, full_syncs: bool):
        args = parse_command(RlhfArguments, ["--model", "m", "--dataset", "d", "--use_vllm",
                                             "true", "--sleep_level", str(sleep_level)],
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
