"""Progress bars and log lines (logging/progress.py, logging/logger.py): into a file or a pipe
no bar is drawn (no carriage returns, no cursor-movement escape codes); on a terminal a log line
written while a bar is drawn starts a line of its own, never the bar's line (issue 57)."""
import io
import logging

from swift_megatron.logging import logger as logger_module
from swift_megatron.logging.progress import bars_shown, progress


class Terminal(io.StringIO):
    def isatty(self):
        return True


def run_with_logging(monkeypatch, stream):
    """Iterate a bar of 3 over `stream` (as standard output), logging a line at each step;
    what `stream` received."""
    monkeypatch.delenv("SWIFT_MEGATRON_NO_BAR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr("sys.stdout", stream)
    log = logging.getLogger("swift_megatron.test_progress")
    handler = logger_module._BarSafeHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    try:
        with progress(range(3), desc="GRPO", mininterval=0) as bar:
            for step in bar:
                log.warning(f"step {step} | loss=0.5")
        log.warning("report: out/report")
    finally:
        log.removeHandler(handler)
    return stream.getvalue()


def test_a_file_gets_log_lines_only(monkeypatch):
    written = run_with_logging(monkeypatch, io.StringIO())
    assert written == ("WARNING step 0 | loss=0.5\nWARNING step 1 | loss=0.5\n"
                       "WARNING step 2 | loss=0.5\nWARNING report: out/report\n")


def test_on_a_terminal_log_lines_never_share_the_bars_line(monkeypatch):
    written = run_with_logging(monkeypatch, Terminal())
    assert "GRPO:" in written   # the bar is drawn
    lines = written.split("\n")
    logged = [line for line in lines if "WARNING" in line]
    assert len(logged) == 4
    for line in logged:   # what a terminal shows of the line: after its last carriage return
        assert line.split("\r")[-1].startswith("WARNING "), repr(line)
        assert "GRPO:" not in line.split("\r")[-1]
    # the bar is closed (leave=False: erased) before the last line
    assert "GRPO:" not in written.split("WARNING report")[-1]


def test_bars_only_on_rank_0_of_a_terminal(monkeypatch):
    monkeypatch.delenv("SWIFT_MEGATRON_NO_BAR", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert bars_shown(Terminal()) and not bars_shown(io.StringIO())
    monkeypatch.setenv("RANK", "1")
    assert not bars_shown(Terminal())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("SWIFT_MEGATRON_NO_BAR", "1")
    assert not bars_shown(Terminal())
