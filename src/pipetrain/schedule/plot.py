"""Pictures of timelines: a Gantt chart per schedule, and schedules stacked for comparison.

One row per rank, one colour per action kind, microbatch numbers written in the bars they fit in
at the axis's scale (on a time axis shared with a longer timeline, fewer do), never one over
another (a pair's as ``forward|backward``); a RECV that waits is left blank (that blank is the
bubble). Matplotlib is imported only here.
"""

from __future__ import annotations

import os
from typing import Sequence

from pipetrain.schedule.ir import Kind
from pipetrain.schedule.timeline import Timeline

__all__ = ["COLOURS", "draw_timeline", "plot_timeline", "plot_comparison"]

COLOURS = {
    Kind.F: "#4C78A8",
    Kind.B: "#54A24B",
    Kind.I: "#72B7B2",
    Kind.W: "#B279A2",
    Kind.FB: "#E45756",
    Kind.STEP: "#9D755D",
    Kind.SYNC: "#F58518",
}
_LABELS = {Kind.F: "F forward", Kind.B: "B backward", Kind.I: "I input grad", Kind.W: "W weight grad",
           Kind.FB: "F+B pair", Kind.STEP: "STEP update", Kind.SYNC: "SYNC all-reduce"}
_MAX_LABELLED_BARS = 1500
_LABEL_POINTS = 6  # font size of the numbers in the bars
_DIGIT_WIDTH = 0.64  # of the font size: a digit of matplotlib's default font, with a margin


def _pyplot():
    import matplotlib  # slow to import: only when a figure is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend, which must come first

    return plt


def draw_timeline(ax, timeline: Timeline, *, title: str | None = None, labels: bool = True,
                  horizon: float | None = None) -> set:
    """Draw ``timeline`` on a matplotlib axis whose time axis spans ``horizon`` (default: the
    timeline's makespan); returns the action kinds drawn (for a legend)."""
    schedule = timeline.schedule
    makespan = timeline.makespan or 1.0
    bars = sum(1 for p in schedule.programs for a in p if a.kind in COLOURS)
    write = labels and bars <= _MAX_LABELLED_BARS
    per_point = (horizon or makespan) / _axis_points(ax)  # time units one point of the axis spans
    drawn = set()
    for rank in range(schedule.num_ranks):
        by_kind: dict[Kind, list[tuple[float, float]]] = {}
        free = float("-inf")  # where the row's last number ends
        for action, start, end in timeline.spans(rank):
            if action.kind not in COLOURS or end <= start:
                continue
            by_kind.setdefault(action.kind, []).append((start, end - start))
            if write and action.microbatch is not None:
                text = _label(action, schedule)
                if action.kind is Kind.FB:  # a pair: its forward's label, then its backward's
                    text += "|" + _label(action.peer, schedule)
                width = (_DIGIT_WIDTH * _LABEL_POINTS * len(text) + 2) * per_point
                middle = start + (end - start) / 2
                if width <= end - start and middle - width / 2 >= free:
                    ax.text(middle, rank, text, ha="center", va="center", fontsize=_LABEL_POINTS, color="white")
                    free = middle + width / 2
        for kind, spans in by_kind.items():
            ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=COLOURS[kind], edgecolor="white", linewidth=0.3)
            drawn.add(kind)
    ax.set_ylim(schedule.num_ranks - 0.5, -0.5)
    ax.set_yticks(range(schedule.num_ranks))
    ax.set_yticklabels([f"rank {r}" for r in range(schedule.num_ranks)], fontsize=7)
    ax.set_xlim(0, makespan)
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    return drawn


def _label(action, schedule) -> str:
    """The microbatch of an action, and with several chunks per rank its chunk (``3.1``)."""
    text = str(action.microbatch)
    if schedule.chunks > 1:
        text += f".{action.stage // schedule.num_ranks}"
    return text


def _axis_points(ax) -> float:
    """The width of ``ax`` in points (its figure's width times the share the axis takes)."""
    return max(ax.figure.get_figwidth() * 72 * ax.get_position().width, 1.0)


def _legend(fig, kinds: set, bottom: float = 0.0) -> None:
    """The colours' legend along the bottom of ``fig``, ``bottom`` (a fraction of its height) up."""
    from matplotlib.patches import Patch  # with matplotlib, only when drawing (see _pyplot)

    order = [k for k in COLOURS if k in kinds]
    handles = [Patch(facecolor=COLOURS[k], label=_LABELS[k]) for k in order]
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, bottom), ncol=len(handles), fontsize=8,
               frameon=False)


def _save(fig, path: str) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=130)


def plot_timeline(timeline: Timeline, path: str, *, title: str | None = None, time_unit: str = "time") -> None:
    """Write a Gantt chart of one timeline to ``path`` (PNG)."""
    plt = _pyplot()
    ranks = timeline.schedule.num_ranks
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.35 * ranks))
    kinds = draw_timeline(ax, timeline, title=title)
    ax.set_xlabel(time_unit)
    _legend(fig, kinds)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    _save(fig, path)
    plt.close(fig)


def plot_comparison(timelines: Sequence[Timeline], titles: Sequence[str], path: str, *, time_unit: str = "time",
                    caption: str | None = None) -> None:
    """Several timelines one under another on a shared time axis (the picture to choose by);
    ``caption``: lines under the legend saying how to read them."""
    plt = _pyplot()
    heights = [0.9 + 0.32 * t.schedule.num_ranks for t in timelines]
    text = 0.1 + 0.17 * (caption.count("\n") + 1) if caption else 0.0  # inches of the caption under the legend
    fig, axes = plt.subplots(
        len(timelines), 1, figsize=(12, sum(heights) + 0.8 + text), sharex=True,
        gridspec_kw={"height_ratios": heights}, squeeze=False,
    )
    strip = (0.04 * (sum(heights) + 0.8) + text) / fig.get_figheight()  # the legend's and the caption's
    fig.tight_layout(rect=(0, strip, 1, 1))  # the axes' final widths, which decide what numbers fit
    kinds: set = set()
    horizon = max(t.makespan for t in timelines)
    for ax, timeline, title in zip(axes[:, 0], timelines, titles):
        kinds |= draw_timeline(ax, timeline, title=title, horizon=horizon)
        ax.axvline(timeline.makespan, color="black", linewidth=0.8, linestyle=":")
    axes[-1, 0].set_xlim(0, horizon)
    axes[-1, 0].set_xlabel(time_unit)
    _legend(fig, kinds, bottom=text / fig.get_figheight())
    if caption:
        fig.text(0.01, 0.08 / fig.get_figheight(), caption, fontsize=8, ha="left", va="bottom")
    fig.tight_layout(rect=(0, strip, 1, 1))
    _save(fig, path)
    plt.close(fig)
