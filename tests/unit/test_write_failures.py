"""What a failed write leaves and says (paths.py), and who may write into a run directory
(checkpoint/run_dir.py). The real full disks, file size limits and kills are in
tests/reliability/test_faults.py; here each rule on its own: the cause found in the errors
torch, megatron and safetensors raise, the partial directory removed, other errors untouched,
the lock of a live run refused and a dead run's ignored, a run directory taken only to resume it."""
import errno
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from swift_megatron.checkpoint.run_dir import LOCK_FILE, RunLock, check_run_dir, claim_run_dir
from swift_megatron.errors import UserError, WriteFailed
from swift_megatron.paths import removed_if_failed, sweep_dir


def staged(tmp_path):
    staging = tmp_path / "out.tmp-1"
    staging.mkdir()
    (staging / "part.bin").write_bytes(b"x" * 10)
    return staging


def fail_with(tmp_path, error):
    staging = staged(tmp_path)
    with pytest.raises(BaseException) as raised:
        with removed_if_failed(str(staging), str(tmp_path / "out"), "KEPT"):
            raise error
    assert not staging.exists()
    return raised.value


def checkpoint_exception(inner):
    """torch's CheckpointException of one rank's error, as megatron's writer raises it."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise inner
    except type(inner) as exc:
        return CheckpointException("write", {0: _wrap_exception(exc)})


@pytest.mark.parametrize("error, cause", [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (PermissionError(errno.EACCES, "Permission denied"), "permission denied"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system"),
    (RuntimeError("Error while serializing: I/O error: File too large (os error 27)"),
     "file too large"),   # safetensors' SafetensorError text
    (RuntimeError("Worker failure: [Errno 28] No space left on device"),
     "no space left on device"),
])
def test_a_disk_failure_becomes_one_error_naming_target_cause_and_what_was_kept(
        tmp_path, error, cause):
    for raised in (error, checkpoint_exception(error)):   # bare, or inside torch's wrapper
        failure = fail_with(tmp_path, raised)
        assert isinstance(failure, WriteFailed) and failure.exit_code == 2
        assert str(failure).startswith(f"could not write {tmp_path / 'out'}: {cause} (")
        assert str(failure).endswith(f"Removed the partial {tmp_path / 'out.tmp-1'}; KEPT")


def test_a_failure_without_a_named_cause_asks_the_disk(tmp_path, monkeypatch):
    """torch's writer says `unexpected pos 704 vs 598` on a full disk: nearly no free space
    then makes it a full disk; with space left it stays the error it was."""
    unnamed = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert fail_with(tmp_path, unnamed) is unnamed
    real = os.statvfs(tmp_path)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=3, f_frsize=real.f_frsize, f_files=real.f_files, f_favail=real.f_favail))
    failure = fail_with(tmp_path, unnamed)
    assert f"no space left on device ({3 * real.f_frsize} bytes free) (RuntimeError: [enforce " \
           "fail at inline_container.cc:672] . unexpected pos 704 vs 598)" in str(failure)


def test_other_errors_pass_through(tmp_path):
    """A bug, a user's mistake or Ctrl-C: the partial directory is removed, the error kept."""
    for error in (ValueError("a bug"), UserError("a mistake"), KeyboardInterrupt()):
        assert fail_with(tmp_path, error) is error


def test_a_run_directory_is_swept_of_what_dead_processes_staged(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    names = [f"iter_0000002.tmp-{dead}", f"checkpoint-2.tmp-{dead}", f"final_hf.tmp-{os.getppid()}",
             "checkpoint-1", "notes.tmp-x"]
    for name in names:
        (tmp_path / name).mkdir()
    assert sorted(os.path.basename(p) for p in sweep_dir(str(tmp_path))) == sorted(names[:2])
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])


def test_a_live_run_holds_its_directory_until_it_ends(tmp_path):
    first = RunLock()
    first.take(str(tmp_path), "--output_dir")
    for attempt in (lambda: RunLock().take(str(tmp_path), "--save"),
                    lambda: check_run_dir(str(tmp_path), "--save", [None])):
        with pytest.raises(UserError, match=f"--save {tmp_path} is in use by a run that is "
                                            f"still going \\(pid {os.getpid()} on .*\\): wait "
                                            "for it to end, or pass another --save"):
            attempt()
    first.release()
    check_run_dir(str(tmp_path), "--save", [None])
    RunLock().take(str(tmp_path), "--save")


def test_the_lock_of_a_killed_run_blocks_nothing(tmp_path):
    """kill -9 leaves the lock file; the kernel dropped its lock with the process."""
    script = ("import fcntl, os, signal, sys; f = open(sys.argv[1], 'a'); "
              "fcntl.flock(f, fcntl.LOCK_EX); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / LOCK_FILE)])
    assert proc.returncode == -9 and (tmp_path / LOCK_FILE).exists()
    check_run_dir(str(tmp_path), "--output_dir", [None])
    claim_run_dir(RunLock(), str(tmp_path), "--output_dir", [None])


def test_a_directory_holding_a_run_is_taken_only_to_resume_it(tmp_path):
    """ms-swift's workflow: `--load DIR` (or --mcore_model DIR --finetune false) into DIR
    resumes; anything else would mix two runs' logs and checkpoints."""
    run, other = tmp_path / "run", tmp_path / "other"
    (run / "iter_0000002").mkdir(parents=True)
    (run / "logging.jsonl").write_text("{}\n")
    (other / "iter_0000001").mkdir(parents=True)
    for resume in (None, str(other / "iter_0000001")):
        with pytest.raises(UserError, match="holds another run"):
            check_run_dir(str(run), "--output_dir", [resume])
        with pytest.raises(UserError, match="holds another run"):
            claim_run_dir(RunLock(), str(run), "--output_dir", [resume])
    check_run_dir(str(run), "--output_dir", [str(run / "iter_0000002")])
    claim_run_dir(RunLock(), str(run), "--output_dir", [str(run / "iter_0000002")])
    stopped = tmp_path / "stopped"   # a run that stopped before its first step: a rerun may
    stopped.mkdir()                  # go there (its args.json is replaced, its log was empty)
    (stopped / "args.json").write_text("{}")
    (stopped / "logging.jsonl").write_text("")
    check_run_dir(str(stopped), "--output_dir", [None])
