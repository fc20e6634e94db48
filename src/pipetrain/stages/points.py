"""Where stages start in a traced model: at named modules, from a plan, or balanced by cost.

A **split point** is a module's qualified name (``layer2``, ``blocks.3``, ``blocks.3.attn``); the
stage it starts begins with that module's first operation in execution order. Everything the
model runs from there up to the next split point belongs to that stage, including operations of
the parent module between its children (``x + self.block(x)``'s addition belongs to the stage
that runs it).

A **plan** names the modules of every stage, either as a list per stage or as a mapping::

    [["wte", "wpe", "blocks.0"], ["blocks.1", "blocks.2"], ["blocks.3", "ln_f", "head"]]
    {"wte": 0, "wpe": 0, "blocks.0": 0, "blocks.1": 1, "blocks.2": 1, "blocks.3": 2, "head": 2}
    "wte,wpe,blocks.0|blocks.1,blocks.2|blocks.3,ln_f,head"        (text: '|' between stages)

The earliest module of each stage after the first is its split point; every named module must lie
wholly inside its stage (checked). Modules a plan does not name go where execution order puts them.

**Automatic** splits cut at the start of *pipeline units*: the model's top-level children, with
containers (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``, ``nn.Transformer`` into its
encoder and decoder, and the layer stacks of ``nn.TransformerEncoder``/``Decoder``) opened into their
elements and,
while there are fewer units than stages, the unit with the most parameters opened into its
children. The cut minimises the largest stage's cost, where cost is the parameter count or the
per-node/per-module costs the caller measured (see :func:`cost_weights`).
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Mapping, Sequence, Union

import torch
from torch import fx, nn

from pipetrain.errors import ConfigError, option
from pipetrain.stages.nodes import ModulePositions, is_compute, is_recomputable
from pipetrain.stages.partition import partition_min_max

__all__ = [
    "Plan",
    "cost_weights",
    "cost_units",
    "largest_block",
    "normalize_plan",
    "open_unit",
    "parameter_weights",
    "pipeline_units",
    "resolve_module",
    "starts_by_weight",
    "starts_from_plan",
    "starts_from_split_at",
]

#: A plan: module names per stage, a module -> stage mapping, or its text / JSON-file form.
Plan = Union[Sequence[Sequence[str]], Mapping[str, int], str]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict, nn.Transformer, nn.TransformerEncoder,
               nn.TransformerDecoder)


def _module_list_hint(model: nn.Module, positions: ModulePositions, name: str) -> str:
    names = [n for n in positions.first if n and positions.enclosing_leaf(n) is None]
    close = difflib.get_close_matches(name, names, n=5, cutoff=0.5)
    top = [n for n, _ in model.named_children() if n in positions.first]
    parts = []
    if close:
        parts.append(f"did you mean {' or '.join(map(repr, close))}?")
    shown = ", ".join(top[:12]) + (" ..." if len(top) > 12 else "")
    parts.append(f"top-level modules: {shown}")
    return "; ".join(parts)


def why_whole(model: nn.Module, name: str) -> str:
    """Why module ``name`` runs as one operation (a leaf of the trace), in words."""
    module = model.get_submodule(name)
    kind = type(module).__name__
    if type(module).__module__.startswith("torch.nn") and not isinstance(module, _CONTAINERS):
        return f"a torch.nn layer ({kind})"
    return f"a leaf module ({kind}, made one by {option('leaf_modules')})"


def resolve_module(model: nn.Module, name: str, positions: ModulePositions, what: str = "split point") -> str:
    """The canonical qualified name of module ``name``, checked to be a place a stage can start."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{what} {name!r}: give a module's qualified name, e.g. 'layer2' or 'blocks.3'")
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ConfigError(
            f"{what} {name!r}: the model has no module of that name; "
            + _module_list_hint(model, positions, name)
        ) from None
    canonical = next((n for n, m in model.named_modules() if m is module), name)
    leaf = positions.enclosing_leaf(canonical)
    if leaf is not None:
        raise ConfigError(
            f"{what} {name!r} lies inside {leaf!r}, which runs as one operation: it is "
            f"{why_whole(model, leaf)}; split at {leaf!r} or at a module outside it"
        )
    if canonical not in positions.first:
        raise ConfigError(
            f"{what} {name!r} does no work in the model's forward (it is never called, or only "
            f"reads parameters); " + _module_list_hint(model, positions, name)
        )
    return canonical


