"""--async_generate: the next rollout batch's generation in a background thread, overlapping
the trainer's logprob passes and optimizer steps on this one (docs/rlhf.md, "Asynchronous
generation").

The trainer draws the next batch's prompts from the sampler as soon as it has this batch's
samples, and `RolloutPrefetch.start` hands their generation to one worker thread (the engine
call only: scoring, resampling and every collective of the training groups stay on the main
thread). Before the weight sync the trainer calls `wait`: no generation request is in flight
while the servers load new weights, so the prefetched batch was generated entirely by the
weights of one update before (one step off-policy). `take` returns it at the next rollout.
"""
import dataclasses
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence

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


class RolloutPrefetch:
    def __init__(self):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="async_generate")
        self.pending: Optional[Prefetched] = None

    def start(self, collector, prompts: Sequence[Prompt], group_ids: Sequence[int], seed: int,
              sampler_state: Dict[str, Any]) -> None:
        future = collector.start_generation(prompts, group_ids, seed, self._pool)
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
