"""Costs: parsing the command-line and file forms, and expanding them per stage."""

import json

import pytest

from pipetrain.errors import ScheduleError
from pipetrain.schedule import Costs, load_costs, parse_costs


def test_parse_costs_pairs():
    costs = parse_costs("F=1,B=2.5,W=0.5,latency=0.1,bandwidth=1e9,bytes=4e6,step=0.2,sync=0.3,send=0.01")
    assert (costs.F, costs.B, costs.W, costs.latency, costs.bandwidth) == (1, 2.5, 0.5, 0.1, 1e9)
    assert (costs.bytes, costs.step, costs.sync, costs.send) == (4e6, 0.2, 0.3, 0.01)
    assert parse_costs("") == Costs()


@pytest.mark.parametrize("text, hint", [("F", "NAME=NUMBER"), ("Q=1", "NAME=NUMBER"), ("F=x", "must be a number"),
                                         ("B=-1", "non-negative")])
def test_malformed_costs_explain(text, hint):
    with pytest.raises(ScheduleError, match=hint):
        parse_costs(text)


def test_costs_file(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"F": [1, 1, 2, 1], "B": [2, 2, 4, 2]}))
    resolved = load_costs(str(path)).resolve(4, 4, 1)
    assert resolved.forward == [1, 1, 2, 1]
    assert resolved.full_backward == [2, 2, 4, 2]


@pytest.mark.parametrize("content, hint", [("{", "not valid JSON"), ("[1]", "JSON object"),
                                           ('{"X": 1}', "unknown key"), ('{"F": "a"}', "number")])
def test_bad_costs_file(tmp_path, content, hint):
    path = tmp_path / "costs.json"
    path.write_text(content)
    with pytest.raises(ScheduleError, match=hint):
        load_costs(str(path))
    with pytest.raises(ScheduleError, match="cannot read"):
        load_costs(str(tmp_path / "missing.json"))


def test_per_stage_list_length_is_checked():
    with pytest.raises(ScheduleError, match="has 3 entries"):
        Costs(F=[1, 2, 3]).resolve(4, 4, 1)


def test_interleaved_costs_per_rank_are_shared_by_chunks():
    resolved = Costs(F=[2, 4], B=4).resolve(4, 2, 2)  # 2 ranks x 2 chunks
    assert resolved.forward == [1, 2, 1, 2]
    assert resolved.backward == [2, 2, 2, 2]
    assert Costs(F=[1, 2, 3, 4]).resolve(4, 2, 2).forward == [1, 2, 3, 4]


def test_transfer_time():
    resolved = Costs(latency=0.5, bandwidth=1e6, bytes=[2e6, 0]).resolve(2, 2, 1)
    assert resolved.transfer == [2.5, 0.5]