def _first_compute(nodes: Sequence[fx.Node]) -> int:
    return next((i for i, n in enumerate(nodes) if is_compute(n)), len(nodes))


def starts_from_split_at(
    model: nn.Module, nodes: Sequence[fx.Node], positions: ModulePositions, names: Sequence[str]
) -> tuple[list[int], list[str]]:
    """Positions (indices into ``nodes``) where stages 1.. start, and the canonical names."""
    names = list(names)
    canonical = [resolve_module(model, n, positions) for n in names]
    starts = [positions.first[n] for n in canonical]
    for (a, sa), (b, sb) in zip(zip(names, starts), zip(names[1:], starts[1:])):
        if sb == sa:
            raise ConfigError(
                f"split points {a!r} and {b!r} start at the same operation, so the stage between "
                f"them would be empty; drop one of them"
            )
        if sb < sa:
            order = sorted(names, key=lambda n: positions.first[resolve_module(model, n, positions)])
            raise ConfigError(
                f"split points must follow the order in which the model runs them: {b!r} runs "
                f"before {a!r}; write them as {','.join(order)}"
            )
    first_module = min(positions.first.values(), default=_first_compute(nodes))
    if starts and starts[0] <= max(first_module, _first_compute(nodes)):
        raise ConfigError(
            f"split point {names[0]!r} is the first module the model runs, so stage 0 would be "
            f"empty; name the modules that start stages 1, 2, ... (not stage 0)"
        )
    return starts, canonical


def normalize_plan(plan: Plan) -> list[list[str]]:
    """A plan as module names per stage (see the module docstring for the accepted forms)."""
    if isinstance(plan, str):
        text = plan.strip()
        if os.path.isfile(text):
            with open(text, encoding="utf-8") as handle:
                text = handle.read().strip()
        if text.startswith(("[", "{")):
            try:
                plan = json.loads(text)
            except json.JSONDecodeError as error:
                raise ConfigError(f"plan is not valid JSON: {error}") from error
            if isinstance(plan, dict) and "stages" in plan:
                plan = plan["stages"]
        else:
            plan = [[n.strip() for n in part.split(",") if n.strip()] for part in text.split("|")]
    if isinstance(plan, Mapping):
        numbers = sorted(set(plan.values()))
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers) or numbers != list(
            range(len(numbers))
        ):
            raise ConfigError(
                f"a plan mapping gives each module its stage number 0, 1, ..., S-1 with every stage "
                f"used; got stage numbers {numbers}"
            )
        stages: list[list[str]] = [[] for _ in numbers]
        for name, stage in plan.items():
            stages[stage].append(name)
        return stages
    if isinstance(plan, Sequence) and all(isinstance(s, (list, tuple)) for s in plan):
        stages = [list(s) for s in plan]
        for k, names in enumerate(stages):
            if not names:
                raise ConfigError(f"plan stage {k} names no module: every stage needs at least one")
            if not all(isinstance(n, str) for n in names):
                raise ConfigError(f"plan stage {k}: module names must be strings, got {names!r}")
        if not stages:
            raise ConfigError("the plan is empty: give the module names of every stage")
        return stages
    raise ConfigError(
        "a plan is a list of module-name lists (one per stage), a mapping module -> stage, text "
        "'a,b|c,d' or a JSON file of either; got " + type(plan).__name__
    )


