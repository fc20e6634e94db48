"""benchmarks/zero_bubble.py: its --quick run prints a row per contender with every column, torch's
schedule trains the same numbers as pipetrain's, unknown schedules are skipped; its cuts and costs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.zero_bubble import (COLUMNS, SETUPS, cut, gpt, measure_costs, placement,  # noqa: E402
                                    simulated_seconds, table)


def test_the_quick_run_prints_every_column_for_each_contender_and_torch_trains_the_same_numbers():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    done = subprocess.run(
        [sys.executable, "benchmarks/zero_bubble.py", "--quick", "--contenders", "1f1b,no-such-schedule,torch-zbv"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "note: skipping no-such-schedule: the installed pipetrain has no such schedule" in out
    assert "round 2/2:" in out and "round 3/" not in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("contender"))
    assert re.split(r"\s{2,}", lines[header].strip()) == list(COLUMNS)
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[header + 1:header + 3])}
    assert sorted(rows) == ["pipetrain 1f1b", "torch ZBVZeroBubble"]
    for cells in rows.values():
        assert len(cells) == len(COLUMNS), cells
        rate, ratio, seconds = float(cells[1]), float(cells[2]), float(cells[3])
        assert ratio > 0
        assert rate > 0 and abs(seconds - SETUPS["quick"].batch / rate) < 1e-3 + 1e-2 * seconds
        peaks = [float(v) for v in cells[6].split("/")]
        assert len(peaks) == 2 and all(p >= 0 for p in peaks)
        assert float(cells[9]) < 1e-5  # the same trained parameters as pipetrain 1f1b, within float32 rounding
    assert rows["pipetrain 1f1b"][2] == "1.00"
    assert float(rows["pipetrain 1f1b"][4]) > 0  # simulated seconds per update
    assert rows["pipetrain 1f1b"][5] == rows["pipetrain 1f1b"][4]  # no split backward: the runtime's W is not used
    assert [int(a) for a in rows["pipetrain 1f1b"][7].split("/")] == [2, 1]  # 1f1b at 2 stages: S - s held
    assert rows["torch ZBVZeroBubble"][5] == rows["torch ZBVZeroBubble"][7] == "-"  # no pipetrain prediction for torch's runtime
    moved = re.search(r"which moved up to ([0-9.e+-]+) from their initial values", out)
    assert moved and float(moved.group(1)) > 1e-4  # the parameters did train


def test_the_cuts_and_placements_are_the_same_model_for_every_contender():
    setup = SETUPS["full"]
    modules = len(gpt(setup))
    assert sum(cut(setup, 4)) == sum(cut(setup, 2)) == modules == setup.blocks + 2
    assert cut(setup, 2) == [cut(setup, 4)[0] + cut(setup, 4)[1], cut(setup, 4)[2] + cut(setup, 4)[3]]
    assert [placement("loop", r) for r in (0, 1)] == [[0, 2], [1, 3]]
    assert [placement("v", r) for r in (0, 1)] == [[0, 3], [1, 2]]


def test_costs_are_measured_per_quarter_and_simulate_each_schedule():
    setup = SETUPS["quick"]
    costs = measure_costs(setup, repeats=1)
    assert all(len(costs[k]) == 4 for k in ("F", "B", "W", "Wrt", "step", "act"))
    assert all(v > 0 for k in ("F", "B", "Wrt", "act") for v in costs[k])
    one = simulated_seconds("1f1b", setup, costs)
    # 1f1b over 2 halves: at least each microbatch's forward and backward on the slower half
    halves = [sum(costs[k][s] for k in ("F", "B", "W") for s in pair) for pair in ((0, 1), (2, 3))]
    assert one >= setup.microbatches * max(halves) * 0.999
    assert simulated_seconds("interleaved", setup, costs) > 0
    slow = dict(costs, Wrt=[10 * w + 1.0 for w in costs["W"]])  # a W far dearer in the runtime
    assert simulated_seconds("zb-h1", setup, slow, runtime_w=True) > simulated_seconds("zb-h1", setup, slow) + 1
    assert simulated_seconds("1f1b", setup, slow, runtime_w=True) == one  # no W action to charge


def test_the_table_aligns_its_columns():
    text = table([{"cells": ["pipetrain 1f1b", "1.0", "1.00", "0.1", "0.1", "0.1", "1/2", "2/1", "3/4", "0.0e+00"]}])
    header, row = text.splitlines()
    assert len(header) == len(row) and header.startswith("contender")
