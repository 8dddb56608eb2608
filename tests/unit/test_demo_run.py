"""`megatron demo`'s own logic (swift_megatron/demo/run.py) without running its commands: a second
demo into the same directory starts over, and its closing lines say what really happened
(tests/e2e/test_demo.py runs the whole demo)."""
import json
import os

import pytest

from swift_megatron.demo import run as demo


def test_outcome_says_rose_only_when_it_did():
    assert demo.outcome(0.1, 0.4) == "reward rose from 0.100 to 0.400"
    for first, last in ((0.4, 0.1), (0.2, 0.2)):
        line = demo.outcome(first, last)
        assert "rose" not in line and "did not rise" in line


@pytest.mark.parametrize("plots", [True, False])
def test_a_second_demo_starts_over_and_promises_only_what_it_drew(monkeypatch, tmp_path, capsys,
                                                                   plots):
    out = tmp_path / "grpo"
    out.mkdir()
    (out / "logging.jsonl").write_text(json.dumps({"step": 99, "reward/mean": 9.0}) + "\n")
    ran = []

    def fake_megatron(argv):
        ran.append(argv[0])
        if argv[0] == "rlhf" and "--dry_run" not in argv:   # the run appends its rows
            assert not os.path.exists(out / "logging.jsonl"), "the first demo's log is still there"
            out.mkdir(exist_ok=True)
            with open(out / "logging.jsonl", "a") as f:
                for step, reward in ((1, 0.3), (2, 0.2)):
                    f.write(json.dumps({"step": step, "reward/mean": reward,
                                        "reward/digit_ratio/mean": reward,
                                        "reward/contains_answer/mean": 0.0}) + "\n")

    monkeypatch.setattr(demo, "_megatron", fake_megatron)
    monkeypatch.setattr(demo, "matplotlib_available", lambda: plots)
    monkeypatch.setattr("swift_megatron.fixtures.build_tiny_model", lambda family, path: path)
    monkeypatch.setattr("swift_megatron.fixtures.build_math_dataset",
                        lambda path, num_rows: path)
    curve = demo.run_demo(str(tmp_path), 2)
    assert ran == ["rlhf", "export", "rlhf"] and [r["step"] for r in curve] == [1, 2]
    text = capsys.readouterr().out
    assert "reward went from 0.300 to 0.200: it did not rise" in text
    last = text.rstrip().splitlines()[-1]
    assert ("plots, summary.md" in last) == plots and ("pip install matplotlib" in last) != plots
