"""Checks of benchmarks/async_goals.py: its ceilings time the real stages, its ratios and trace
shares are what the table says."""

import json
import pathlib
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # the workers import the script's functions as `benchmarks.async_goals`

from benchmarks import async_goals  # noqa: E402

TINY = async_goals.Config(width=8, batch=8, microbatches=2, steps=1, warmup=0, hidden=4)


def test_the_m2_configurations_keep_their_parents_microbatch():
    for name, config in async_goals.CONFIGS_M2.items():
        parent = async_goals.CONFIGS[name.removesuffix("-m2")]
        assert config.microbatches == 2 and config.microbatch == parent.microbatch and config.width == parent.width


def test_ratios_are_taken_against_the_best_torch_schedule_and_the_ceilings():
    rates = {"sequential": 100.0, "torch-gpipe": 150.0, "torch-1f1b": 120.0, "pipetrain-1f1b": 135.0,
             "pipetrain-pipedream": 180.0, "ceiling-1f1b": 150.0, "ceiling-pipedream": 200.0,
             "ceiling-1f1b-pair": 140.0, "ceiling-pipedream-pair": 190.0}
    r = async_goals.ratios(rates)
    assert r["1f1b/torch"] == pytest.approx(0.9) and r["pd/torch"] == pytest.approx(1.2)
    assert r["1f1b/ceiling"] == pytest.approx(0.9) and r["pd/ceiling"] == pytest.approx(0.9)
    assert r["pd/1f1b"] == pytest.approx(180 / 135) and r["1f1b/ceiling-pair"] == pytest.approx(135 / 140)
    assert "2bw/1f1b" not in r  # only when 2bw ran (--with-2bw)
    r = async_goals.ratios({**rates, "pipetrain-2bw": 162.0})
    assert r["2bw/1f1b"] == pytest.approx(1.2) and r["2bw/torch"] == pytest.approx(162 / 150)


def test_trace_shares_split_each_ranks_span(tmp_path):
    # rank 0: ten periods of F (2 us), RECV_B (1 us), 1 us idle; the first fifth is dropped
    events = []
    for k in range(10):
        events.append({"ph": "X", "pid": 0, "tid": 0, "name": f"0F{k}", "ts": 4 * k, "dur": 2})
        events.append({"ph": "X", "pid": 0, "tid": 0, "name": "0RECV_B", "ts": 4 * k + 2, "dur": 1})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    shares = async_goals.trace_shares(path)[0]
    assert shares["F"][1:] == (2, 8) and shares["RECV_B"][1:] == (1, 8)
    span = 4 * 9 + 3 - 8  # from the first kept action to the end of the last
    assert shares["F"][0] == pytest.approx(16 / span) and shares["RECV_B"][0] == pytest.approx(8 / span)
    assert shares["(between actions)"][0] == pytest.approx(1 - 24 / span)


def test_both_ceilings_come_from_the_real_stages():
    rates = async_goals.ceiling_rates(TINY)
    assert set(rates) == {"ceiling-1f1b", "ceiling-pipedream", "ceiling-1f1b-pair", "ceiling-pipedream-pair"}
    assert all(value > 0 for value in rates.values())
