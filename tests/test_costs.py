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


def test_the_communication_and_overhead_model_on_a_hand_computed_case():
    """1f1b, 2 stages, one microbatch: every action pays the overhead o = 0.1 first; a SEND keeps
    its rank busy 0.01 + 100 B x 1e-3; the message flies 0.5 + 100 B / 1000 B/s; a RECV ends 0.02 +
    100 B x 2e-3 after the message arrived."""
    from pipetrain.schedule import build, simulate

    costs = Costs(F=1, B=2, overhead=0.1, send=0.01, send_per_byte=1e-3, recv=0.02, recv_per_byte=2e-3,
                  latency=0.5, bandwidth=1000, bytes=100)
    timeline = simulate(build("1f1b", 2, 1), costs)
    spans = [[(str(a).split("@")[0], round(s, 9), round(e, 9)) for a, s, e in timeline.spans(r)] for r in range(2)]
    assert spans[0] == [("0F0", 0.1, 1.1), ("0SEND_F0>1", 1.2, 1.31), ("0RECV_B0<1", 1.41, 6.36),
                        ("0B0", 6.46, 8.46), ("0STEP", 8.56, 8.56)]
    assert spans[1] == [("1RECV_F0<0", 0.1, 2.13), ("1F0", 2.23, 3.23), ("1B0", 3.33, 5.33),
                        ("1SEND_B0>0", 5.43, 5.54), ("1STEP", 5.64, 5.64)]
    assert timeline.busy(0) == 3 and round(timeline.makespan, 9) == 8.56  # overhead and messages are not busy


def test_a_calibration_file_from_elsewhere_is_used_with_a_warning_naming_both(tmp_path):
    import json
    import warnings

    from pipetrain.schedule.costs import machine_facts

    here = machine_facts()
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"overhead": 2e-5, "latency": 1e-4, "measured_on": {**here, "torch": "1.0.0"}}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        costs = load_costs(str(path))
    assert costs.overhead == 2e-5 and costs.measured_on["torch"] == "1.0.0"
    assert len(caught) == 1 and f"torch 1.0.0; this is torch {here['torch']}" in str(caught[0].message)
    path.write_text(json.dumps({"overhead": 2e-5, "measured_on": here}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # measured here: no warning
        load_costs(str(path))
    path.write_text(json.dumps({"overhead": "fast"}))
    with pytest.raises(ScheduleError, match="overhead must be a number"):
        load_costs(str(path))
    path.write_text(json.dumps({"measured_on": "my laptop"}))
    with pytest.raises(ScheduleError, match="measured_on must be an object"):
        load_costs(str(path))


def test_with_a_quantum_a_message_leaves_when_its_sender_waits_or_the_quantum_ends():
    """gpipe, 2 stages, 2 microbatches, F=1, B=2, quantum 0.5: F0's message, sent at 1 while rank 0
    computes F1, leaves at 1.5 (the quantum); F1's, sent at 2, leaves at 2 as rank 0 enters its
    RECV; B0's, sent at 5.5 while rank 1 computes B1, at 6; B1's, sent last, at rank 1's end (7.5)."""
    from pipetrain.schedule import build, simulate

    timeline = simulate(build("gpipe", 2, 2), Costs(F=1, B=2, quantum=0.5))
    ends = {str(a).split("@")[0]: e for r in range(2) for a, _, e in timeline.spans(r)}
    assert (ends["1RECV_F0<0"], ends["1RECV_F1<0"]) == (1.5, 2.5)  # F1's arrived at 2, before rank 1 asked
    assert (ends["0RECV_B0<1"], ends["0RECV_B1<1"]) == (6.0, 8.0)
    assert timeline.makespan == 10.0
    at_once = simulate(build("gpipe", 2, 2), Costs(F=1, B=2))  # no quantum: every message leaves at once
    assert [e for _, _, e in at_once.spans(1)][0] == 1.0 and at_once.makespan == 9.0


def test_bandwidth_may_differ_per_stage_boundary():
    resolved = Costs(bandwidth=[1e3, 1e6], bytes=[2e3, 2e3]).resolve(2, 2, 1)
    assert resolved.transfer == [2.0, 0.002]


def test_a_full_backward_may_cost_other_than_its_halves():
    """An order that runs some backwards whole and splits others (dualpipev) is priced per kind: B
    actions ``full``, I actions ``B``, W actions ``W`` (measured medians of each)."""
    resolved = Costs(F=1, B=2, W=3, full=4).resolve(2, 2, 1)
    assert resolved.full_backward == [4.0, 4.0] and resolved.backward == [2.0, 2.0]
    assert Costs(F=1, B=2, W=3).resolve(2, 2, 1).full_backward == [5.0, 5.0]


def test_measured_costs_keep_a_whole_backward_apart_from_its_halves():
    from pipetrain.schedule import build, simulate
    from pipetrain.training.timelines import measured_costs

    measured = simulate(build("dualpipev", 2, 4), Costs(F=[1] * 4, B=[2] * 4, W=[3] * 4, full=[4] * 4))
    costs = measured_costs(measured)
    assert costs.W == [3.0] * 4 and costs.B == [2.0] * 4
    # a stage with whole backwards keeps their time; stage 0's run only inside pairs (measured
    # whole, with their forward), so its full backward is priced by its halves
    assert costs.full == [5.0, 4.0, 4.0, 4.0]
