"""--async_generate (rlhf/grpo/prefetch.py): the collector's samples of a batch whose generation
ran in the background thread equal those of the synchronous path (same seeds, tokens,
logprobs, rewards, so the same loss); `wait` returns only once the request in flight is done
(the weight sync comes after it); staleness numbers; the flag's refusals name the flags."""
import threading
import time

import pytest
import torch

from swift_megatron.errors import UserError
from swift_megatron.rlhf.grpo.batch import collate
from swift_megatron.rlhf.grpo.losses import aggregate_loss, policy_loss
from swift_megatron.rlhf.grpo.prefetch import RolloutPrefetch, staleness_metrics
from swift_megatron.rollout.engine import Completion, SamplingConfig
from tests.unit.test_grpo_arguments import grpo
from tests.unit.test_multi_turn import prompt_of, tok  # noqa: F401


class SeededEngine:
    """Completions that depend on the request's seed alone (as the real engines'), with the
    engine's weight version; `delay` seconds per call, `done` set when a call returns."""

    def __init__(self, delay=0.0):
        self.weight_version, self.delay, self.done, self.threads = 1, delay, threading.Event(), []

    def generate(self, prompts, sampling, seeds=None):
        self.threads.append(threading.current_thread().name)
        time.sleep(self.delay)
        out = []
        for seed in seeds:
            g = torch.Generator().manual_seed(seed % 2**31)
            n = int(torch.randint(2, 6, (1,), generator=g))
            tokens = torch.randint(10, 60, (n,), generator=g).tolist()
            out.append(Completion(tokens, (-torch.rand(n, generator=g)).tolist(), "length",
                                  self.weight_version))
        self.done.set()
        return out


def collector_of(engine, tok):
    from swift_megatron.rlhf.grpo.collect import CollectSettings, RolloutCollector

    def evens(completions, completion_ids, **kwargs):
        return [float(sum(ids) % 2 == 0) for ids in completion_ids]

    settings = CollectSettings(num_generations=4, sampling=SamplingConfig(max_tokens=5),
                               reward_names=["evens"], reward_weights=[1.0],
                               scale_rewards="group", dynamic_sample=False, max_resample_times=0)
    import torch.distributed as dist
    return RolloutCollector(engine, [("evens", evens)], tok, settings, dist.group.WORLD,
                            dist.group.WORLD, lambda n: [], torch.device("cpu"))


def loss_of(samples):
    batch = collate(samples, pad_id=0)
    mask = batch["completion_mask"]
    logprobs = torch.where(mask.bool(), batch["rollout_logprobs"], torch.zeros_like(mask))
    per_token, _ = policy_loss(logprobs * 0.9, logprobs, batch["advantages"], mask,
                               epsilon_low=0.2, epsilon_high=0.2)
    return aggregate_loss(per_token, mask, "dapo", num_sequences=len(samples),
                          num_tokens=float(mask.sum()), max_completion_length=5,
                          num_micro_batches=1)


def test_prefetched_batch_equals_the_synchronous_one(tok, single_process_group):  # noqa: F811
    prompts = [prompt_of(tok, "What is 3 + 4?"), prompt_of(tok, "What is 2 + 2?")]
    group_ids = [40, 41]
    sync_collector = collector_of(SeededEngine(), tok)
    expected, expected_metrics = sync_collector.collect(prompts, group_ids, seed=7)
    engine = SeededEngine()
    collector = collector_of(engine, tok)
    prefetch = RolloutPrefetch()
    prefetch.start(collector, prompts, group_ids, 7, sampler_state={"position": 3})
    prefetch.wait()
    pending = prefetch.take()
    assert prefetch.take() is None and pending.sampler_state == {"position": 3}
    samples, metrics = collector.collect(pending.prompts, pending.group_ids, seed=7,
                                         generated=pending.generated)
    prefetch.close()
    assert engine.threads == ["async_generate_0"]   # generated off the main thread
    assert len(samples) == 8 and metrics == expected_metrics
    for got, want in zip(samples, expected):
        assert (got.group_id, got.completion_ids, got.rollout_logprobs, got.rewards) == \
            (want.group_id, want.completion_ids, want.rollout_logprobs, want.rewards)
    stats = [sync_collector.assign_advantages(expected), collector.assign_advantages(samples)]
    assert stats[0] == stats[1]
    assert len({s.reward for s in samples}) == 2   # the rewards vary: the advantages matter
    assert loss_of(samples).item() == loss_of(expected).item() != 0


def test_wait_returns_after_the_request_in_flight(tok, single_process_group):  # noqa: F811
    engine = SeededEngine(delay=0.3)
    prefetch = RolloutPrefetch()
    prefetch.start(collector_of(engine, tok), [prompt_of(tok)], [0], 1, sampler_state={})
    assert not engine.done.is_set()      # the trainer goes on while the server generates
    prefetch.wait()
    assert engine.done.is_set()          # the weight sync comes only after the request
    prefetch.close()


def test_staleness_metrics():
    samples = [Completion([1], [0.0], "stop", version) for version in (2, 2, 1)]
    assert staleness_metrics(samples, 3) == pytest.approx(
        {"rollout/staleness": 4 / 3, "rollout/staleness_max": 2.0})
    assert staleness_metrics([], 3) == {"rollout/staleness": 0.0, "rollout/staleness_max": 0.0}


@pytest.mark.parametrize("argv, message", [
    (["--async_generate", "true", "--use_vllm", "false"], "--async_generate true needs vLLM"),
    (["--async_generate", "true", "--vllm_mode", "server", "--vllm_server_host", "h",
      "--multi_turn_scheduler", "calculator"],
     "drop --async_generate or --multi_turn_scheduler"),
])
def test_refused_combinations_name_the_flags(argv, message):
    with pytest.raises(UserError, match=message):
        grpo(*argv)


def test_default_is_off_as_ms_swift():
    assert grpo().async_generate is False
    assert grpo("--async_generate", "true", "--vllm_mode", "server",
                "--vllm_server_host", "h").async_generate is True


def test_trainer_prefetches_within_the_run_and_checkpoints_the_sampler_before_it():
    """No prefetch past --train_iters or --exit_interval; a checkpoint taken with a batch
    prefetched saves the sampler from before that batch's draw (a resumed run draws it again)."""
    from types import SimpleNamespace

    from swift_megatron.rlhf.grpo.prefetch import Prefetched
    from swift_megatron.rlhf.grpo.trainer import GRPOTrainer

    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.steps_per_rollout, trainer.train_iters = 2, 6
    trainer.args = SimpleNamespace(training=SimpleNamespace(exit_interval=None))
    assert [trainer._another_batch() for trainer.step in (0, 2, 4)] == [True, True, False]
    trainer.args.training.exit_interval = 4
    assert [trainer._another_batch() for trainer.step in (0, 2)] == [True, False]
    trainer.sampler = SimpleNamespace(state_dict=lambda: {"position": 12})
    trainer.prefetch = RolloutPrefetch()
    assert trainer._sampler_state() == {"position": 12}
    trainer.prefetch.pending = Prefetched([], [], None, {"position": 8})
    assert trainer._sampler_state() == {"position": 8}
    trainer.prefetch = None
    assert trainer._sampler_state() == {"position": 12}
