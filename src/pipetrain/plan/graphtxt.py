"""Reader for PipeDream's ``graph.txt`` layer profiles.

One line per node, then one tab-indented line per edge::

    node4 -- Conv2d(3, 64, ...) -- forward_compute_time=4.2, backward_compute_time=7.1, \
        activation_size=822083584.0, parameter_size=7168.0      (one line in the file)
    \tnode1 -- node4

Times are milliseconds per minibatch (converted to seconds here), sizes are bytes. An activation
size may be a list ``[a; b]`` (several outputs), which counts as their sum. A trailing
``-- stage_id=K`` (a partitioned graph) is accepted and ignored. Nodes whose description starts
with ``Input`` are the data source: they become input layers, whose costs the planner ignores.
"""

from __future__ import annotations

from pipetrain.errors import ConfigError
from pipetrain.plan.profile import LayerProfile, Profile

__all__ = ["parse_graph_txt"]

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")


def _bad(where: str, lineno: int, line: str, why: str) -> ConfigError:
    shown = line if len(line) <= 100 else line[:97] + "..."
    return ConfigError(f"{where}: line {lineno}: {why}: {shown!r}; expected "
                       "'nodeID -- description -- forward_compute_time=MS, "
                       "backward_compute_time=MS, activation_size=BYTES, parameter_size=BYTES' "
                       "or a tab-indented edge 'nodeA -- nodeB'")


def _number(text: str) -> float:
    text = text.strip()
    if text.startswith("["):
        if not text.endswith("]"):
            raise ValueError(text)
        return sum(float(part) for part in text[1:-1].split(";") if part.strip())
    return float(text)


def _parse_node(line: str, where: str, lineno: int) -> LayerProfile:
    tokens = line.strip().split(" -- ")
    if tokens and tokens[-1].startswith("stage_id="):
        tokens = tokens[:-1]
    if len(tokens) < 3:
        raise _bad(where, lineno, line, "a node line needs three ' -- '-separated parts")
    node_id, desc, metadata = tokens[0].strip(), " -- ".join(tokens[1:-1]), tokens[-1]
    if not node_id or " " in node_id:
        raise _bad(where, lineno, line, f"bad node id {node_id!r}")
    values: dict[str, float] = {}
    for part in metadata.split(", "):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _FIELDS:
            raise _bad(where, lineno, line, f"unknown field {part.strip()!r}")
        try:
            number = _number(value)
        except ValueError:
            raise _bad(where, lineno, line, f"{key} is not a number") from None
        if not number >= 0 or number == float("inf"):
            raise _bad(where, lineno, line, f"{key} must be a finite number >= 0")
        values[key] = number
    missing = [key for key in _FIELDS if key not in values]
    if missing:
        raise _bad(where, lineno, line, f"missing {', '.join(missing)}")
    return LayerProfile(
        name=node_id, kind=desc,
        forward_s=values["forward_compute_time"] / 1000.0,
        backward_s=values["backward_compute_time"] / 1000.0,
        activation_bytes=values["activation_size"],
        parameter_bytes=values["parameter_size"],
        input=desc.startswith("Input"))


def parse_graph_txt(text: str, where: str = "graph.txt") -> Profile:
    """Parse the text of a PipeDream ``graph.txt`` file into a :class:`Profile`."""
    layers: list[LayerProfile] = []
    edges: list[tuple[str, str]] = []
    edge_lines: list[tuple[int, str, str, str]] = []
    names: set[str] = set()
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if line.startswith("\t") or line.startswith(" "):
            parts = line.strip().split(" -- ")
            if len(parts) != 2 or not all(p.strip() for p in parts):
                raise _bad(where, lineno, line, "an edge line needs exactly two node ids")
            edge_lines.append((lineno, line, parts[0].strip(), parts[1].strip()))
            continue
        layer = _parse_node(line, where, lineno)
        if layer.name in names:
            raise _bad(where, lineno, line, f"node {layer.name} is defined twice")
        names.add(layer.name)
        layers.append(layer)
    if not layers:
        raise ConfigError(f"{where}: no node lines found; is this a PipeDream graph.txt profile?")
    for lineno, line, a, b in edge_lines:
        for end in (a, b):
            if end not in names:
                raise _bad(where, lineno, line, f"edge names unknown node {end}")
        edges.append((a, b))
    return Profile(layers=layers, edges=edges, batch_size=None,
                   meta={"source": "pipedream-graph.txt", "time_unit_in_file": "ms"})
