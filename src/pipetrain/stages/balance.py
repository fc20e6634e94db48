"""The units an automatic split chooses from, and the record of which stages were chosen and why.

The timing itself runs the units as stage executors run them: :mod:`pipetrain.execution.unit_timing`.

Why time rather than parameter counts, and how: that module's docstring. The split then minimises
the slowest stage's summed cost (:func:`~pipetrain.stages.split_model` with ``costs=``).

Times vary from run to run, and so may the chosen cut: it is recorded (:class:`StageChoice`,
printed and in the run's report) with the measurements, which reproduce it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from torch import nn

from pipetrain.errors import ConfigError
from pipetrain.stages.nodes import ModulePositions, is_compute, positioned_nodes
from pipetrain.stages.points import cost_units, pipeline_units
from pipetrain.stages.split import declared_units, split_model
from pipetrain.stages.staged import StagedModel
from pipetrain.stages.trace import trace_model

__all__ = ["StageChoice", "unit_names", "unit_pieces"]


@dataclass
class StageChoice:
    """The stages a run uses: how they were chosen, where they start, their size and cost.

    ``how``: ``"measured time"``, ``"parameter count"`` or the option that gave them
    (``"--split-at"``, ``"--balance"``, ``"--plan"``, ``"stage modules"``). ``starts[s]`` names the
    first unit/module of stage ``s`` (``None``: the input, or unnamed stage modules);
    ``parameters[s]`` counts its parameter elements; ``seconds[s]`` is its measured forward +
    backward time on one microbatch (when measured), ``unit_seconds`` the measurement by unit.
    """

    how: str
    starts: list[str | None]
    parameters: list[int]
    seconds: list[float] | None = None
    unit_seconds: dict[str, float] | None = None
    note: str = ""

    @property
    def split_at(self) -> list[str]:
        """Names that cut the model the same way again (``split_model(model, split_at=...)``)."""
        return [s for s in self.starts[1:] if s is not None]

    @property
    def time_shares(self) -> list[float] | None:
        if self.seconds is None:
            return None
        total = sum(self.seconds)
        return [s / total if total > 0 else 0.0 for s in self.seconds]

    def heading(self) -> str:
        """``stages balanced by measured time`` (with the note, if any)."""
        head = f"stages balanced by {self.how}" if self.how in ("measured time", "parameter count") else (
            f"stages given by {self.how}")
        return head + (f" ({self.note})" if self.note else "")

    def stage_lines(self) -> list[str]:
        """One line per stage: parameters (share), share of the measured time, where it starts."""
        total = sum(self.parameters) or 1
        shares = self.time_shares
        out = []
        for s, count in enumerate(self.parameters):
            start = self.starts[s]
            where = "from the input" if s == 0 else (f"from {start}" if start else "")
            timed = "" if shares is None else f", {100 * shares[s]:5.1f} % of the measured time"
            out.append(f"stage {s}: {count:>10} parameters ({100 * count / total:5.1f} %){timed}  {where}".rstrip())
        return out

    def lines(self) -> list[str]:
        """The heading, then one indented line per stage, for people."""
        return [self.heading() + ":", *("  " + line for line in self.stage_lines())]

    def as_dict(self) -> dict[str, Any]:
        """The report's ``stage_choice`` object."""
        return {
            "how": self.how,
            "split_at": self.split_at,
            "note": self.note,
            "stages": [
                {"stage": s, "starts_at": self.starts[s] if s else None, "parameters": count,
                 **({} if self.seconds is None else {"seconds": self.seconds[s], "time_share": self.time_shares[s]})}
                for s, count in enumerate(self.parameters)
            ],
            **({} if self.unit_seconds is None else {"unit_seconds": dict(self.unit_seconds)}),
        }

    @classmethod
    def of(cls, staged: StagedModel, how: str, unit_names: Sequence[str] | None = None,
           unit_seconds: Mapping[str, float] | None = None, note: str = "") -> "StageChoice":
        """The record of ``staged``: stage starts from its split points or its balance over ``unit_names``."""
        if staged.split_at is not None:
            starts: list[str | None] = [None, *staged.split_at]
        elif staged.balance is not None and unit_names is not None:
            bounds = [sum(staged.balance[:s]) for s in range(len(staged.balance))]
            starts = [None] + [unit_names[b] for b in bounds[1:]]
        else:
            starts = [None] * len(staged)
        seconds = None
        if unit_seconds is not None and unit_names is not None:
            seconds = _stage_seconds(staged, starts, unit_names, unit_seconds)
        return cls(how, starts, staged.parameter_counts(), seconds, dict(unit_seconds) if unit_seconds else None, note)


