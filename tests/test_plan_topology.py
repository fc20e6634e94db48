"""Topologies: parsing the command-line form and its errors."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.plan.topology import DEFAULT_BANDWIDTH, Topology


def test_flat_defaults():
    topology = Topology.parse(8)
    assert topology.machines == (8,) and topology.bandwidths == (DEFAULT_BANDWIDTH,)
    assert Topology.parse(8, bandwidth="2e9").bandwidths == (2e9,)


def test_levels_innermost_first():
    topology = Topology.parse(16, "4x4", "10e9,1.25e9")
    assert topology.machines == (4, 4) and topology.bandwidths == (10e9, 1.25e9)
    assert topology.workers == 16 and topology.levels == 2
    assert Topology.parse(None, "2x3x4").workers == 24
    assert Topology.parse(24, "2x3x4", "5e9").bandwidths == (5e9,) * 3


@pytest.mark.parametrize("workers,topology,bandwidth,match", [
    (8, "4x4", None, "topology 4x4 has 16 workers"),
    (16, "4x4", "1e9,2e9,3e9", "3 bandwidths for a 2-level topology"),
    (16, "4xfour", None, "cannot read topology"),
    (16, "4x4", "fast", "cannot read bandwidth"),
    (0, None, None, "^workers must be an integer >= 1"),
    (None, None, None, "^give workers, the number of workers"),
    (4, None, "-1", "bandwidths must be positive"),
])
def test_errors(workers, topology, bandwidth, match):
    with pytest.raises(ConfigError, match=match):
        Topology.parse(workers, topology, bandwidth)
