"""Planner effort: progress past a few seconds, refusals past the limits with the size that fits."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.errors import PipetrainError
from pipetrain.plan import effort
from pipetrain.plan.effort import LIMIT_BYTES, LIMIT_SECONDS, Effort
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.optimizer import optimize

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"
VGG = PROFILES / "vgg16.txt"


def within(e: Effort) -> bool:
    return e.seconds <= LIMIT_SECONDS and e.bytes <= LIMIT_BYTES


@pytest.mark.parametrize("machines,per_machine,width", [
    (10_000_000, 40, 41),          # table bytes decide
    (50_000, 2_000_000, 241),      # time decides
    (64, 500_000, 57_600),         # an inner level
])
def test_largest_is_the_largest_size_within_the_limits(machines, per_machine, width):
    big = Effort(machines, machines * per_machine, width, "x")
    largest = big.largest()
    assert within(Effort(largest, largest * per_machine, width, "x"))
    assert not within(Effort(largest + 1, (largest + 1) * per_machine, width, "x"))


def test_refusal_names_the_largest_size_and_the_cli_prints_one_line(capsys):
    profile = parse_graph_txt(VGG.read_text(), where="vgg16")
    with pytest.raises(PipetrainError) as info:
        optimize(profile, 10_000_000)
    message = str(info.value)
    largest = int(re.search(r"at most ([\d,]+) machines", message).group(1).replace(",", ""))
    assert 0 < largest < 10_000_000
    assert "10,000,000 workers" in message and "use fewer workers there (workers / topology)" in message
    assert info.value.options == ("workers", "topology")
    code = main(["plan", str(VGG), "--workers", "10000000", "--no-baselines"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and f"at most {largest:,} machines" in err
    assert "use fewer workers there (--workers / --topology)" in err


def test_a_long_table_shows_progress_a_short_one_does_not(capsys, monkeypatch):
    profile = parse_graph_txt(VGG.read_text(), where="vgg16")
    optimize(profile, 16, progress=True)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(effort, "NOTE_SECONDS", 0.0)
    optimize(profile, 16, progress=False)
    assert capsys.readouterr().err == ""
    optimize(profile, 16, progress=True)                  # not a terminal: one line
    assert re.fullmatch(r"planning 16 workers: 16 machine counts, about \d+ s\n",
                        capsys.readouterr().err)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    optimize(profile, 16, progress=True)                  # a terminal: a tqdm bar
    assert "planning 16 workers" in capsys.readouterr().err
