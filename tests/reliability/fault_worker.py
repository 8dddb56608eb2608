"""`megatron COMMAND ARGV` with one fault of the disk or the process injected, for
tests/reliability/test_faults.py (run as a torchrun worker script, so the tests' warm process
forks it: tests/distributed/warm.py). Usage: fault_worker.py FAULT COMMAND ARGV...

  kill_in_hf_copy:N      kill -9 itself while the HF copy of save N (checkpoint-N) is staged:
                         its weights written, before it is renamed into place
  fsize_after_save:B     after the first save, limit the files this process writes to B bytes
                         (ulimit -f: the next save's first larger file fails)
  fsize:B                the same limit from the start
"""
import os
import resource
import signal
import sys


def _limit_files(size: int) -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _kill_in_hf_copy(step: int) -> None:
    from swift_megatron.bridge import hf_checkpoint

    copy = hf_checkpoint.copy_model_files

    def copy_then_die(source_dir, out_dir):
        if os.path.basename(out_dir).startswith(f"checkpoint-{step}.tmp-"):
            os.kill(os.getpid(), signal.SIGKILL)
        copy(source_dir, out_dir)

    hf_checkpoint.copy_model_files = copy_then_die


def _limit_after_save(size: int) -> None:
    from swift_megatron.rlhf.grpo.trainer import GRPOTrainer

    save = GRPOTrainer.save

    def save_then_limit(self, metrics):
        save(self, metrics)
        _limit_files(size)

    GRPOTrainer.save = save_then_limit


def main() -> None:
    fault, value = sys.argv[1].split(":")
    {"kill_in_hf_copy": _kill_in_hf_copy, "fsize_after_save": _limit_after_save,
     "fsize": _limit_files}[fault](int(value))
    from swift_megatron.cli import main as cli

    sys.argv = [cli.__file__, *sys.argv[2:]]
    cli.main()


if __name__ == "__main__":
    main()
