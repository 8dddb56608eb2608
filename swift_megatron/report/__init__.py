"""The run report: `{output_dir}/report/` with PNG plots of the logged metrics (one per group,
smoothed over the raw points), summary.md (flags, batch plan, first/last/best values, wall time)
and completions.html (a static page for reading the sampled completions); `megatron plot
--metrics` draws just the chosen metrics into report/selected.png and leaves the rest.

Written by the GRPO trainer on rank 0 at every checkpoint save and at the end of training
(`write_run_report`, which never raises: a report problem is a warning, never a failed run), and
by `megatron plot OUTPUT_DIR` (`write_report`) from logging.jsonl at any time, also for a run
that is still going or was killed. Without matplotlib (a base requirement, which an environment
may still lack) the plots are skipped with a one-line warning and the rest is written.
"""
import os
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

from swift_megatron.errors import UserError
from swift_megatron.logging import get_logger
from swift_megatron.report.completions_view import write_completions_view
from swift_megatron.report.groups import GROUPS, OTHER, grouped, matching, reward_notes
from swift_megatron.report.plots import (INSTALL_HINT, draw_group, draw_groups,
                                         matplotlib_available, plotted_keys)
from swift_megatron.report.records import metrics_path, read_metric_log
from swift_megatron.report.run_record import read_run_record, record_run
from swift_megatron.report.smoothing import DEFAULT_WEIGHT
from swift_megatron.report.summary import render

logger = get_logger(__name__)
REPORT_DIR = "report"
SUMMARY_FILE = "summary.md"
COMPLETIONS_PAGE = "completions.html"
SELECTION_FILE = "selected.png"   # megatron plot --metrics: the figure of the chosen metrics


@dataclass
class Report:
    """What write_report wrote (absolute or output_dir-relative paths, as given)."""

    directory: str
    summary: str
    plots: List[str] = field(default_factory=list)
    completions: Optional[str] = None
    notes: List[str] = field(default_factory=list)


def load_log(output_dir: str):
    path = metrics_path(output_dir)
    if not os.path.isfile(path):
        raise UserError(f"{path} not found: OUTPUT_DIR must be a training run's --output_dir "
                        f"(where logging.jsonl is written)")
    log = read_metric_log(path)
    if not log.records and log.bad_lines > _being_written(path):
        raise UserError(f"{path} is not a run's log: none of its {log.bad_lines} line(s) is a "
                        f"logged step (a JSON object with a 'step')")
    if not log.records:
        raise NoLoggedStep(f"{path} has no logged step yet")
    return log


class NoLoggedStep(UserError):
    """logging.jsonl exists but holds no step yet (a save before the first logged step)."""


def _being_written(path: str) -> int:
    """1 when the file's last line is unfinished (a run writing or killed mid-line), else 0."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return 0
        f.seek(-1, os.SEEK_END)
        return int(f.read(1) != b"\n")


def remove_stale_plots(report_dir: str, keep: Sequence[str]) -> None:
    """Delete group figures of an earlier report that this one does not draw."""
    for group in (*GROUPS, OTHER):
        path = os.path.join(report_dir, f"{group.name}.png")
        if path not in keep and os.path.isfile(path):
            os.remove(path)


def write_report(output_dir: str, metrics: Sequence[str] = (),
                 smoothing: float = DEFAULT_WEIGHT) -> Report:
    """(Re)write `{output_dir}/report/` from the run's logs; with `metrics` (fnmatch patterns),
    only the figure of the matching keys, report/selected.png, the rest left as it is.
    UserError without logged steps or matches."""
    log = load_log(output_dir)
    record = read_run_record(output_dir)
    if metrics:
        return write_selection(output_dir, log, metrics, smoothing, record)
    groups = grouped(log.keys())
    notes = reward_notes(log.keys(), record)
    report = Report(os.path.join(output_dir, REPORT_DIR), "")
    os.makedirs(report.directory, exist_ok=True)
    if log.bad_lines:
        report.notes.append(f"{log.bad_lines} unreadable line(s) of logging.jsonl skipped (a run "
                            f"killed while writing leaves a partial last line)")
    if matplotlib_available():
        report.plots = draw_groups(report.directory, log, groups, smoothing, notes)
    else:
        report.notes.append(f"No plots: matplotlib is not installed ({INSTALL_HINT}, then "
                            f"`megatron plot {output_dir}`).")
        logger.warning(f"report: matplotlib is not installed, so no plots ({INSTALL_HINT})")
    remove_stale_plots(report.directory, report.plots)
    report.completions = add_completions_view(output_dir, report)
    title = os.path.basename(os.path.abspath(output_dir))
    report.summary = os.path.join(report.directory, SUMMARY_FILE)
    with open(report.summary, "w", encoding="utf-8") as f:
        f.write(render(title, log, record, groups, [os.path.basename(p) for p in report.plots],
                       report.notes, notes))
    return report


def write_selection(output_dir: str, log, patterns: Sequence[str], smoothing: float,
                    record: Optional[dict]) -> Report:
    """report/selected.png: one panel per logged key matching `patterns` (that changed)."""
    keys = matching(log.keys(), patterns)
    where = f"--metrics {' '.join(patterns)}"
    if not keys:
        raise UserError(f"{where}: no logged metric matches (logged: {', '.join(log.keys())})")
    plotted = plotted_keys(log, keys)
    if not plotted:
        raise UserError(f"{where}: {', '.join(keys)} never changed (or were logged once): "
                        f"nothing to plot; summary.md gives their values")
    if not matplotlib_available():
        raise UserError(f"{where} draws a figure, which needs matplotlib ({INSTALL_HINT})")
    report = Report(os.path.join(output_dir, REPORT_DIR), "")
    os.makedirs(report.directory, exist_ok=True)
    path = os.path.join(report.directory, SELECTION_FILE)
    draw_group(path, log, "Selected metrics", plotted, smoothing,
               reward_notes(plotted, record))
    report.plots = [path]
    return report


def add_completions_view(output_dir: str, report: Report) -> Optional[str]:
    """Write completions.html and add a note on what it shows; its path, or None."""
    path = os.path.join(report.directory, COMPLETIONS_PAGE)
    counts = write_completions_view(output_dir, path,
                                    os.path.basename(os.path.abspath(output_dir)))
    if counts is None:
        report.notes.append("No completions view: the run logged no completions.jsonl "
                            "(--log_completions true records them).")
        return None
    shown, total = counts
    sampled = f"{shown} of {total}, sampled over every step" if shown < total else f"all {total}"
    report.notes.append(f"[{COMPLETIONS_PAGE}]({COMPLETIONS_PAGE}): {sampled} completions, "
                        f"filterable by step.")
    return path


def write_run_report(output_dir: str, args, plan, train_iters: int) -> Optional[Report]:
    """The trainer's hook (global rank 0, at every save and at the end): record the run's flags
    and batch plan in args.json, then write the report. Never raises; problems are warnings,
    but for a save before the first logged step, which the next save's report covers (None)."""
    try:
        record_run(output_dir, "megatron rlhf", args, plan, train_iters)
        report = write_report(output_dir)
    except NoLoggedStep:   # a save before the first logged step (--save_steps < --logging_steps)
        return None
    except Exception as exc:  # the report must never fail a training run
        logger.warning(f"report not written ({type(exc).__name__}: {exc}); "
                       f"`megatron plot {output_dir}` retries")
        return None
    logger.info(f"report: {report.directory} ({len(report.plots)} plots, {SUMMARY_FILE}"
                f"{', ' + COMPLETIONS_PAGE if report.completions else ''})")
    return report