def starts_from_plan(
    model: nn.Module, nodes: Sequence[fx.Node], positions: ModulePositions, plan: Plan
) -> tuple[list[int], list[str]]:
    """Stage starts and split points of ``plan``, after checking each module lies in its stage."""
    stages = normalize_plan(plan)
    resolved = [[resolve_module(model, n, positions, what="plan module") for n in names] for names in stages]
    split_at = [min(names, key=lambda n: positions.first[n]) for names in resolved[1:]]
    starts, split_at = starts_from_split_at(model, nodes, positions, split_at)
    bounds = [0, *starts, len(nodes)]
    for k, names in enumerate(resolved):
        for name in names:
            lo, hi = positions.first[name], positions.last[name]
            if not (bounds[k] <= lo and hi < bounds[k + 1]):
                where = [s for s in range(len(stages)) if bounds[s] <= lo < bounds[s + 1]][0]
                raise ConfigError(
                    f"the plan puts {name!r} in stage {k}, but with the stages starting at "
                    f"{', '.join(split_at) or '(none)'} it runs in stage {where}"
                    + (" and beyond" if hi >= bounds[where + 1] else "")
                    + "; list the modules of each stage in the order the model runs them"
                )
    return starts, split_at


def _fetch(model: nn.Module, target: str) -> object:
    value: object = model
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _roots(node: fx.Node) -> list[fx.Node]:
    """Recomputable nodes reached from ``node``'s inputs (get_attr and shape values)."""
    seen: list[fx.Node] = []
    todo = [n for n in node.all_input_nodes if is_recomputable(n)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.append(n)
        todo.extend(i for i in n.all_input_nodes if is_recomputable(i))
    return seen


def parameter_weights(model: nn.Module, nodes: Sequence[fx.Node]) -> list[int]:
    """Parameter elements first used by each node (a parameter counts once, at its first use)."""
    seen: set[int] = set()
    weights = [0] * len(nodes)
    for i, node in enumerate(nodes):
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            params += list(model.get_submodule(str(node.target)).parameters())
        for root in _roots(node):
            if root.op == "get_attr":
                value = _fetch(model, str(root.target))
                if isinstance(value, nn.Parameter):
                    params.append(value)
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                weights[i] += p.numel()
    return weights


def cost_weights(
    model: nn.Module, nodes: Sequence[fx.Node], positions: ModulePositions, costs: Mapping[str, float]
) -> list[float]:
    """Per-node costs from ``costs``, keyed by fx node name or by module qualified name.

    A module's cost is put on its first operation. Keys must not overlap (``blocks.0`` together
    with ``blocks.0.attn`` would count the attention twice).
    """
    index = {n.name: i for i, n in enumerate(nodes)}
    weights = [0.0] * len(nodes)
    modules: list[str] = []
    for key, value in costs.items():
        try:
            cost = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"cost of {key!r} must be a number, got {value!r}") from None
        if not cost >= 0:
            raise ConfigError(f"cost of {key!r} must be a non-negative number, got {value!r}")
        if key in index:
            weights[index[key]] += cost
            continue
        name = resolve_module(model, key, positions, what="cost key")
        modules.append(name)
        weights[positions.first[name]] += cost
    for a in modules:
        for b in modules:
            if b.startswith(a + "."):
                raise ConfigError(f"costs of {a!r} and {b!r} overlap ({b!r} is inside {a!r}); give one of them")
    return weights


def open_unit(model: nn.Module, positions: ModulePositions, name: str) -> list[str]:
    """The units inside module ``name`` (its children that do work, containers opened); ``[]`` for
    a module that runs as one operation."""
    out: list[str] = []
    for child in positions.children(model, name):
        if isinstance(model.get_submodule(child), _CONTAINERS) and positions.children(model, child):
            out += open_unit(model, positions, child)
        else:
            out.append(child)
    return out


