"""--async_generate: the next rollout batch's generation in a background thread, overlapping
the trainer's logprob passes and optimizer steps on this one (docs/rlhf.md, "Asynchronous
generation").

The trainer draws the next batch's prompts from the sampler as soon as it has this batch's
samples, and `RolloutPrefetch.start` hands their generation to one worker thread (the engine
call only: scoring, resampling and every collective of the training groups stay on the main
thread). Before the weight sync the trainer calls `wait`: no generation request is in flight
while the engine loads new weights, so the prefetched batch was generated entirely by the
weights of one update before (one step off-policy). `take` returns it at the next rollout.
The engine is the rollout servers' (HTTP) or, in colocate mode, the process's own vLLM engine:
on CUDA its thread then runs on a CUDA stream of its own (`own_stream`), so that its kernels
run beside the trainer's instead of queueing behind them, and waits for that stream before it
returns.
"""
import contextlib
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from swift_megatron.data import Prompt
from swift_megatron.rlhf.grpo.batch import Sample


@dataclasses.dataclass
class Prefetched:
    """One rollout batch whose generation is under way: its prompts, group ids, the future of
    this rank's completions, and the sampler's state before its prompts were drawn (what a
    checkpoint saves, so a resumed run draws them again)."""

    prompts: List[Prompt]
    group_ids: List[int]
    generated: Future
    sampler_state: Dict[str, Any]


class _OnStream:
    """An executor whose calls run on `stream` (and wait for its work before returning)."""

    def __init__(self, pool: ThreadPoolExecutor, stream: Optional["torch.cuda.Stream"]):
        self.pool, self.stream = pool, stream

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        return self.pool.submit(self._run, fn, *args, **kwargs)

    def _run(self, fn: Callable, *args, **kwargs):
        with torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext():
            result = fn(*args, **kwargs)
        if self.stream is not None:
            self.stream.synchronize()
        return result


class RolloutPrefetch:
    def __init__(self, own_stream: bool = False):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="async_generate")
        stream = torch.cuda.Stream() if own_stream and torch.cuda.is_available() else None
        self._executor = _OnStream(self._pool, stream)
        self.pending: Optional[Prefetched] = None

    def start(self, collector, prompts: Sequence[Prompt], group_ids: Sequence[int], seed: int,
              sampler_state: Dict[str, Any]) -> None:
        future = collector.start_generation(prompts, group_ids, seed, self._executor)
        self.pending = Prefetched(list(prompts), list(group_ids), future, sampler_state)

    def wait(self) -> None:
        """Block until the pending generation is done (re-raising its error)."""
        if self.pending is not None:
            self.pending.generated.result()

    def take(self) -> Optional[Prefetched]:
        pending, self.pending = self.pending, None
        return pending

    def close(self) -> None:
        """Let a generation under way finish (its results are dropped), then stop the thread."""
        self._pool.shutdown(wait=True)
        self.pending = None


def staleness_metrics(samples: Sequence[Sample], policy_version: int) -> Dict[str, float]:
    """rollout/staleness: weight updates between the weights that generated each sample and
    the policy that trains on it (0 on-policy, 1 with --async_generate after the first batch),
    mean and max over this rank's samples."""
    lags = [policy_version - s.weight_version for s in samples] or [0]
    return {"rollout/staleness": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags))}
