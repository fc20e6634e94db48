"""The JSON profile format: round trip and validation."""

from __future__ import annotations

import json

import pytest

from pipetrain.errors import ConfigError
from pipetrain.plan.profile import FORMAT, LayerProfile, Profile
from pipetrain.plan.profile_files import load_profile, save_profile


def sample() -> Profile:
    return Profile([LayerProfile("in", input=True),
                    LayerProfile("a", "Linear(2, 2)", 1e-3, 2e-3, 64.0, 24.0, 48.0),
                    LayerProfile("b", "ReLU()", 1e-4, 1e-4, 64.0)],
                   edges=[("in", "a"), ("a", "b")], batch_size=8, meta={"model": "toy"})


def test_round_trip(tmp_path):
    path = tmp_path / "p.json"
    save_profile(sample(), path)
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and data["version"] == 1 and data["batch_size"] == 8
    again = load_profile(path)
    assert again.layers == sample().layers and again.edges == sample().edges
    assert again.meta == {"model": "toy"}
    assert again.total_compute_s == pytest.approx(3.2e-3)


def test_chain_without_edges():
    profile = Profile([LayerProfile("x"), LayerProfile("y"), LayerProfile("z")])
    assert profile.edge_list() == [("x", "y"), ("y", "z")] and profile.is_chain()


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(format="other"), "not a pipetrain profile"),
    (lambda d: d.update(layers=[]), "non-empty list"),
    (lambda d: d["layers"][1].update(forward_s=-1), r"layers\[1\].forward_s"),
    (lambda d: d["layers"][1].update(forward_s="fast"), r"layers\[1\].forward_s"),
    (lambda d: d["layers"][1].update(speed=3), "unknown field"),
    (lambda d: d.update(edges=[["a", "zz"]]), "unknown layer 'zz'"),
    (lambda d: d["layers"].append(dict(d["layers"][1])), "appears twice"),
])
def test_invalid_json_profiles(tmp_path, mutate, match):
    data = sample().to_json()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=match):
        load_profile(path)


def test_bad_json_names_the_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{\n "format": "pipetrain-profile",\n "layers": [,]\n}')
    with pytest.raises(ConfigError, match="line 3"):
        load_profile(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read profile"):
        load_profile(tmp_path / "nope.json")
