"""Where the host's time goes in a GRPO run of ours, by phase: py-spy samples every process of a
`trl_compare.py --tool ours` run and this script reduces py-spy's raw output to a short text
table (the raw file of a few minutes is tens of MB, more than a GPU machine hands back).

Why: at one GPU our train step waits on the host (docs/gpu.md: a full step of 1.1-1.2 s holds
0.5 s of GPU work, and LoRA's extra 0.3-0.4 s per step is Python outside torch's operators, which
torch's profiler does not see), and the rollout phase moves with the host CPU (1.45 s to 2.3 s
for the same vLLM work). py-spy samples the Python stacks of every thread, idle ones included
(`--idle`), so a phase's samples are proportional to its wall time, and a phase that waits on the
GPU shows its time in the call that waits.

    python benchmarks/host_profile.py --out /tmp/hp -- --preset qwen2.5-1.5b --rollout_batches 6 \
        -- --max_tokens_per_micro_batch 8192
    python benchmarks/host_profile.py --summarize raw.txt   # only the table, from a raw file

Everything after the first `--` goes to trl_compare.py. The table (`host_profile.txt` in --out)
has, for the training worker's main thread, the samples of each phase (the trainer method it ran
under: `collect` rollout, `fill_logprobs` logprobs, `optimizer_step` train, `sync_weights`
sync) with the functions that took them (self: the innermost frame; inclusive: anywhere on the
stack), then the other threads' functions (autograd's backward thread runs custom autograd
functions' Python). py-spy is a benchmark-only dependency (requirements/benchmarks.txt); `--py_spy`
names its binary when it is not on PATH.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
from typing import Dict, Iterable, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
# the trainer methods of a rollout batch (rlhf/grpo/trainer.py `train_rollout_batch`), in the
# order they are looked for on a stack
PHASES = (("sync", "sync_weights"), ("train", "optimizer_step"), ("logprobs", "fill_logprobs"),
          ("rollout", "collect"))
TRAINER_FILE = "rlhf/grpo/trainer.py"
_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")

Stack = Tuple[Tuple[str, ...], int]


def parse_raw(lines: Iterable[str]) -> List[Stack]:
    """py-spy's raw (collapsed) format: `frame;frame;...;frame count` per line, outermost first;
    with --subprocesses and --threads the first frames name the process and the thread."""
    stacks = []
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if stack and count.isdigit():
            stacks.append((tuple(stack.split(";")), int(count)))
    return stacks


def short(frame: str) -> str:
    """`func (path/to/site-packages/pkg/mod.py:12)` -> `func (pkg/mod.py:12)`; process and
    thread frames unchanged."""
    match = _FRAME.match(frame)
    if not match or not match.group("file"):
        return frame
    path = match.group("file")
    for marker in ("site-packages/", "dist-packages/", "/swift_megatron/", "/benchmarks/"):
        if marker in path:
            path = path.split(marker, 1)[1] if marker.endswith("packages/") else \
                marker.strip("/") + "/" + path.split(marker, 1)[1]
            break
    line = match.group("line")
    return f"{match.group('func')} ({path}{':' + line if line else ''})"


def thread_of(frames: Tuple[str, ...]) -> str:
    """The innermost process frame and the thread frame that follows it (--threads): one key per
    thread of the deepest process in the stack."""
    last = max((i for i, f in enumerate(frames) if f.startswith("process ")), default=None)
    if last is None:
        return frames[0] if frames and frames[0].startswith("thread ") else "-"
    process = frames[last].split('"')[0].strip()
    thread = frames[last + 1] if last + 1 < len(frames) and frames[last + 1].startswith("thread ") \
        else ""
    return f"{process} {thread}".strip()


def runs(frames: Tuple[str, ...], method: str, file: str = TRAINER_FILE) -> bool:
    """Whether a frame of the stack is `method` of `file` (py-spy names methods `Class.method`)."""
    return any(f.split(" (", 1)[0].rsplit(".", 1)[-1] == method and file in f for f in frames)


def phase_of(frames: Tuple[str, ...]) -> str:
    """The phase of a main-thread stack of the trainer (PHASES), `other` outside them."""
    for name, method in PHASES:
        if runs(frames, method):
            return name
    return "other"


def summarize(stacks: List[Stack], top: int = 25) -> Dict:
    """{total, threads: {thread: samples}, worker, phases: {phase: {samples, self, inclusive}},
    other_threads: {thread: Counter of self frames}}: the worker is the thread whose stacks run
    the trainer's rollout batches (`train_rollout_batch`)."""
    threads = collections.Counter()
    for frames, count in stacks:
        threads[thread_of(frames)] += count
    worker_counts = collections.Counter(
        thread_of(frames) for frames, count in stacks
        if runs(frames, "train_rollout_batch"))
    worker = worker_counts.most_common(1)[0][0] if worker_counts else None
    phases: Dict[str, Dict] = {}
    others: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for frames, count in stacks:
        key = thread_of(frames)
        if key != worker:
            if threads[key] * 100 >= sum(threads.values()):   # threads with >= 1% of samples
                others[key][short(frames[-1])] += count
            continue
        phase = phases.setdefault(phase_of(frames), dict(
            samples=0, self=collections.Counter(), inclusive=collections.Counter()))
        phase["samples"] += count
        phase["self"][short(frames[-1])] += count
        for frame in set(short(f) for f in frames):
            phase["inclusive"][frame] += count
    for phase in phases.values():
        phase["self"] = phase["self"].most_common(top)
        phase["inclusive"] = phase["inclusive"].most_common(top * 2)
    return dict(total=sum(threads.values()), threads=threads.most_common(), worker=worker,
                phases=phases, other_threads={k: v.most_common(top) for k, v in others.items()})


