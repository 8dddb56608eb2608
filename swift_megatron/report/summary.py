"""report/summary.md: the run at a glance, as Markdown.

Sections: status (steps logged, of how many, finished or not, wall time, last logged at), the
plots, the metrics not plotted (logged once or never changing: their value says it all), one
table per metric group (first / last / min / max, the best value and its step for
higher-is-better metrics, how many steps logged null; a reward of weight 0 marked "not
trained"), the flags the user gave as a command line (every flag's value in a collapsed table),
the batch plan, and notes.
"""
import datetime
import json
import os
import shlex
from typing import Dict, List, Optional, Sequence, Tuple

from swift_megatron.logging.metrics import format_value
from swift_megatron.report.groups import Group, higher_is_better
from swift_megatron.report.records import MetricLog, finite, plottable, wall_time_s


def duration(seconds: float) -> str:
    """3725.2 -> '1h 02m 05s', 65 -> '1m 05s', 4.2 -> '4.2s'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"


def fmt(value: Optional[float]) -> str:
    return "" if value is None else format_value(int(value) if value.is_integer() else value)


def status_lines(log: MetricLog, record: Optional[dict]) -> List[str]:
    first, last = log.records[0]["step"], log.records[-1]["step"]
    total = (record or {}).get("train_iters")
    line = f"{len(log.records)} logged steps, step {first} to {last}"
    if total:
        line += f" of {total}: " + ("finished" if last >= total else "stopped or still running")
    lines = [f"- {line}"]
    wall = wall_time_s(log)
    if wall is not None:
        stamp = next(r["time"] for r in reversed(log.records) if r["time"] is not None)
        when = datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")
        lines.append(f"- wall time {duration(wall)} (from the first logged step's start to the "
                     f"last logged step); last logged at {when}")
    return lines


def metric_row(log: MetricLog, key: str, note: Optional[str] = None) -> str:
    steps, values = log.series(key)
    present = finite(values)
    cells = [f"`{key}` ({note})" if note else f"`{key}`"]
    if present:
        cells += [fmt(present[0]), fmt(present[-1]), fmt(min(present)), fmt(max(present))]
    else:
        cells += [""] * 4
    if present and higher_is_better(key):
        best = max(present)
        cells.append(f"{fmt(best)} (step {steps[values.index(best)]})")
    else:
        cells.append("")
    cells.append(str(len(values) - len(present)) if len(present) < len(values) else "")
    return "| " + " | ".join(cells) + " |"


def metric_tables(log: MetricLog, groups: Sequence[Tuple[Group, List[str]]],
                  notes: Optional[Dict[str, str]] = None) -> List[str]:
    lines = ["## Metrics", ""]
    for group, keys in groups:
        if not group.in_summary:
            continue
        lines += [f"### {group.title}", "",
                  "| metric | first | last | min | max | best (step) | null |",
                  "|---|---|---|---|---|---|---|"]
        lines += [metric_row(log, key, (notes or {}).get(key)) for key in keys] + [""]
    return lines


def unplotted_line(log: MetricLog, key: str) -> str:
    """One metric without a panel, as its value: '`k`: 0 at each of the 3 logged steps (2 to
    6)', '`k`: 1.5, logged once (step 4)', '`k`: no finite value (null at 2 steps)'."""
    steps, values = log.series(key)
    at = [s for s, v in zip(steps, values) if v is not None]
    present = finite(values)
    nulls = len(values) - len(present)
    null_note = f"; null at {nulls} other step(s)" if nulls and present else ""
    if not present:
        return f"- `{key}`: no finite value (null at {nulls} step(s))"
    if len(present) == 1:
        return f"- `{key}`: {fmt(present[0])}, logged once (step {at[0]}){null_note}"
    return (f"- `{key}`: {fmt(present[0])} at each of the {len(present)} logged steps "
            f"({at[0]} to {at[-1]}){null_note}")


def unplotted_section(log: MetricLog, groups: Sequence[Tuple[Group, List[str]]]) -> List[str]:
    keys = [k for group, keys in groups if group.in_summary for k in keys
            if not plottable(log.series(k)[1])]
    if not keys:
        return []
    return ["## Not plotted", "", "Logged once or never changed, so their value says it all:",
            "", *[unplotted_line(log, key) for key in keys], ""]


def flag_words(name: str, value) -> List[str]:
    """One flag as command-line words: lists spread out, dicts as JSON, None as none."""
    if isinstance(value, list):
        items = value
    elif isinstance(value, dict):
        items = [json.dumps(value)]
    else:
        items = [{None: "none", True: "true", False: "false"}.get(value, value)
                 if isinstance(value, (bool, type(None))) else value]
    return [f"--{name}"] + [shlex.quote(str(item)) for item in items]


def table_cell(text: str) -> str:
    """Text safe inside a Markdown table cell (a pipe there is written \\|)."""
    return text.replace("|", "\\|")


def flags_section(record: Optional[dict]) -> List[str]:
    if record is None:
        return ["## Flags", "", "Not recorded: args.json is missing (the run writes it at each "
                "checkpoint save; this one has not reached its first).", ""]
    flags = record["flags"]
    command = " \\\n    ".join([record.get("command", "megatron")] +
                               [" ".join(flag_words(n, flags[n])) for n in record.get("given", [])
                                if n in flags])
    rows = [f"| `--{name}` | `{table_cell(json.dumps(value))}` |" for name, value in flags.items()]
    return ["## Flags", "", "The flags given (command line or config file):", "", "```bash",
            command, "```", "", f"<details><summary>all {len(flags)} flags</summary>", "", "| flag | value |",
            "|---|---|", *rows, "", "</details>", ""]


def plan_section(record: Optional[dict]) -> List[str]:
    plan = (record or {}).get("batch_plan")
    if not plan:
        return []
    rows = [f"| {name} | {fmt(float(value)) if isinstance(value, (int, float)) else value} |"
            for name, value in plan.items()]
    return ["## Batch plan (completions)", "", "| | |", "|---|---|", *rows, ""]


def render(title: str, log: MetricLog, record: Optional[dict],
           groups: Sequence[Tuple[Group, List[str]]], images: Sequence[str],
           notes: Sequence[str], key_notes: Optional[Dict[str, str]] = None) -> str:
    """The whole summary.md; images are file names relative to the report directory;
    key_notes: a note per metric key for its table row (groups.reward_notes)."""
    lines = [f"# Run report: {title}", "", *status_lines(log, record), ""]
    if images:
        lines += ["## Plots", ""] + [f"![{os.path.splitext(name)[0]}]({name})" for name in images]
        lines.append("")
    lines += unplotted_section(log, groups)
    lines += metric_tables(log, groups, key_notes) + flags_section(record) + plan_section(record)
    if notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in notes] + [""]
    return "\n".join(lines)
