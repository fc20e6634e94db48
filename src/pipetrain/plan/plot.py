"""A picture of a plan: stages along the layer axis, with predicted times and replicas."""

from __future__ import annotations

from pathlib import Path

from pipetrain.plan.profile import Profile
from pipetrain.plan.result import Plan

__all__ = ["plot_plan"]


def plot_plan(plan: Plan, profile: Profile, path: str | Path,
              baselines: list[Plan] | None = None) -> None:
    """Draw per-layer compute (bars) and each stage's predicted time (spans) into ``path``."""
    import matplotlib  # slow to import: only when a figure is drawn

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # after choosing the backend, which must come first

    layers = {layer.name: layer for layer in profile.layers}
    order = [name for stage in plan.stages for name in stage.layers]
    index = {name: i for i, name in enumerate(order)}
    rows = 1 + len(baselines or [])
    fig, axes = plt.subplots(rows, 1, figsize=(max(8.0, min(24.0, len(order) * 0.08 + 6)),
                                               2.6 * rows + 0.6), sharex=True, squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for ax, shown in zip(axes[:, 0], [plan] + list(baselines or [])):
        compute = [layers[name].compute_s * 1e3 for name in order]
        ax.bar(range(len(order)), compute, width=1.0, color="0.8", label="layer compute (ms)")
        for s, stage in enumerate(shown.stages):
            spots = [index[name] for name in stage.layers if name in index]
            if not spots:
                continue
            lo, hi = min(spots) - 0.5, max(spots) + 0.5
            height = max(stage.time_s, stage.input_transfer_s) * 1e3
            ax.fill_between([lo, hi], 0, height, color=colors[s % len(colors)], alpha=0.45,
                            step="pre")
            ax.hlines(height, lo, hi, color=colors[s % len(colors)], linewidth=2)
            ax.text((lo + hi) / 2, height, f"{s}: x{stage.replicas}\n{height:.3g} ms",
                    ha="center", va="bottom", fontsize=7)
        slowest = shown.predicted_time_per_minibatch * 1e3
        ax.axhline(slowest, color="black", linestyle=":", linewidth=1)
        ax.set_ylabel("ms per minibatch")
        ax.set_title(f"{shown.method}: {len(shown.stages)} stages, replicas "
                     f"{'-'.join(map(str, shown.replicas))}, slowest {slowest:.4g} ms",
                     fontsize=9)
    axes[-1, 0].set_xlabel("layer (topological order)")
    axes[0, 0].legend(loc="upper right", fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
