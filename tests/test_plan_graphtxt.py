"""PipeDream graph.txt reader: real profiles, errors that name the line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.profile_files import load_profile

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


def test_reads_vgg16():
    profile = load_profile(PROFILES / "vgg16.txt")
    assert len(profile.layers) == 41 and len(profile.edge_list()) == 41
    inputs = [layer for layer in profile.layers if layer.input]
    assert [layer.name for layer in inputs] == ["node1"]
    # times are converted from milliseconds; input nodes cost nothing in the total
    assert profile.total_compute_s == pytest.approx(0.672535, rel=1e-12)
    conv = next(layer for layer in profile.layers if layer.name == "node12")
    assert conv.forward_s == pytest.approx(0.010814) and conv.backward_s == pytest.approx(0.018335)
    assert conv.activation_bytes == 411041792.0 and conv.parameter_bytes == 1180672.0


def test_reads_list_activations_and_stage_ids():
    text = ("node1 -- Input0 -- forward_compute_time=0.000, backward_compute_time=0.000, "
            "activation_size=0.0, parameter_size=0.000\n"
            "node2 -- LSTM(4, 4) -- forward_compute_time=1.5, backward_compute_time=2.5, "
            "activation_size=[10.0; 20.0], parameter_size=8.000 -- stage_id=0\n"
            "\tnode1 -- node2\n")
    profile = parse_graph_txt(text)
    assert profile.layers[1].activation_bytes == 30.0
    assert profile.layers[1].compute_s == pytest.approx(0.004)
    assert profile.edges == [("node1", "node2")]


@pytest.mark.parametrize("text,line,what", [
    ("node1 -- Linear -- forward_compute_time=1, backward_compute_time=x, activation_size=1, "
     "parameter_size=1\n", 1, "backward_compute_time is not a number"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, "
     "parameter_size=1\nnode2 -- only two parts\n", 2, "three"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, "
     "parameter_size=1\n\tnode1 -- node9\n", 2, "unknown node node9"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1\n", 1,
     "missing parameter_size"),
    ("node1 -- A -- forward_compute_time=-1, backward_compute_time=1, activation_size=1, "
     "parameter_size=1\n", 1, ">= 0"),
    ("node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, "
     "parameter_size=1\n\tnode1 -- node1 -- node1\n", 2, "exactly two"),
])
def test_malformed_profile_names_the_line(text, line, what):
    with pytest.raises(ConfigError) as info:
        parse_graph_txt(text, where="bad.txt")
    message = str(info.value)
    assert f"bad.txt: line {line}:" in message and what in message
    assert isinstance(info.value, PipetrainError)


def test_malformed_file_on_disk(tmp_path):
    path = tmp_path / "graph.txt"
    lines = (PROFILES / "alexnet.txt").read_text().splitlines()
    lines[5] = lines[5].replace("activation_size=", "activation_sise=")
    path.write_text("\n".join(lines))
    with pytest.raises(ConfigError, match=r"graph.txt: line 6: unknown field"):
        load_profile(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n\n")
    with pytest.raises(ConfigError, match="no node lines"):
        load_profile(path)
