"""Tests of pipetrain.pb.methods: method names of the PB study."""

from __future__ import annotations

import pytest

from pipetrain.errors import ConfigError
from pipetrain.optim.compensation import DEFAULT_DLR_DELAY, DEFAULT_DTS_DELAY
from pipetrain.pb.methods import DEFAULT_METHODS, Method, parse_method, parse_methods


@pytest.mark.parametrize(
    "text, pipelined, batch, sc, lwp, compensation",
    [
        ("sgd", False, False, 0, 0, "none"),
        ("sgd-batch", False, True, 0, 0, "none"),
        ("pb", True, False, 0, 0, "none"),
        ("pb+sc", True, False, 1, 0, "sc"),
        ("pb+lwp", True, False, 0, 1, "lwp"),
        ("PB+SC+LWP", True, False, 1, 1, "sc+lwp"),
        ("pb+sc0.5+lwp0.5", True, False, 0.5, 0.5, "sc+lwp"),
        ("pb+lwp2", True, False, 0, 2, "lwp"),
        ("pb+lwp.25+sc", True, False, 1, 0.25, "sc+lwp"),
        ("pb+sc0.5+lwp+dlr16", True, False, 0.5, 1, "sc+lwp+dlr16"),
        ("pb+dlr", True, False, 0, 0, f"dlr{DEFAULT_DLR_DELAY:g}"),
        ("pb+lwp+dlr4.5", True, False, 0, 1, "lwp+dlr4.5"),
        ("pb+sc+lwp+dts8", True, False, 1, 1, "sc+lwp+dts8"),
        ("pb+dts", True, False, 0, 0, f"dts{DEFAULT_DTS_DELAY:g}"),
        ("pb+sc+lwp+dtsf4", True, False, 1, 1, "sc+lwp+dtsf4"),
        ("pb+dtsf", True, False, 0, 0, f"dtsf{DEFAULT_DTS_DELAY:g}"),
        ("pb+sc+lwp+dtt4", True, False, 1, 1, "sc+lwp+dtt4"),
        ("pb+dtt", True, False, 0, 0, f"dtt{DEFAULT_DTS_DELAY:g}"),
    ],
)
def test_parse(text, pipelined, batch, sc, lwp, compensation):
    method = parse_method(text)
    assert (method.pipelined, method.batch, method.sc, method.lwp) == (pipelined, batch, sc, lwp)
    assert method.compensation == compensation
    assert method.compensated == (sc > 0 or lwp > 0)
    assert parse_method(str(method)) == method


@pytest.mark.parametrize(
    "text, message",
    [
        ("adam", "unknown method"),
        ("pb+foo", "is not sc, lwp"),
        ("pb+sc+sc0.5", "names sc twice"),
        ("pb+sc0", "must be > 0"),
        ("pb+dlr0", "reference delay must be > 0"),
        ("pb+dlr+dlr8", "names dlr twice"),
        ("pb+dts0", "reference delay must be > 0"),
        ("pb+sc+dlr8+dts8", "names both dlr and dts"),
        ("pb+dtsf0", "reference delay must be > 0"),
        ("pb+dts4+dtsf4", "names both dts and dtsf"),
        ("pb+dtsf4+dtsf8", "names dtsf twice"),
        ("pb+dtt0", "reference delay must be > 0"),
        ("pb+dts4+dtt4", "names both dts and dtt"),
    ],
)
def test_errors(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_method(text)


def test_lists_and_defaults():
    assert [m.name for m in parse_methods("sgd, pb,pb,pb+sc")] == ["sgd", "pb", "pb+sc"]
    assert all(isinstance(parse_method(m), Method) for m in DEFAULT_METHODS)
    with pytest.raises(ConfigError, match="empty"):
        parse_methods(" , ")


def test_dlr_is_not_scaled_by_delay_scale():
    # --delay-scale sweeps SC and LWP; DLR alone has nothing it scales
    assert not parse_method("pb+dlr8").compensated and parse_method("pb+dlr8").dlr == 8


def test_dts_is_not_scaled_by_delay_scale():
    method = parse_method("pb+dts4")
    assert not method.compensated and (method.dts, method.dlr) == (4, 0)


def test_dtsf_is_not_scaled_by_delay_scale():
    method = parse_method("pb+sc+lwp+dtsf4")
    assert method.compensated and (method.dtsf, method.dts, method.dlr) == (4, 0, 0)
