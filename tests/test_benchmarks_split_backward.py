"""benchmarks/split_backward.py: its --quick run times the three backwards on every quarter stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_quick_run_prints_a_row_of_ratios_per_quarter_stage():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    done = subprocess.run([sys.executable, "benchmarks/split_backward.py", "--quick", "--rounds", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]  # the new path split every stage (it asserts so)
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("stage"))
    rows = [line.split() for line in lines[header + 1:]]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    assert all(len(row) == 8 and all(float(cell) > 0 for cell in row[1:]) for row in rows)
