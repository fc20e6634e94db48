"""Cutting a model into stages: by balance, by parameter count, at named modules, or as given."""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.stages.partition import balance_by_params, check_balance
from pipetrain.stages.staged import StagedModel, StageSequential

__all__ = ["balance_from_split_at", "from_stages", "split_model"]


def _key_maps(stages: Sequence[nn.Module], model: nn.Module) -> tuple[list[dict[str, str]], list[str], dict[str, str]]:
    """Match stage state-dict entries to the model's by tensor identity."""
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
    if uncovered:
        raise ConfigError(
            f"the stages leave out {len(uncovered)} parameter(s)/buffer(s) of the model, e.g. "
            f"{uncovered[:3]}: every module with state must belong to a stage"
        )
    return key_map, list(model_state), aliases


def from_stages(stages: Sequence[nn.Module], model: nn.Module | None = None) -> StagedModel:
    """Explicit stage modules. With ``model``, state-dict keys map to the model's (by tensor
    identity); without, the unsplit model is ``nn.Sequential(*stages)`` (keys ``"s.<key>"``)."""
    stages = list(stages)
    if not stages or not all(isinstance(s, nn.Module) for s in stages):
        raise ConfigError("stages must be a non-empty list of nn.Module")
    if model is None:
        model = nn.Sequential(*stages)
    key_map, model_keys, aliases = _key_maps(stages, model)
    return StagedModel(stages, key_map, model_keys, None, aliases)


def balance_from_split_at(model: nn.Sequential, names: Sequence[str]) -> list[int]:
    """The balance that starts a new stage at each named top-level module of ``model``."""
    children = [name for name, _ in model.named_children()]
    position = {name: i for i, name in enumerate(children)}
    cuts: list[int] = []
    for name in names:
        if name not in position:
            nested = "." in name
            raise ConfigError(
                f"--split-at {name!r}: "
                + ("cutting inside a top-level module is not supported yet; " if nested else "")
                + f"name top-level modules of the model: {', '.join(children[:12])}"
                + (" ..." if len(children) > 12 else "")
            )
        cuts.append(position[name])
    if cuts != sorted(set(cuts)):
        raise ConfigError(f"--split-at names must be distinct and in model order, got {','.join(names)}")
    if cuts and cuts[0] == 0:
        raise ConfigError(f"--split-at {names[0]!r} is the first module: stage 0 would be empty")
    bounds = [0, *cuts, len(children)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def split_model(
    model: nn.Module | Sequence[nn.Module],
    *,
    stages: int | None = None,
    balance: Sequence[int] | None = None,
    split_at: Sequence[str] | None = None,
) -> StagedModel:
    """Cut ``model`` into a :class:`StagedModel`.

    * an ``nn.Sequential`` by ``balance`` (modules per stage), by ``split_at`` (each named
      top-level module starts a stage), or into ``stages`` stages of near-equal parameter count
      (see :func:`~pipetrain.stages.partition.balance_by_params`); give exactly one of the three
      (``stages`` may accompany the others if it agrees with them);
    * a list of modules is taken as the stages themselves.
    """
    if isinstance(model, (list, tuple)):
        if (stages is not None and stages != len(model)) or balance is not None or split_at:
            raise ConfigError(
                f"the model is given as {len(model)} stage modules; drop --balance/--split-at "
                f"and use --stages {len(model)} (or leave it out)"
            )
        return from_stages(model)
    if not isinstance(model, nn.Sequential):
        raise ConfigError(
            f"cannot cut a {type(model).__name__} into stages automatically: it is not an "
            f"nn.Sequential. Return a list of stage modules (or an nn.Sequential of pipeline units) "
            f"from your model factory, or use --split-at once it supports arbitrary models"
        )
    n = len(model)
    if balance is not None and split_at:
        raise ConfigError("give either --balance or --split-at, not both")
    if split_at:
        balance = balance_from_split_at(model, split_at)
    if balance is not None:
        balance = check_balance(balance, n)
        if stages is not None and stages != len(balance):
            raise ConfigError(
                f"--stages {stages} disagrees with the {len(balance)} stages of "
                f"{'--split-at' if split_at else '--balance'}; drop one of them"
            )
    elif stages is not None:
        balance = balance_by_params(model, stages)
    else:
        raise ConfigError("say how to cut the model: --stages S, --balance a,b,... or --split-at NAME,...")
    children = list(model.named_children())
    parts: list[nn.Module] = []
    start = 0
    for count in balance:
        parts.append(StageSequential(OrderedDict(children[start : start + count])))
        start += count
    key_map, model_keys, aliases = _key_maps(parts, model)
    return StagedModel(parts, key_map, model_keys, list(balance), aliases)
