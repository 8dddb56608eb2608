"""The report's PNG figures: one per metric group (report/groups.py), one panel per key, the raw
points faint and the smoothed curve (report/smoothing.py) on top; steps where a value was
logged as null (non-finite) are marked with a red x on the panel's floor. Only keys with two or
more distinct values get a panel (records.plottable: summary.md writes the others out as
values), and a group left without any gets no figure. A panel can carry a note (a reward of
weight 0: "not trained"), which greys it.

matplotlib comes with the package (an environment without it gets no plots and a warning):
figures are drawn with the Agg canvas directly (no pyplot, no GUI backend, safe inside the
trainer).
"""
import importlib.util
import math
import os
from typing import Dict, List, Optional, Tuple

from swift_megatron.report.groups import Group
from swift_megatron.report.records import MetricLog, plottable
from swift_megatron.report.smoothing import smooth

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


def draw_panel(ax, log: MetricLog, key: str, smoothing: float, note: Optional[str] = None) -> None:
    from matplotlib.ticker import MaxNLocator

    steps, values = log.series(key)
    points = [(s, v) for s, v in zip(steps, values) if v is not None]
    smoothed = [(s, v) for s, v in zip(steps, smooth(values, smoothing)) if v is not None]
    colour = "C7" if note else "C0"
    ax.plot(*zip(*points), color=colour, alpha=0.3, linewidth=1, marker="o", markersize=2.5,
            label="raw")
    ax.plot(*zip(*smoothed), color=colour, linewidth=1.8, label=f"smoothed {smoothing:g}")
    nulls = [s for s, v in zip(steps, values) if v is None]
    if nulls:
        ax.plot(nulls, [0.0] * len(nulls), linestyle="none", marker="x", color="red",
                transform=ax.get_xaxis_transform(), clip_on=False, label="null (non-finite)")
        ax.legend(fontsize=7, loc="best")
    # a fixed title height (matplotlib's automatic one measures every tick label first) and at
    # most 5 ticks per axis: drawing the ticks was most of a report's time (2 s -> 0.6 s for 9
    # figures on the CPU); a small panel shows no more anyway
    ax.set_title(f"{key} ({note})" if note else key, fontsize=9 if note else 10, y=1.0,
                 color="dimgray" if note else "black")
    ax.xaxis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=5))
    ax.grid(alpha=0.3)
    ax.tick_params(labelsize=8)


def draw_group(path: str, log: MetricLog, title: str, keys: List[str], smoothing: float,
               notes: Optional[Dict[str, str]] = None) -> None:
    """Write one figure of `keys` to path (PNG of figure_pixels(len(keys)))."""
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
        draw_panel(ax, log, key, smoothing, (notes or {}).get(key))
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    for ax in axes[max(len(keys) - columns, 0):len(keys)]:
        ax.set_xlabel("step", fontsize=8)
    fig.suptitle(f"{title}: raw (faint) and smoothed", fontsize=11)
    fig.savefig(path, dpi=DPI, format="png")


def plotted_keys(log: MetricLog, keys: List[str]) -> List[str]:
    """The keys that get a panel (records.plottable)."""
    return [key for key in keys if plottable(log.series(key)[1])]


def draw_groups(report_dir: str, log: MetricLog, groups: List[Tuple[Group, List[str]]],
                smoothing: float, notes: Optional[Dict[str, str]] = None) -> List[str]:
    """One PNG per group with a plottable key under report_dir; returns their paths."""
    paths = []
    for group, keys in groups:
        keys = plotted_keys(log, keys)
        if keys:
            path = os.path.join(report_dir, f"{group.name}.png")
            draw_group(path, log, group.title, keys, smoothing, notes)
            paths.append(path)
    return paths