def pipeline_units(model: nn.Module, positions: ModulePositions, at_least: int = 1) -> list[str]:
    """The modules at whose start an automatic split into ``at_least`` stages may cut, in execution
    order: the top-level units; the largest opened while there are fewer than ``at_least``; then
    each unit holding more than ``1/at_least`` of the parameters opened, as long as that lowers the
    largest stage's parameter count (a stage cannot be balanced around such a unit)."""
    units = open_unit(model, positions, "")
    size = lambda n: sum(p.numel() for p in model.get_submodule(n).parameters())  # noqa: E731
    sizes = {n: size(n) for n in units}
    while len(units) < at_least:
        openable = [u for u in units if positions.children(model, u)]
        if not openable:
            break
        widest = max(openable, key=lambda u: sizes[u])
        i = units.index(widest)
        inner = open_unit(model, positions, widest)
        sizes.update({n: size(n) for n in inner})
        units[i : i + 1] = inner
    total = sum(p.numel() for p in model.parameters())
    while at_least > 1:
        big = [u for u in units if sizes[u] * at_least > total and positions.children(model, u)]
        if not big:
            break
        widest = max(big, key=lambda u: sizes[u])
        inner = open_unit(model, positions, widest)
        sizes.update({n: size(n) for n in inner})
        i = units.index(widest)
        trial = units[:i] + inner + units[i + 1 :]
        if largest_block([sizes[u] for u in _in_order(trial, positions)], at_least) >= largest_block(
            [sizes[u] for u in _in_order(units, positions)], at_least
        ):
            break
        units = trial
    return _in_order(units, positions)


def largest_block(weights: Sequence[float], parts: int) -> float:
    """The largest block sum of the best split of ``weights`` into ``parts`` contiguous blocks."""
    if len(weights) < parts:
        return float("inf")
    total = sum(weights) or 1
    sizes = partition_min_max([int(round(w * 1e9 / total)) for w in weights], parts)
    bounds = [0]
    for n in sizes:
        bounds.append(bounds[-1] + n)
    return max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))


def _in_order(units: Sequence[str], positions: ModulePositions) -> list[str]:
    """``units`` in execution order, one per starting position."""
    unique: list[str] = []
    for name in sorted(units, key=lambda n: positions.first[n]):
        if not unique or positions.first[name] != positions.first[unique[-1]]:
            unique.append(name)
    return unique


def cost_units(model: nn.Module, positions: ModulePositions, costs: Mapping[str, float]) -> list[str] | None:
    """When every key of ``costs`` names a module (a cost per unit, e.g. measured by
    :func:`pipetrain.stages.measure_unit_costs`), those modules in execution order: the places an
    automatic split by these costs may cut. None when some key is an fx node name."""
    modules = dict(model.named_modules())
    if not costs or not all(key in modules and key in positions.first for key in costs):
        return None
    return _in_order(list(costs), positions)


def starts_by_weight(
    nodes: Sequence[fx.Node],
    positions: ModulePositions,
    units: Sequence[str],
    weights: Sequence[float],
    stages: int,
    what: str = "parameter count",
) -> tuple[list[int], list[str]]:
    """Cut at unit starts into ``stages`` stages minimising the largest stage's summed weight."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"{option('stages')} must be a positive integer, got {stages!r}")
    first_compute = _first_compute(nodes)
    cuts = [u for u in units[1:] if positions.first[u] > first_compute]
    if stages - 1 > len(cuts):
        further = (
            "none can be cut further (each runs as one operation: a torch.nn layer, a leaf module, or a "
            "module without submodules)" if len(units) < stages else "a split may start only at a unit"
        )
        raise ConfigError(
            f"cannot split the model into {stages} stages by {what}: it has {len(cuts) + 1} "
            f"pipeline units ({', '.join(units[:10])}{' ...' if len(units) > 10 else ''}), and "
            f"{further}; use {option('stages', len(cuts) + 1)} or fewer"
        )
    bounds = [0, *[positions.first[u] for u in cuts], len(nodes)]
    segments = [sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])]
    if all(isinstance(w, int) for w in segments):
        integral = [int(w) for w in segments]
    else:  # the partition solver is exact on integers: measure costs in billionths of the total
        total = sum(segments)
        integral = [int(round(w * 1e9 / total)) if total > 0 else 0 for w in segments]
    sizes = partition_min_max(integral, stages)
    chosen: list[str] = []
    k = 0
    for size in sizes[:-1]:
        k += size
        chosen.append(cuts[k - 1])
    return [positions.first[n] for n in chosen], chosen
