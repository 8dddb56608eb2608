"""What a rollout batch's phases cost, for performance work.

`measure_phase` times each phase (rollout, logprobs, train, sync, sync_check) into
`time/<phase>_s` and, on CUDA, its peak allocated memory into `memory/<phase>_peak_gib` (torch's
counter, reset at the phase's start); `device_memory` reads the whole device (the trainer logs it
at the end of each generation: `memory/generate_device_used_gib`, `memory/generate_reserved_gib`);
`host_memory` the process's peak host memory (`memory/host_peak_rss_gib`, every device).
The optional torch-profiler capture of one rollout batch:

    SWIFT_MEGATRON_PROFILE=DIR megatron rlhf ...    # profiles the 3rd rollout batch on rank 0

writes DIR/profile_rank0.txt: the operators sorted by their CUDA (else CPU) self time, and the
time each named phase took (record_function ranges: rollout, logprobs, train, sync,
sync_check); then one table per phase (`phase_tables`): the operators called inside it, by
their self time (the CUDA time of the kernels they launched, else CPU time)."""
import collections
import contextlib
import os
import time
from typing import Dict, Optional

import torch
from torch.autograd import DeviceType

ENV = "SWIFT_MEGATRON_PROFILE"
PROFILED_BATCH = 3
PHASES = ("rollout", "logprobs", "train", "sync", "sync_check")


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
        f.write(phase_tables(prof.events(), device=torch.cuda.is_available()))


def phase_at(ranges, moment: float) -> Optional[str]:
    """The phase whose (name, start, end) range holds `moment`, or None."""
    return next((name for name, start, end in ranges if start <= moment < end), None)


def phase_tables(events, device: bool, rows: int = 25) -> str:
    """Per phase, its operators by self time (device time if `device`, else CPU time):
    milliseconds, calls and share of the phase's total, the largest `rows`. An operator belongs
    to the phase running when it started, on whatever thread: on CUDA the backward's operators
    run on autograd's own thread, outside the main thread's phase range."""
    ranges = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.device_type == DeviceType.CPU and e.name in PHASES]
    totals = collections.defaultdict(lambda: [0.0, 0])   # (phase, operator) -> [us, calls]
    for event in events:
        if event.device_type != DeviceType.CPU or event.name in PHASES:
            continue
        phase = phase_at(ranges, event.time_range.start)
        if phase is not None:
            entry = totals[(phase, event.name)]
            entry[0] += event.self_device_time_total if device else event.self_cpu_time_total
            entry[1] += 1
    lines = []
    for phase in PHASES:
        ops = sorted(((us, calls, name) for (p, name), (us, calls) in totals.items()
                      if p == phase), reverse=True)
        total = sum(us for us, _, _ in ops)
        if not ops or total <= 0:
            continue
        lines.append(f"\n== {phase}: {total / 1e3:.1f} ms of operator self time "
                     f"({'device' if device else 'CPU'}), {sum(c for _, c, _ in ops)} calls")
        lines += [f"{name[:70]:<70} {us / 1e3:10.2f} ms {calls:7d} calls {100 * us / total:5.1f}%"
                  for us, calls, name in ops[:rows]]
    return "\n".join(lines) + "\n"


def device_memory(device: torch.device) -> Dict[str, float]:
    """On CUDA, in GiB: what the whole device holds now (`device_used`: total less free, every
    process and allocator, as NVML counts it) and what this process's torch allocator has
    reserved (`reserved`); {} elsewhere."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"device_used_gib": (total - free) / 2**30,
            "reserved_gib": torch.cuda.memory_reserved(device) / 2**30}


def host_memory() -> Dict[str, float]:
    """This process's peak resident host memory so far, in GiB (`memory/host_peak_rss_gib`):
    the memory a CPU run trains in, and on CUDA what offloading and the data hold."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss   # KiB (bytes on macOS)
    return {"memory/host_peak_rss_gib": peak * (1 if sys.platform == "darwin" else 1024) / 2**30}


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