def render(summary: Dict) -> str:
    """The summary as text: shares of each phase's samples, most first."""
    out = [f"samples: {summary['total']}; training worker: {summary['worker']}", "", "threads:"]
    out += [f"  {count:7d}  {name}" for name, count in summary["threads"]]
    order = [name for name, _ in PHASES[::-1]] + ["other"]
    for name in sorted(summary["phases"], key=order.index):
        phase = summary["phases"][name]
        n = phase["samples"]
        out += ["", f"== phase {name}: {n} samples of the worker's main thread", "  self:"]
        out += [f"  {100 * c / n:5.1f}%  {frame}" for frame, c in phase["self"]]
        out += ["  inclusive:"]
        out += [f"  {100 * c / n:5.1f}%  {frame}" for frame, c in phase["inclusive"]]
    for thread, frames in summary["other_threads"].items():
        n = sum(c for _, c in frames) or 1
        out += ["", f"== {thread} (self, of its top frames)"]
        out += [f"  {100 * c / n:5.1f}%  {frame}" for frame, c in frames]
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/host_profile")
    parser.add_argument("--rate", type=int, default=20, help="py-spy samples per second")
    parser.add_argument("--py_spy", default="py-spy", help="py-spy's binary")
    parser.add_argument("--summarize", metavar="RAW", help="only reduce this raw file")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("trl_compare_args", nargs="*")
    a = parser.parse_args()
    if a.summarize:
        with open(a.summarize) as f:
            sys.stdout.write(render(summarize(parse_raw(f), a.top)))
        return
    os.makedirs(a.out, exist_ok=True)
    raw = os.path.join(a.out, "raw.txt")
    cmd = [a.py_spy, "record", "--subprocesses", "--threads", "--idle", "--nonblocking",
           "--rate", str(a.rate), "--format", "raw", "--output", raw, "--",
           sys.executable, os.path.join(HERE, "trl_compare.py"), "--tool", "ours",
           *a.trl_compare_args]
    code = subprocess.run(cmd).returncode
    if not os.path.exists(raw):
        raise SystemExit(f"py-spy wrote no samples (exit {code})")
    with open(raw) as f:
        text = render(summarize(parse_raw(f), a.top))
    with open(os.path.join(a.out, "host_profile.txt"), "w") as f:
        f.write(text)
    os.remove(raw)   # tens of MB; the table is what comes back from a GPU machine
    sys.stdout.write(text)
    raise SystemExit(code)


if __name__ == "__main__":
    main()
