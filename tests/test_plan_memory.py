"""Memory per worker and schedule: the docs/design.md 3.2/3.3 table."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.plan.stage_memory import (check_schedule, in_flight, parse_bytes, stage_memory,
                                   weight_versions)


def test_pipedream_straight_pipeline_depths():
    # straight 4-stage pipeline: W = (3, 2, 1, 0), so W + 1 = (4, 3, 2, 1) versions and minibatches
    from_here = [4, 3, 2, 1]
    assert list(weight_versions("pipedream", from_here, 1)) == [4, 3, 2, 1]
    assert list(in_flight("pipedream", from_here, 1)) == [4, 3, 2, 1]


def test_pipedream_replicated_depth_matches_warmup_formula():
    # N = 16, replicas 13-2-1: W_s = floor((N - 1 - sum_{i<s} r_i) / r_s) -> (1, 1, 0)
    replicas, before = [13, 2, 1], [0, 13, 15]
    for r, b in zip(replicas, before):
        w = (16 - 1 - b) // r
        assert int(in_flight("pipedream", 16 - b, r)) == w + 1


def test_other_schedules():
    assert int(weight_versions("2bw", 4, 1)) == 2
    assert int(in_flight("2bw", 4, 1, microbatches=8)) == 4
    assert int(in_flight("1f1b", 4, 1, microbatches=2)) == 2
    assert int(in_flight("gpipe", 4, 1, microbatches=8)) == 8
    # gpipe holds all microbatches of a minibatch: the whole minibatch's activations
    assert float(stage_memory("gpipe", parameter_bytes=10, optimizer_bytes=20,
                              activation_bytes=80, workers_from_here=4, replicas=1,
                              microbatches=8)) == 10 + 20 + 80
    assert float(stage_memory("pipedream", parameter_bytes=10, optimizer_bytes=20,
                              activation_bytes=80, workers_from_here=4, replicas=1)) == \
        4 * 10 + 20 + 4 * 80
    assert float(stage_memory("1f1b", parameter_bytes=10, optimizer_bytes=20,
                              activation_bytes=80, workers_from_here=2, replicas=1,
                              microbatches=8)) == 10 + 20 + 2 * 10


def test_parse_bytes():
    assert parse_bytes("16GB") == 16e9
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("1.5e9") == 1.5e9
    assert parse_bytes("500 MB") == 500e6
    for bad in ("lots", "-3GB", "12XB", "0"):
        with pytest.raises(ConfigError):
            parse_bytes(bad)


def test_schedule_names():
    assert check_schedule("flush") == "1f1b"
    with pytest.raises(ConfigError, match="unknown schedule"):
        check_schedule("wavy")