def _stage_seconds(staged: StagedModel, starts: Sequence[str | None], names: Sequence[str],
                   unit_seconds: Mapping[str, float]) -> list[float]:
    """Summed unit times per stage: each unit belongs to the stage whose start precedes it."""
    index = {name: i for i, name in enumerate(names)}
    bounds = [0] + [index[s] for s in starts[1:] if s in index]
    if len(bounds) != len(staged):
        return [float("nan")] * len(staged)
    bounds.append(len(names))
    return [sum(unit_seconds.get(names[i], 0.0) for i in range(a, b)) for a, b in zip(bounds, bounds[1:])]


def unit_names(
    model: nn.Module,
    stages: int,
    *,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: Mapping[str, Any] | None = None,
) -> list[str]:
    """The names of the pieces an automatic split into ``stages`` chooses from, in order: the
    top-level modules of an ``nn.Sequential``, a model's declared units, or (traced) the first
    unit and then every unit a stage may start at."""
    declared = declared_units(model)
    if declared is not None:
        return [name for name, _ in declared]
    if cut_between_children(model, leaf_modules, concrete_args):
        return [name for name, _ in model.named_children()]
    positions, first_compute = unit_positions(model, leaf_modules, concrete_args)
    return startable(pipeline_units(model, positions, at_least=stages), positions, first_compute)


def unit_positions(model: nn.Module, leaf_modules: Sequence[Any], concrete_args: Any) -> tuple[ModulePositions, int]:
    traced = trace_model(model, leaf_modules=leaf_modules, concrete_args=concrete_args)
    nodes = positioned_nodes(traced.graph)
    return ModulePositions.of(nodes), next((i for i, n in enumerate(nodes) if is_compute(n)), len(nodes))


def startable(units: Sequence[str], positions: ModulePositions, first_compute: int) -> list[str]:
    """The first unit, then the units a stage may start at (after the model's first operation)."""
    units = sorted(units, key=lambda n: positions.first[n])
    out = list(units[:1])
    for u in units[1:]:
        if positions.first[u] > first_compute and positions.first[u] != positions.first[out[-1]]:
            out.append(u)
    return out


def unit_pieces(
    model: nn.Module,
    stages: int,
    *,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: Mapping[str, Any] | None = None,
    names: Sequence[str] | None = None,
) -> tuple[list[str], StagedModel]:
    """The :func:`unit_names` (or the given ``names``) and the model cut before every one of them
    (one stage per unit)."""
    names = list(names) if names is not None else unit_names(
        model, stages, leaf_modules=leaf_modules, concrete_args=concrete_args
    )
    if declared_units(model) is not None or cut_between_children(model, leaf_modules, concrete_args):
        return names, split_model(model, balance=[1] * len(names))
    return names, split_model(model, split_at=names[1:], leaf_modules=leaf_modules, concrete_args=concrete_args)


def cut_between_children(model: nn.Module, leaf_modules: Sequence[Any], concrete_args: Any) -> bool:
    """Whether an automatic split cuts ``model`` between its children without tracing."""
    return isinstance(model, nn.Sequential) and not leaf_modules and not concrete_args


def cost_order(model: nn.Module, costs: Mapping[str, float], trace: dict) -> list[str]:
    """The units that ``costs`` times, in execution order (checked to fit the model)."""
    declared = declared_units(model)
    if declared is not None or cut_between_children(model, trace["leaf_modules"], trace["concrete_args"]):
        names = [n for n, _ in declared] if declared is not None else [n for n, _ in model.named_children()]
        missing = [n for n in names if n not in costs]
        if missing:
            raise ConfigError(f"the unit costs lack {missing[:3]}: they were measured for another model")
        return names
    positions, _ = unit_positions(model, trace["leaf_modules"], trace["concrete_args"])
    order = cost_units(model, positions, costs)
    if order is None:
        unknown = [k for k in costs if k not in positions.first][:3]
        raise ConfigError(f"the unit costs name {unknown}, which are not modules this model runs: they were "
                          f"measured for another model")
    return order
