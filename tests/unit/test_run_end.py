"""The last lines of a `megatron rlhf` run (rlhf/grpo/ending.py): how long, final model, last
and best checkpoints, report; a run stopped by --exit_interval says how to continue. The lines
of a real run: tests/e2e/test_rlhf_e2e.py."""
from swift_megatron.rlhf.grpo.ending import RunEnd, closing_lines, existing


def test_a_finished_run_names_its_model_checkpoints_and_report():
    end = RunEnd(step=4, train_iters=4, seconds=725, save_dir="out", last="out/iter_0000004",
                 last_hf="out/checkpoint-4-merged", final_model="out/final_hf",
                 final_adapter="out/final_adapter", best={"step": 3, "reward": 0.123456},
                 best_path="out/checkpoint-3-merged", report="out/report/summary.md")
    assert closing_lines(end) == [
        "finished: 4 optimizer steps in 12m 05s",
        "final model (Hugging Face): out/final_hf",
        "final adapter (PEFT): out/final_adapter",
        "last checkpoint: out/iter_0000004 (Hugging Face copy: out/checkpoint-4-merged)",
        "best checkpoint: out/checkpoint-3-merged (step 3, reward/mean 0.1235)",
        "report: out/report/summary.md"]


def test_a_stopped_run_says_how_to_continue():
    end = RunEnd(step=2, train_iters=10, seconds=42.0, save_dir="ckpt", last="ckpt/iter_0000002")
    assert closing_lines(end) == [
        "stopped at step 2 of 10 after 42.0s; continue with --load ckpt",
        "last checkpoint: ckpt/iter_0000002"]


def test_existing(tmp_path):
    (tmp_path / "b").mkdir()
    assert existing(None, str(tmp_path / "a"), str(tmp_path / "b")) == str(tmp_path / "b")
    assert existing(str(tmp_path / "a")) is None
