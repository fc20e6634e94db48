"""Layer profiles: what the planner knows about a model, and their JSON file format.

A profile is a list of layers (leaf modules, or split units) with measured costs for one minibatch,
plus the edges between them. Edges make skip connections visible; a profile without edges is a
chain in layer order. The JSON form (``"format": "pipetrain-profile"``)::

    {
      "format": "pipetrain-profile", "version": 1,
      "batch_size": 32,                 # samples per minibatch the times were measured at
      "layers": [
        {"name": "0", "kind": "Linear(in_features=64, out_features=128, bias=True)",
         "forward_s": 1.2e-4, "backward_s": 2.5e-4,     # seconds per minibatch
         "activation_bytes": 16384,                      # output activation, batch included
         "parameter_bytes": 33280, "optimizer_bytes": 33280,
         "input": false},                                # true: the data source, costs nothing
        ...
      ],
      "edges": [["0", "1"], ...],       # optional; absent means a chain in layer order
      "meta": {...}                     # free-form: model, device, iterations, ...
    }

:func:`pipetrain.plan.profile_files.load_profile` reads this form and PipeDream's ``graph.txt``
profiles (:mod:`pipetrain.plan.graphtxt`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pipetrain.errors import ConfigError

__all__ = ["LayerProfile", "Profile", "FORMAT"]

FORMAT = "pipetrain-profile"
_VERSION = 1


@dataclass
class LayerProfile:
    """Costs of one layer for one minibatch (seconds and bytes)."""

    name: str
    kind: str = ""
    forward_s: float = 0.0
    backward_s: float = 0.0
    activation_bytes: float = 0.0
    parameter_bytes: float = 0.0
    optimizer_bytes: float = 0.0
    input: bool = False

    @property
    def compute_s(self) -> float:
        """Forward plus backward time."""
        return self.forward_s + self.backward_s


@dataclass
class Profile:
    """Layers and the edges between them (``None``: a chain in layer order)."""

    layers: list[LayerProfile]
    edges: list[tuple[str, str]] | None = None
    batch_size: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ConfigError("a profile needs at least one layer")
        names = [layer.name for layer in self.layers]
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ConfigError(f"profile layer name {name!r} appears twice; names must be "
                                  "unique")
            seen.add(name)
        if self.edges is not None:
            for a, b in self.edges:
                for end in (a, b):
                    if end not in seen:
                        raise ConfigError(
                            f"profile edge {a!r} -> {b!r} names unknown layer {end!r}")

    def edge_list(self) -> list[tuple[str, str]]:
        """The edges, or the chain's edges when the profile has none."""
        if self.edges is not None:
            return list(self.edges)
        names = [layer.name for layer in self.layers]
        return list(zip(names, names[1:]))

    def is_chain(self) -> bool:
        """True if every layer feeds exactly the next one in layer order."""
        names = [layer.name for layer in self.layers]
        return sorted(self.edge_list()) == sorted(zip(names, names[1:]))

    @property
    def total_compute_s(self) -> float:
        """Forward plus backward time of every non-input layer (one worker, no communication)."""
        return sum(layer.compute_s for layer in self.layers if not layer.input)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": FORMAT, "version": _VERSION,
                               "batch_size": self.batch_size,
                               "layers": [asdict(layer) for layer in self.layers]}
        if self.edges is not None:
            out["edges"] = [list(edge) for edge in self.edges]
        out["meta"] = dict(self.meta)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "profile") -> "Profile":
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"{where}: not a pipetrain profile (expected a JSON object with "
                              f"\"format\": \"{FORMAT}\"); PipeDream graph.txt files are read too")
        raw_layers = data.get("layers")
        if not isinstance(raw_layers, list) or not raw_layers:
            raise ConfigError(f"{where}: \"layers\" must be a non-empty list")
        layers = []
        numeric = ("forward_s", "backward_s", "activation_bytes", "parameter_bytes",
                   "optimizer_bytes")
        for index, raw in enumerate(raw_layers):
            if not isinstance(raw, dict) or "name" not in raw:
                raise ConfigError(f"{where}: layers[{index}] must be an object with a \"name\"")
            unknown = set(raw) - set(numeric) - {"name", "kind", "input"}
            if unknown:
                raise ConfigError(f"{where}: layers[{index}] has unknown field(s) "
                                  f"{sorted(unknown)}; known: name, kind, input, "
                                  f"{', '.join(numeric)}")
            values = {}
            for key in numeric:
                value = raw.get(key, 0.0)
                if (not isinstance(value, (int, float)) or isinstance(value, bool)
                        or not math.isfinite(value) or value < 0):
                    raise ConfigError(f"{where}: layers[{index}].{key} = {value!r}; "
                                      "it must be a finite number >= 0")
                values[key] = float(value)
            layers.append(LayerProfile(name=str(raw["name"]), kind=str(raw.get("kind", "")),
                                       input=bool(raw.get("input", False)), **values))
        edges = data.get("edges")
        if edges is not None:
            if not isinstance(edges, list) or not all(
                    isinstance(e, (list, tuple)) and len(e) == 2 for e in edges):
                raise ConfigError(f"{where}: \"edges\" must be a list of [from, to] pairs")
            edges = [(str(a), str(b)) for a, b in edges]
        batch = data.get("batch_size")
        return cls(layers=layers, edges=edges, batch_size=batch,
                   meta=dict(data.get("meta") or {}))
