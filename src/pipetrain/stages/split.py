"""Cutting a model into stages: by balance, by cost, at named modules, by a plan, or as given."""

from __future__ import annotations

import difflib
from collections import OrderedDict
from typing import Any, Mapping, Sequence

from torch import nn

from pipetrain.errors import ConfigError, option
from pipetrain.stages.cut import cut_graph
from pipetrain.stages.nodes import ModulePositions, positioned_nodes
from pipetrain.stages.partition import balance_by_params, check_balance, check_stages, partition_min_max
from pipetrain.stages.points import (
    Plan,
    cost_units,
    cost_weights,
    parameter_weights,
    pipeline_units,
    starts_by_weight,
    starts_from_plan,
    starts_from_split_at,
)
from pipetrain.stages.staged import StagedModel, StageSequential
from pipetrain.stages.tied import find_tied
from pipetrain.stages.trace import trace_model

__all__ = ["balance_from_split_at", "from_stages", "split_model"]


def _key_maps(
    stages: Sequence[nn.Module], model: nn.Module, *, allow_unused: bool = False
) -> tuple[list[dict[str, str]], list[str], dict[str, str], list[str]]:
    """Match stage state-dict entries to the model's by tensor identity.

    Returns the key maps, the model's keys, the aliases (further keys of tied tensors) and the
    model keys no stage holds (an error unless ``allow_unused``).
    """
    model_state = model.state_dict(keep_vars=True)
    owner: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, value in model_state.items():
        if id(value) in owner:
            aliases[key] = owner[id(value)]
        else:
            owner[id(value)] = key
    key_map: list[dict[str, str]] = []
    covered: set[str] = set()
    for s, stage in enumerate(stages):
        mapping: dict[str, str] = {}
        for key, value in stage.state_dict(keep_vars=True).items():
            target = owner.get(id(value))
            if target is None:
                raise ConfigError(
                    f"stage {s} holds {key!r}, which is not a parameter or buffer of the model: "
                    f"stages must be made of the model's own modules"
                )
            mapping[key] = target
            covered.add(target)
        key_map.append(mapping)
    uncovered = [k for k in owner.values() if k not in covered]
    if uncovered and not allow_unused:
        raise ConfigError(
            f"the stages leave out {len(uncovered)} parameter(s)/buffer(s) of the model, e.g. "
            f"{uncovered[:3]}: every module with state must belong to a stage"
        )
    return key_map, list(model_state), aliases, uncovered


def from_stages(stages: Sequence[nn.Module], model: nn.Module | None = None) -> StagedModel:
    """Explicit stage modules. With ``model``, state-dict keys map to the model's (by tensor
    identity); without, the unsplit model is ``nn.Sequential(*stages)`` (keys ``"s.<key>"``)."""
    stages = list(stages)
    if not stages or not all(isinstance(s, nn.Module) for s in stages):
        raise ConfigError("stages must be a non-empty list of nn.Module")
    if model is None:
        model = nn.Sequential(*stages)
    key_map, model_keys, aliases, _ = _key_maps(stages, model)
    return StagedModel(stages, key_map, model_keys, None, aliases, tied=find_tied(stages, model))


def _did_you_mean(name: str, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=3)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def balance_from_split_at(model: nn.Sequential, names: Sequence[str]) -> list[int]:
    """The balance that starts a new stage at each named top-level module of ``model``."""
    return _balance_from_names([name for name, _ in model.named_children()], names)


