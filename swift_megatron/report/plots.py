"""The report's PNG figures: one per metric group (report/groups.py), one panel per key, the raw
points faint and the EMA-smoothed curve (report/smoothing.py) on top; steps where a value was
logged as null (non-finite) are marked with a red x on the panel's floor.

matplotlib comes with the package (an environment without it gets no plots and a warning):
figures are drawn with the Agg canvas directly (no pyplot, no GUI backend, safe inside the
trainer).
"""
import importlib.util
import math
import os
from typing import List, Optional, Tuple

from swift_megatron.report.groups import Group
from swift_megatron.report.records import MetricLog
from swift_megatron.report.smoothing import ema

PANEL_INCHES = (4.5, 3.0)
DPI = 100
MAX_COLUMNS = 3
INSTALL_HINT = "pip install matplotlib"


def matplotlib_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def grid(panels: int) -> Tuple[int, int]:
    """(rows, columns) for a figure of `panels` panels: up to 3 a row, 4 as 2 x 2."""
    columns = 2 if panels == 4 else min(panels, MAX_COLUMNS)
    return math.ceil(panels / columns), columns


def figure_pixels(panels: int) -> Tuple[int, int]:
    """(width, height) in pixels of the PNG for a group of `panels` keys."""
    rows, columns = grid(panels)
    return round(columns * PANEL_INCHES[0] * DPI), round(rows * PANEL_INCHES[1] * DPI)


def constant(values: List[Optional[float]]) -> Optional[float]:
    """The value of a series whose finite values (two or more) are all equal, else None."""
    finite = [v for v in values if v is not None]
    return finite[0] if len(finite) > 1 and all(v == finite[0] for v in finite) else None


def draw_panel(ax, log: MetricLog, key: str, smoothing: float) -> None:
    from matplotlib.ticker import MaxNLocator

    steps, values = log.series(key)
    points = [(s, v) for s, v in zip(steps, values) if v is not None]
    smoothed = [(s, v) for s, v in zip(steps, ema(values, smoothing)) if v is not None]
    flat = constant(values)
    if flat is not None:   # a flat line says less than its value, written out
        ax.text(0.5, 0.5, f"{flat:.6g} at every one of {len(points)} steps\n(steps {points[0][0]}"
                f"-{points[-1][0]})", ha="center", va="center", transform=ax.transAxes)
        ax.set_yticks([])
    elif points:
        ax.plot(*zip(*points), color="C0", alpha=0.3, linewidth=1, marker="o", markersize=2.5,
                label="raw")
        ax.plot(*zip(*smoothed), color="C0", linewidth=1.8, label=f"EMA {smoothing:g}")
    else:
        ax.text(0.5, 0.5, "no finite value", ha="center", va="center", transform=ax.transAxes)
    nulls = [s for s, v in zip(steps, values) if v is None]
    if nulls:
        ax.plot(nulls, [0.0] * len(nulls), linestyle="none", marker="x", color="red",
                transform=ax.get_xaxis_transform(), clip_on=False, label="null (non-finite)")
        ax.legend(fontsize=7, loc="best")
    # a fixed title height (matplotlib's automatic one measures every tick label first) and at
    # most 5 ticks per axis: drawing the ticks was most of a report's time (2 s -> 0.6 s for 9
    # figures on the CPU); a small panel shows no more anyway
    ax.set_title(key, fontsize=10, y=1.0)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)


def draw_group(path: str, log: MetricLog, group: Group, keys: List[str], smoothing: float) -> None:
    """Write one group's figure to path (PNG of figure_pixels(len(keys)))."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows, columns = grid(len(keys))
    width, height = figure_pixels(len(keys))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    # fixed margins in inches (matplotlib's constrained layout took half the report's time)
    fig.subplots_adjust(left=0.75 / (width / DPI), right=1 - 0.15 / (width / DPI),
                        bottom=0.5 / (height / DPI), top=1 - 0.6 / (height / DPI),
                        wspace=0.35, hspace=0.45)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        draw_panel(ax, log, key, smoothing)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    for ax in axes[max(len(keys) - columns, 0):len(keys)]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(f"{group.title}: raw (faint) and smoothed", fontsize=11)
    fig.savefig(path, dpi=DPI, format="png")


def draw_groups(report_dir: str, log: MetricLog, groups: List[Tuple[Group, List[str]]],
                smoothing: float) -> List[str]:
    """One PNG per group under report_dir; returns their paths."""
    paths = []
    for group, keys in groups:
        path = os.path.join(report_dir, f"{group.name}.png")
        draw_group(path, log, group, keys, smoothing)
        paths.append(path)
    return paths
