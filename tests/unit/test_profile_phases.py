"""training/profile.py's per-phase tables: every operator is counted in the phase range it ran
in (nested ranges and ops included), with its calls and self time; ops outside any phase are
left out."""
import torch

from swift_megatron.training.profile import phase_tables


def test_operators_are_counted_in_their_phase():
    a = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("train"):
            for _ in range(3):
                a @ a
            with torch.profiler.record_function("inner"):   # a nested range stays in train
                torch.relu(a)
        with torch.profiler.record_function("sync"):
            a + 1
        a - 1                                                 # outside every phase
    text = phase_tables(prof.events(), device=False)
    sections = {block.split(":")[0]: block for block in text.split("\n== ")[1:]}
    assert set(sections) == {"train", "sync"}
    train = {line.split()[0]: line.split() for line in sections["train"].splitlines()[1:]}
    assert train["aten::mm"][3] == "3" and "aten::relu" in train
    assert "aten::add" in sections["sync"] and "aten::mm" not in sections["sync"]
    assert "aten::sub" not in text
    shares = [float(row[-1].rstrip("%")) for row in train.values()]
    assert abs(sum(shares) - 100) < 1


def test_operators_of_another_thread_count_by_time():
    """On CUDA the backward's operators run on autograd's thread, with no parent in the main
    thread's phase range: they belong to the phase running when they started."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(name, start, end, self_us, device_type=DeviceType.CPU):
        return SimpleNamespace(name=name, device_type=device_type, cpu_parent=None,
                               time_range=SimpleNamespace(start=start, end=end),
                               self_cpu_time_total=self_us, self_device_time_total=2 * self_us)

    events = [event("train", 0, 100, 1), event("sync", 100, 120, 1),
              event("MmBackward0", 10, 40, 30), event("aten::mm", 11, 39, 28),
              event("aten::add", 105, 106, 1), event("aten::sub", 130, 131, 1),
              event("kernel", 12, 38, 20, device_type=DeviceType.CUDA)]
    text = phase_tables(events, device=True)
    sections = {block.split(":")[0]: block for block in text.split("\n== ")[1:]}
    train = {line.split()[0]: line.split() for line in sections["train"].splitlines()[1:]}
    assert set(train) == {"MmBackward0", "aten::mm"}                 # not the CUDA event
    assert (train["aten::mm"][1], train["aten::mm"][3]) == ("0.06", "1")   # device time, ms
    assert "aten::add" in sections["sync"] and "aten::sub" not in text
