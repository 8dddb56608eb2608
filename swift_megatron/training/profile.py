"""What a rollout batch's phases cost, for performance work.

`measure_phase` times each phase (rollout, logprobs, train, sync, sync_check) into
`time/<phase>_s` and, on CUDA, its peak allocated memory into `memory/<phase>_peak_gib` (torch's
counter, reset at the phase's start). The optional torch-profiler capture of one rollout batch:

    SWIFT_MEGATRON_PROFILE=DIR megatron rlhf ...    # profiles the 3rd rollout batch on rank 0

writes DIR/profile_rank0.txt: the operators sorted by their CUDA (else CPU) self time, and the
time each named phase took (record_function ranges: rollout, logprobs, train, sync,
sync_check)."""
import contextlib
import os
import time
from typing import Dict

import torch

ENV = "SWIFT_MEGATRON_PROFILE"
PROFILED_BATCH = 3


@contextlib.contextmanager
def maybe_profile(batch_index: int, rank: int):
    """Profile this rollout batch when the environment asks for it (rank 0, the 3rd batch)."""
    directory = os.environ.get(ENV)
    if not directory or rank != 0 or batch_index != PROFILED_BATCH:
        yield
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield
    os.makedirs(directory, exist_ok=True)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    with open(os.path.join(directory, f"profile_rank{rank}.txt"), "w") as f:
        f.write(prof.key_averages().table(sort_by=key, row_limit=60))


@contextlib.contextmanager
def measure_phase(name: str, metrics: Dict[str, float], device: torch.device):
    """Run a phase as a named profiler range; put its seconds and (CUDA) peak GiB in `metrics`."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.profiler.record_function(name):
        yield
    metrics[f"time/{name}_s"] = time.perf_counter() - start
    if cuda:
        metrics[f"memory/{name}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
