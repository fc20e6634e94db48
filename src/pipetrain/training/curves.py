"""Loss curves of training runs, against updates and against wall time, from their reports."""

from __future__ import annotations

import os
from typing import Any, Mapping

__all__ = ["plot_loss_curves"]


def _smooth(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_loss_curves(reports: Mapping[str, Mapping[str, Any]], path: str, title: str, *, window: int = 20) -> None:
    """Training loss (running mean of ``window`` updates) and held-out loss of each report
    (``--report-json`` content) against updates (left) and wall time (right)."""
    import matplotlib  # imported here: an optional dependency, needed only for a plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after the backend is chosen

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for label, report in reports.items():
        losses = _smooth(list(report["losses"]), window)
        times = list(report.get("update_seconds", []))
        evaluations = report.get("evaluations", [])
        steps = [e["step"] for e in evaluations]
        held_out = [e["loss"] for e in evaluations]
        (line,) = axes[0].plot(range(1, len(losses) + 1), losses, label=f"{label}: training")
        colour = line.get_color()
        if steps:
            axes[0].plot(steps, held_out, "o--", color=colour, label=f"{label}: held-out")
        if len(times) >= len(losses):
            axes[1].plot(times[: len(losses)], losses, color=colour, label=f"{label}: training")
            if steps:
                axes[1].plot([times[s - 1] for s in steps], held_out, "o--", color=colour, label=f"{label}: held-out")
    axes[0].set_xlabel("updates")
    axes[1].set_xlabel("wall time (s, evaluation pauses left out)")
    for ax in axes:
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