def _balance_from_names(children: Sequence[str], names: Sequence[str]) -> list[int]:
    position = {name: i for i, name in enumerate(children)}
    cuts: list[int] = []
    for name in names:
        if name not in position:
            raise ConfigError(
                f"{option('split_at')} {name!r}: the model has no top-level module of that name"
                + _did_you_mean(name, children)
                + f" (top-level modules: {', '.join(children[:12])}"
                + (" ...)" if len(children) > 12 else ")")
            )
        cuts.append(position[name])
    if cuts != sorted(set(cuts)):
        raise ConfigError(f"{option('split_at')} names must be distinct and in model order, got {option('split_at', names)}")
    if cuts and cuts[0] == 0:
        raise ConfigError(f"{option('split_at')} {names[0]!r} is the first module: stage 0 would be empty")
    bounds = [0, *cuts, len(children)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _unit_weights(children: Sequence[str], costs: Mapping[str, float]) -> list[float]:
    weights = [0.0] * len(children)
    for key, value in costs.items():
        head = key.split(".")[0]
        if head not in children:
            raise ConfigError(
                f"cost key {key!r} names no module of the model"
                + _did_you_mean(key, children)
                + f" (its units are {', '.join(children[:12])})"
            )
        weights[children.index(head)] += float(value)
    return weights


def _is_top_level(model: nn.Sequential, names: Sequence[str]) -> bool:
    children = {name for name, _ in model.named_children()}
    return all(name in children for name in names)


def split_model(
    model: nn.Module | Sequence[nn.Module],
    *,
    stages: int | None = None,
    balance: Sequence[int] | None = None,
    split_at: Sequence[str] | None = None,
    plan: Plan | None = None,
    costs: Mapping[str, float] | None = None,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> StagedModel:
    """Cut ``model`` into a :class:`StagedModel`. Say how with one of:

    * ``split_at=[names]``: each named module (qualified, e.g. ``layer2``, ``blocks.3.attn``) is
      the first of a new stage;
    * ``plan``: the modules of every stage (see :mod:`pipetrain.stages.points` for the forms);
    * ``stages=S``: S stages of near-equal cost, by parameter count or by ``costs`` (per fx node
      name or per module name, e.g. measured times; see :func:`measure_node_costs`);
    * ``balance=[...]``: module counts per stage, for an ``nn.Sequential`` only.

    (``stages`` may accompany the others when it agrees.) An ``nn.Sequential`` cut at top-level
    modules gives :class:`StageSequential` stages; any other model, or a cut inside a top-level
    module, is traced with torch.fx (:func:`~pipetrain.stages.trace.trace_model`, which takes
    ``leaf_modules`` and ``concrete_args``) and cut into GraphModule stages that hand on every value
    a later stage needs. A list of modules is taken as the stages themselves.
    """
    if isinstance(model, (list, tuple)):
        if (stages is not None and stages != len(model)) or balance is not None or split_at or plan or costs:
            raise ConfigError(
                f"the model is given as {len(model)} stage modules; drop {option('balance')}/{option('split_at')}/"
                f"{option('plan')} and use {option('stages', len(model))} (or leave it out)"
            )
        return from_stages(model)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"cannot split a {type(model).__name__}: give an nn.Module or a list of stage modules")
    given = [option(name) for name, value in (("balance", balance), ("split_at", split_at), ("plan", plan))
             if value is not None and (value or name != "split_at")]
    if len(given) > 1:
        raise ConfigError(f"give only one of {option('balance')}, {option('split_at')} and {option('plan')}, "
                          f"not {' and '.join(given)}")
    if costs is not None and (given or stages is None):
        raise ConfigError(f"costs only guide an automatic split: give them with {option('stages')} (and no split "
                          f"points)")
    if split_at is not None and isinstance(split_at, str):
        split_at = [n for n in split_at.split(",") if n]
    declared = declared_units(model)
    if declared is not None:
        if plan is not None or leaf_modules or concrete_args:
            raise ConfigError(
                f"{type(model).__name__} declares its pipeline units (pipeline_units), which are cut as they are: "
                f"use {option('stages')}, {option('balance')} or {option('split_at')} with unit names "
                f"({', '.join(n for n, _ in declared[:8])}{' ...' if len(declared) > 8 else ''}), without "
                f"{option('plan')}, {option('leaf_modules')} or {option('concrete_args')}"
            )
        return _split_units(declared, model, stages, balance, split_at, costs)
    traced = not isinstance(model, nn.Sequential) or plan is not None or bool(leaf_modules) or bool(concrete_args)
    traced = traced or (bool(split_at) and not _is_top_level(model, split_at))  # type: ignore[arg-type]
    if traced:
        if balance is not None:
            raise ConfigError(
                f"{option('balance')} counts the top-level modules of an nn.Sequential; {type(model).__name__} "
                f"is cut by tracing: use {option('stages')}, {option('split_at')} or {option('plan')}"
            )
        return _split_traced(model, stages, split_at, plan, costs, leaf_modules, concrete_args)
    return _split_units(list(model.named_children()), model, stages, balance, split_at, costs)


def declared_units(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The model's own ``pipeline_units``, checked, or None when it declares none.

    A model (for example a HuggingFace model, which torch.fx cannot trace) may declare how it
    runs as a sequence of units: ``model.pipeline_units = [(name, module), ...]``, modules that
    share the model's own submodules and, called one after the other under the boundary
    convention of :mod:`pipetrain.stages.staged`, compute what training needs of ``forward`` (see
    :mod:`pipetrain.models.hf`). It is then cut between units like an ``nn.Sequential``, and state
    dicts keep the model's own keys.
    """
    units = getattr(model, "pipeline_units", None)
    if units is None:
        return None
    units = units() if callable(units) else units
    pairs = [tuple(u) for u in units] if isinstance(units, (list, tuple)) else None
    if not pairs or not all(len(u) == 2 and isinstance(u[0], str) and isinstance(u[1], nn.Module) for u in pairs):
        raise ConfigError(
            f"{type(model).__name__}.pipeline_units must be a non-empty list of (name, nn.Module) pairs, the "
            f"units in the order they run"
        )
    names = [n for n, _ in pairs]
    if any(not n or "." in n for n in names):
        raise ConfigError(
            f"{type(model).__name__}.pipeline_units: unit names must be non-empty and without '.', got {names}"
        )
    if len(set(names)) != len(names):
        raise ConfigError(f"{type(model).__name__}.pipeline_units: unit names must be distinct, got {names}")
    return pairs  # type: ignore[return-value]


def _split_units(
    children: list[tuple[str, nn.Module]],
    model: nn.Module,
    stages: int | None,
    balance: Sequence[int] | None,
    split_at: Sequence[str] | None,
    costs: Mapping[str, float] | None,
) -> StagedModel:
    """Cut consecutive units (an ``nn.Sequential``'s children, or declared units) into stages."""
    n = len(children)
    names = [name for name, _ in children]
    if split_at:
        balance = _balance_from_names(names, split_at)
    if balance is not None:
        balance = check_balance(balance, n)
        if stages is not None and stages != len(balance):
            raise ConfigError(
                f"{option('stages', stages)} disagrees with the {len(balance)} stages of "
                f"{option('split_at' if split_at else 'balance')}; drop one of them"
            )
    elif stages is not None:
        if costs is None:
            balance = balance_by_params([m for _, m in children], stages)
        else:
            check_stages(stages, n)
            weights = _unit_weights(names, costs)
            total = sum(weights)
            balance = partition_min_max([int(round(w * 1e9 / total)) if total else 0 for w in weights], stages)
    else:
        raise ConfigError(
            f"say how to cut the model: {option('stages')} (a stage count), {option('balance')} (modules per "
            f"stage), {option('split_at')} (the modules that start a stage) or {option('plan')}"
        )
    parts: list[nn.Module] = []
    start = 0
    for count in balance:
        parts.append(StageSequential(OrderedDict(children[start : start + count])))
        start += count
    key_map, model_keys, aliases, _ = _key_maps(parts, model)
    return StagedModel(parts, key_map, model_keys, list(balance), aliases, tied=find_tied(parts, model))


def _split_traced(
    model: nn.Module,
    stages: int | None,
    split_at: Sequence[str] | None,
    plan: Plan | None,
    costs: Mapping[str, float] | None,
    leaf_modules: Sequence[str | type],
    concrete_args: Mapping[str, Any] | None,
) -> StagedModel:
    traced = trace_model(model, leaf_modules=leaf_modules, concrete_args=concrete_args)
    nodes = positioned_nodes(traced.graph)
    positions = ModulePositions.of(nodes)
    if plan is not None:
        starts, names = starts_from_plan(model, nodes, positions, plan)
        what = option("plan")
    elif split_at:
        starts, names = starts_from_split_at(model, nodes, positions, split_at)
        what = option("split_at")
    elif stages is not None:
        weights = parameter_weights(model, nodes) if costs is None else cost_weights(model, nodes, positions, costs)
        units = (None if costs is None else cost_units(model, positions, costs)) or pipeline_units(
            model, positions, at_least=stages
        )
        starts, names = starts_by_weight(
            nodes, positions, units, weights, stages, "parameter count" if costs is None else "cost"
        )
        what = ""
    else:
        raise ConfigError(f"say how to cut the model: {option('stages')} (a stage count), {option('split_at')} (the "
                          f"modules that start a stage) or {option('plan')}")
    if what and stages is not None and stages != len(starts) + 1:
        raise ConfigError(
            f"{option('stages', stages)} disagrees with the {len(starts) + 1} stages of {what}; drop one of them"
        )
    parts, boundaries = cut_graph(traced, model, starts)
    key_map, model_keys, aliases, unused = _key_maps(parts, model, allow_unused=True)
    state = model.state_dict(keep_vars=True)
    frozen = {key: state[key].detach() for key in unused}
    return StagedModel(
        parts, key_map, model_keys, None, aliases, list(names), boundaries, frozen, tied=find_tied(parts, model)
    )
