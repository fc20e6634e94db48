"""Plan pictures are written (matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path

from pipetrain.plan.baselines import baseline
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.plot import plot_plan

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


def test_plot_writes_png(tmp_path):
    profile = parse_graph_txt((PROFILES / "alexnet.txt").read_text())
    plan = optimize(profile, 4)
    path = tmp_path / "plan.png"
    plot_plan(plan, profile, path, [baseline("time", profile, 4)])
    assert path.read_bytes()[:4] == b"\x89PNG" and path.stat().st_size > 5000
