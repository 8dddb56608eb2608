"""When the requests of one generate call finished: the generation's time, its tail and how busy
the GPU was in that tail (docs/rollout.md, "The generation's tail").

The tail of a call is the time from the moment TAIL_FRACTION of its completions were done to
the last one: while the last few sequences decode, the GPU runs small batches. The colocate
engine feeds a `GenerationClock` after every engine step (rollout/vllm_colocate.py); on CUDA
the clock samples the GPU's utilisation (NVML, through torch) during the tail, at most every
UTILISATION_PERIOD_S.
"""
import dataclasses
import math
import time
from typing import List, Optional, Sequence

TAIL_FRACTION = 0.9
UTILISATION_PERIOD_S = 0.1


def tail_start(finish_times: Sequence[float], fraction: float = TAIL_FRACTION) -> float:
    """The time by which `fraction` of the requests had finished (finish_times: one per request,
    any order; at least one). Pure."""
    ordered = sorted(finish_times)
    return ordered[max(math.ceil(fraction * len(ordered)), 1) - 1]


@dataclasses.dataclass
class GenerationTimes:
    """One generate call: seconds from its start to its last completion, of them the tail's,
    and the GPU's mean utilisation during the tail in percent (None: not measured)."""

    generate_s: float
    tail_s: float
    tail_gpu_util: Optional[float] = None


_TORCH_NVML = [True]   # whether torch's NVML reader works here (it needs the pynvml package)


def gpu_utilisation() -> Optional[float]:
    """This process's GPU's utilisation in percent over NVML's last sample period (torch's
    reader, else vLLM's bundled NVML bindings), None without CUDA or NVML."""
    import torch

    if not torch.cuda.is_available():
        return None
    if _TORCH_NVML[0]:
        try:
            return float(torch.cuda.utilization())
        except Exception:
            _TORCH_NVML[0] = False
    from swift_megatron.rollout.vllm_compat import nvml_utilisation

    return nvml_utilisation(torch.cuda.current_device())


class GenerationClock:
    """Finish times of one call's `total` requests, fed after every engine step (`step`)."""

    def __init__(self, total: int, sample_gpu: bool = True):
        self.start, self.total = time.perf_counter(), total
        self.finishes: List[float] = []
        self.utilisation: List[float] = []
        self._sample_gpu, self._sampled_at = sample_gpu, -math.inf

    def step(self, finished: int) -> None:
        now = time.perf_counter()
        self.finishes += [now] * finished
        if self._sample_gpu and self.in_tail and now - self._sampled_at >= UTILISATION_PERIOD_S:
            self._sampled_at = now
            value = gpu_utilisation()
            self._sample_gpu = value is not None
            if value is not None:
                self.utilisation.append(value)

    @property
    def in_tail(self) -> bool:
        return len(self.finishes) >= max(math.ceil(TAIL_FRACTION * self.total), 1) \
            and len(self.finishes) < self.total

    def times(self) -> Optional[GenerationTimes]:
        """The call's times, None when no request finished."""
        if not self.finishes:
            return None
        util = sum(self.utilisation) / len(self.utilisation) if self.utilisation else None
        return GenerationTimes(self.finishes[-1] - self.start,
                               self.finishes[-1] - tail_start(self.finishes), util)


def timing_metrics(times: Sequence[GenerationTimes]) -> dict:
    """time/generate_s and time/generate_tail_s summed over a rollout batch's generate calls
    (its dynamic-sampling rounds each have a tail), perf/tail_gpu_util their mean where
    measured."""
    if not times:
        return {}
    metrics = {"time/generate_s": sum(t.generate_s for t in times),
               "time/generate_tail_s": sum(t.tail_s for t in times)}
    util = [t.tail_gpu_util for t in times if t.tail_gpu_util is not None]
    if util:
        metrics["perf/tail_gpu_util"] = sum(util) / len(util)
    return metrics
