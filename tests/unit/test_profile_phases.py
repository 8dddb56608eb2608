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
