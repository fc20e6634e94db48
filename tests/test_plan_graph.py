"""Cut states of a layer graph (PipeDream's antichain DAG)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from pipetrain.errors import ConfigError
from pipetrain.plan.graph import build_cuts
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.profile import LayerProfile, Profile

PROFILES = Path(__file__).parent / "data" / "pipedream-profiles"


def layer(name, act=1.0, **kw):
    return LayerProfile(name=name, forward_s=0.001, activation_bytes=act, **kw)


def test_chain_states_are_prefixes():
    profile = Profile([layer("a", 10), layer("b", 20), layer("c", 30)])
    cuts = build_cuts(profile)
    assert cuts.chain and cuts.num_states == 4
    assert cuts.output.tolist() == [0, 10, 20, 30]
    assert cuts.stage_layers(1, 3) == ["b", "c"]
    assert cuts.ancestors[0, 3] and cuts.ancestors[1, 2] and not cuts.ancestors[2, 1]
    assert cuts.compute[-1] == pytest.approx(0.003)


def test_chain_in_file_order_differs_from_path_order():
    profile = Profile([layer("c"), layer("a"), layer("b")], edges=[("a", "b"), ("b", "c")])
    cuts = build_cuts(profile)
    assert cuts.chain and cuts.nodes == ["a", "b", "c"]


def diamond():
    # s -> b, s -> c, b -> d, c -> d
    return Profile([layer("s", 1), layer("b", 2), layer("c", 4), layer("d", 8)],
                   edges=[("s", "b"), ("s", "c"), ("b", "d"), ("c", "d")])


def test_diamond_states_are_all_ideals_with_the_source():
    cuts = build_cuts(diamond())
    assert not cuts.chain
    sets = {frozenset(n for n, inside in zip(cuts.nodes, row) if inside) for row in cuts.members}
    expected = {frozenset(), frozenset("s"), frozenset("sb"), frozenset("sc"), frozenset("sbc"),
                frozenset("sbcd")}
    assert sets == expected and cuts.num_states == 6
    # ancestors = proper subsets
    for k, j in itertools.product(range(6), repeat=2):
        sub = cuts.members[k] <= cuts.members[j]
        assert cuts.ancestors[k, j] == (bool(sub.all()) and k != j)


def test_diamond_cut_bytes_follow_pipedream_augmented_antichain():
    cuts = build_cuts(diamond())
    out = {frozenset(n for n, inside in zip(cuts.nodes, row) if inside): value
           for row, value in zip(cuts.members, cuts.output)}
    assert out[frozenset("s")] == 1
    # {s, b}: b is the antichain; s also feeds c outside, so s's output crosses too
    assert out[frozenset("sb")] == 1 + 2
    # {s, b, c}: antichain {b, c}; PipeDream also counts s (it feeds c, outside b's ancestors)
    assert out[frozenset("sbc")] == 1 + 2 + 4
    assert np.allclose(cuts.output_of(cuts.members), cuts.output)


def test_inputs_and_getitem_tails_are_taken_out():
    profile = Profile([LayerProfile("in", input=True), layer("a"), layer("b"),
                       LayerProfile("t", kind="__getitem__(0)")],
                      edges=[("in", "a"), ("a", "b"), ("b", "t")])
    cuts = build_cuts(profile)
    assert cuts.nodes == ["a", "b"] and cuts.inputs == ["in"] and cuts.tails == {"t": ["b"]}


@pytest.mark.parametrize("name,states", [("alexnet", 22), ("vgg16", 40), ("resnet18", 100),
                                         ("resnet50", 240), ("gnmt", 99), ("gnmt_large", 1495)])
def test_state_counts_match_reference(name, states):
    cuts = build_cuts(parse_graph_txt((PROFILES / f"{name}.txt").read_text()))
    assert cuts.num_states - 1 == states   # the reference does not count the empty cut


def test_cycle_and_disconnected_graphs_are_rejected():
    with pytest.raises(ConfigError, match="cycle"):
        build_cuts(Profile([layer("a"), layer("b")], edges=[("a", "b"), ("b", "a")]))
    with pytest.raises(ConfigError, match="not connected"):
        build_cuts(Profile([layer("a"), layer("b"), layer("c")], edges=[("a", "b")]))
    with pytest.raises(ConfigError, match="input layer 'x' has incoming edges"):
        build_cuts(Profile([layer("a"), LayerProfile("x", input=True)], edges=[("a", "x")]))
