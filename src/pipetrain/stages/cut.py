"""Cutting a traced graph into stage modules that hand on every value a later stage needs.

Stage ``s`` runs the positioned nodes of its range in their original order. The values that cross
boundary ``s | s+1`` are those computed in stages ``0..s`` (or model inputs) that some stage after
``s`` uses; stage ``s`` returns them (a tensor, or a tuple of them in execution order) and stage
``s+1`` takes them as its positional inputs. A value used two stages later is therefore returned
unchanged by the stage in between (*pass-through*): a skip connection from stage 0 to stage 2
is an extra output of stage 0, an extra input and output of stage 1 and an input of stage 2, and
gradients come back along the same path by autograd. Example, ``out = f2(f1(f0(x)) + x)``
cut before ``f1`` and before ``f2``::

    stage 0 (x)          -> (f0(x), x)
    stage 1 (f0_out, x)  -> add = f1(f0_out) + x     (x is used here; nothing later needs it)
    stage 2 (add)        -> f2(add)

Parameter reads and shape arithmetic are recomputed where needed (see :mod:`.nodes`), so what
crosses is tensors; a stage checks that and names the value if it is not (a tuple returned by one
operation and unpacked in the next stage, for example).
"""

from __future__ import annotations

import bisect
import operator
from typing import Any, Sequence

import torch
from torch import fx, nn

from pipetrain.errors import ConfigError
from pipetrain.stages.nodes import is_compute, is_recomputable, module_paths

__all__ = ["assign_stages", "check_boundary", "cut_graph"]


def check_boundary(values: tuple[Any, ...], names: tuple[str, ...], where: tuple[str, ...], stage: int) -> Any:
    """Return what stage ``stage`` hands on (``values[0]`` alone, else the tuple) if all are tensors."""
    for value, name, origin in zip(values, names, where):
        if not isinstance(value, (torch.Tensor, fx.Proxy)):  # (fx re-traces stages it unpickles)
            raise ConfigError(
                f"stage {stage} hands {name!r} ({origin}) on to stage {stage + 1}, but it is a "
                f"{type(value).__name__}, not a tensor: only tensors cross stage boundaries. Move "
                f"the split point so that {name!r} is made and used in the same stage"
            )
    return values[0] if len(values) == 1 else values


def _roots(node: fx.Node) -> list[fx.Node]:
    """Positioned nodes ``node`` reads, directly or through recomputable nodes."""
    found: list[fx.Node] = []
    seen: set[fx.Node] = set()
    todo = list(node.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if is_recomputable(n):
            todo.extend(n.all_input_nodes)
        else:
            found.append(n)
    return found


def assign_stages(nodes: Sequence[fx.Node], starts: Sequence[int]) -> dict[fx.Node, int]:
    """Stage of each positioned node: by position, placeholders to 0, the output to the last.

    ``operator.getitem`` with an integer index runs in the stage of what it indexes, so that the
    parts of a tuple (the outputs of ``split``, ``chunk``, a multi-output module) cross a
    boundary, not the tuple. (Slicing, ``h[..., :3]``, stays where it is.)
    """
    last = len(starts)
    stage: dict[fx.Node, int] = {}
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            stage[node] = 0
        elif node.op == "output":
            stage[node] = last
        else:
            stage[node] = bisect.bisect_right(starts, i)
            source = node.args[0] if node.args else None
            if (
                node.op == "call_function"
                and node.target is operator.getitem
                and isinstance(source, fx.Node)
                and not is_recomputable(source)
                and isinstance(node.args[1], int)
            ):
                stage[node] = max(stage[r] for r in _roots(node))
    return stage


def _describe(node: fx.Node) -> str:
    paths = module_paths(node)
    target = getattr(node.target, "__name__", str(node.target))
    return f"{node.op} {target}" + (f" in {paths[-1]!r}" if paths else " in the model's forward")


def _fix_buffers_and_modes(stage: fx.GraphModule, model: nn.Module) -> None:
    """Keep non-persistent buffers non-persistent and copy ``training`` to the new containers."""
    for node in stage.graph.nodes:
        if node.op != "get_attr":
            continue
        path, _, field = str(node.target).rpartition(".")
        original = model.get_submodule(path) if path else model
        copy = stage.get_submodule(path) if path else stage
        if copy is original or field not in copy._buffers:
            continue
        if field in original._non_persistent_buffers_set or field not in original._buffers:
            copy._non_persistent_buffers_set.add(field)
    for name, module in stage.named_modules():
        original = model.get_submodule(name) if name else model
        if module is not original:
            module.training = original.training


def cut_graph(
    traced: fx.GraphModule, model: nn.Module, starts: Sequence[int]
) -> tuple[list[fx.GraphModule], list[list[str]]]:
    """Stage modules for the cut of ``traced`` at ``starts`` (indices of positioned nodes).

    Returns the stages (GraphModules that hold ``model``'s own submodules and parameters under
    their original qualified names) and, per boundary, the names of the values that cross it.
    """
    graph = traced.graph
    nodes = [n for n in graph.nodes if not is_recomputable(n)]
    count = len(starts) + 1
    stage = assign_stages(nodes, starts)
    position = {n: i for i, n in enumerate(nodes)}
    needs: list[dict[fx.Node, None]] = [{} for _ in range(count)]
    for node in nodes:
        for root in _roots(node):
            if stage[root] < stage[node]:
                needs[stage[node]][root] = None
    crossing: list[list[fx.Node]] = []
    for b in range(count - 1):
        values = {v for t in range(b + 1, count) for v in needs[t] if stage[v] <= b}
        crossing.append(sorted(values, key=position.__getitem__))
    for s in range(count):
        if not any(is_compute(n) and stage[n] == s for n in nodes):
            raise ConfigError(f"stage {s} would do no work: choose split points further apart")
    for b, values in enumerate(crossing):
        if not values:
            raise ConfigError(
                f"stage {b + 1} uses nothing that stages 0..{b} compute, so it cannot follow them in "
                f"a pipeline; choose other split points"
            )
    placeholders = [n for n in nodes if n.op == "placeholder"]
    output = next(n for n in nodes if n.op == "output")
    stages: list[fx.GraphModule] = []
    for s in range(count):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}

        def value(n: fx.Node, g: fx.Graph = g, env: dict[fx.Node, fx.Node] = env) -> fx.Node:
            if n not in env:
                if not is_recomputable(n):
                    raise AssertionError(f"{n.name} is not available in this stage")
                env[n] = g.node_copy(n, value)
            return env[n]

        if s == 0:
            for ph in placeholders:
                env[ph] = g.node_copy(ph)
        else:
            for v in crossing[s - 1]:
                env[v] = g.placeholder(v.name)
        for node in nodes:
            if stage[node] == s and node.op not in ("placeholder", "output"):
                env[node] = g.node_copy(node, value)
        if s < count - 1:
            outs = tuple(value(v) for v in crossing[s])
            names = tuple(v.name for v in crossing[s])
            where = tuple("an input of the model" if v.op == "placeholder" else _describe(v) for v in crossing[s])
            g.output(g.call_function(check_boundary, (outs, names, where, s)))
        else:
            g.output(fx.map_arg(output.args[0], value))
        g.lint()
        module = fx.GraphModule(model, g, f"Stage{s}")
        _fix_buffers_and_modes(module, model)
        stages.append(module)
    return stages, [[v.name for v in values] for values in crossing]
