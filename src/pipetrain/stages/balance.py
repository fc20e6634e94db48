"""Balancing stages by measured time, and the record of which stages were chosen and why.

Parameter counts say little about time: an attention layer's cost grows with the sequence and has
no parameters, a classifier head to many classes is mostly parameters and little work. So an
automatic split can time the model instead: cut it at every place an automatic split may cut (its
pipeline units, see :mod:`pipetrain.stages.points`), run each piece as a stage executor runs a
stage (forward with the loss on the last piece, then backward) on one microbatch, a warm-up and a
few timed rounds, and take each piece's fastest forward + backward seconds as its cost (CPU
time of the thread with one torch thread, as a worker runs; other work on the machine only ever
adds time, so the minimum is the steadiest estimate). The split
then minimises the slowest stage's summed cost (:func:`~pipetrain.stages.split_model` with
``costs=``). That costs a few forward/backward passes of the model on one microbatch.

Times vary from run to run, and so may the chosen cut: it is recorded (:class:`StageChoice`,
printed and in the run's report) with the measurements, which reproduce it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.stages.nodes import ModulePositions, is_compute, positioned_nodes
from pipetrain.stages.points import cost_units, largest_block, open_unit, pipeline_units
from pipetrain.stages.split import declared_units, split_model
from pipetrain.stages.staged import StagedModel
from pipetrain.stages.trace import trace_model

__all__ = ["StageChoice", "measure_unit_costs", "split_by_time", "unit_names", "unit_pieces"]


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
    if _cut_between_children(model, leaf_modules, concrete_args):
        return [name for name, _ in model.named_children()]
    positions, first_compute = _positions(model, leaf_modules, concrete_args)
    return _startable(pipeline_units(model, positions, at_least=stages), positions, first_compute)


def _positions(model: nn.Module, leaf_modules: Sequence[Any], concrete_args: Any) -> tuple[ModulePositions, int]:
    traced = trace_model(model, leaf_modules=leaf_modules, concrete_args=concrete_args)
    nodes = positioned_nodes(traced.graph)
    return ModulePositions.of(nodes), next((i for i, n in enumerate(nodes) if is_compute(n)), len(nodes))


def _startable(units: Sequence[str], positions: ModulePositions, first_compute: int) -> list[str]:
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
    if declared_units(model) is not None or _cut_between_children(model, leaf_modules, concrete_args):
        return names, split_model(model, balance=[1] * len(names))
    return names, split_model(model, split_at=names[1:], leaf_modules=leaf_modules, concrete_args=concrete_args)


def _cut_between_children(model: nn.Module, leaf_modules: Sequence[Any], concrete_args: Any) -> bool:
    """Whether an automatic split cuts ``model`` between its children without tracing."""
    return isinstance(model, nn.Sequential) and not leaf_modules and not concrete_args


def measure_unit_costs(
    model: nn.Module,
    inputs: Any,
    target: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    stages: int,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: Mapping[str, Any] | None = None,
    repeats: int = 5,
    warmup: int = 2,
    budget: float = 0.3,
    most: int = 30,
    units: Sequence[str] | None = None,
    init: Any = None,
    seed: int = 0,
) -> dict[str, float]:
    """Fastest forward + backward seconds of each piece of ``model`` cut at every unit
    (:func:`unit_names`), run on ``(inputs, target)`` as stage executors run them. With one torch
    thread (a worker's default) the seconds are the thread's CPU time, which other processes on the
    machine do not stretch; with more, wall time.

    After ``warmup`` rounds, at least ``repeats`` timed rounds, more while they took less than
    ``budget`` seconds in all (at most ``most``): on a busy machine a round of a small model is
    often interrupted, and a few more rounds cost little. ``units``: the pieces' names (default
    :func:`unit_names`).

    The model is left as it was: parameters are not updated, buffers (BatchNorm statistics) are
    restored and the random state too. Run it with the thread count the training will use.

    A model built on the meta device (:mod:`pipetrain.stages.materialize`) is timed one piece at a
    time, never whole: each piece is materialised with ``init`` (under ``seed``), run, and put back
    on meta; first forwards alone, to find every piece's input, then each piece's forward and
    backward on its input (with gradients of ones arriving for its outputs).
    """
    from pipetrain.execution.stage import StageExecutor  # (execution imports stages)
    from pipetrain.stages.materialize import has_meta

    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"repeats must be a positive integer, got {repeats!r}")
    names, pieces = unit_pieces(model, stages, leaf_modules=leaf_modules, concrete_args=concrete_args, names=units)
    if has_meta(model):
        return _measure_one_at_a_time(model, names, pieces, inputs, target, loss_fn, init, seed,
                                      dict(repeats=repeats, warmup=warmup, budget=budget, most=most))
    buffers = {k: b.clone() for k, b in model.named_buffers()}
    last = len(pieces) - 1
    executors = [StageExecutor(s, piece, None, loss_fn=loss_fn if s == last else None)
                 for s, piece in enumerate(pieces.stages)]
    rounds: list[list[float]] = [[] for _ in executors]
    samples = int(target.shape[0]) if isinstance(target, torch.Tensor) and target.dim() else 1
    # one thread (a worker's default): its CPU time is what the stage costs, however busy the
    # machine (autograd runs a CPU backward on the calling thread); more threads: wall time
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    wall = time.perf_counter
    try:
        with torch.random.fork_rng(devices=[]):
            began, r = wall(), 0
            while r < warmup + repeats or (r < warmup + most and wall() - began < budget):
                spent = [0.0] * len(executors)
                value = inputs
                constants = 0
                for s, executor in enumerate(executors):
                    start = clock()
                    value = executor.forward(r, 0, value, target=target if s == last else None, samples=samples,
                                             constants=constants)
                    spent[s] += clock() - start
                    constants = executor.last_constants
                grads = None
                for s in range(last, -1, -1):
                    start = clock()
                    grads = executors[s].backward(r, 0, grads)
                    spent[s] += clock() - start
                if r >= warmup:
                    for s, seconds in enumerate(spent):
                        rounds[s].append(seconds)
                else:
                    began = wall()
                r += 1
    except PipetrainError as error:
        raise ConfigError(f"cannot time the model's units to balance its stages: {error}") from None
    finally:
        with torch.no_grad():
            for key, buffer in model.named_buffers():
                buffer.copy_(buffers[key])
    return {name: min(times) for name, times in zip(names, rounds)}


def _measure_one_at_a_time(model: nn.Module, names: Sequence[str], pieces: StagedModel, inputs: Any,
                           target: torch.Tensor, loss_fn: Callable, init: Any, seed: int,
                           rounds: dict[str, Any]) -> dict[str, float]:
    """:func:`measure_unit_costs` of a model built on meta: one materialised piece at a time."""
    from pipetrain.execution.stage import StageExecutor
    from pipetrain.stages.materialize import materialize
    from pipetrain.stages.staged import call_stage
    from pipetrain.structure import flatten

    last = len(pieces) - 1
    samples = int(target.shape[0]) if isinstance(target, torch.Tensor) and target.dim() else 1
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    costs: dict[str, float] = {}
    try:
        with torch.random.fork_rng(devices=[]):
            values = [inputs]
            for piece in pieces.stages[:-1]:  # every piece's input, from the forwards alone
                made = materialize(model, piece, init, seed=seed)
                try:
                    with torch.no_grad():
                        values.append(call_stage(piece, values[-1]))
                finally:
                    made.release()
            for s, (name, piece) in enumerate(zip(names, pieces.stages)):
                made = materialize(model, piece, init, seed=seed)
                try:
                    executor = StageExecutor(s, piece, None, loss_fn=loss_fn if s == last else None)

                    def round_trip(r: int, s: int = s, executor: StageExecutor = executor) -> None:
                        out = executor.forward(r, 0, values[s], target=target if s == last else None, samples=samples)
                        grads = None if s == last else tuple(
                            torch.ones_like(t) if t.is_floating_point() else None for t in flatten(out)[0])
                        executor.backward(r, 0, grads)

                    costs[name] = _fastest(round_trip, clock, **rounds)
                    del executor
                finally:
                    made.release()
    except PipetrainError as error:
        raise ConfigError(f"cannot time the model's units to balance its stages: {error}") from None
    return costs


def _fastest(run: Callable[[int], Any], clock: Callable[[], float], *, repeats: int, warmup: int, budget: float,
             most: int) -> float:
    """The fastest of the timed rounds of ``run(round)`` (rounds as :func:`measure_unit_costs` counts them)."""
    times: list[float] = []
    began, r = time.perf_counter(), 0
    while r < warmup + repeats or (r < warmup + most and time.perf_counter() - began < budget):
        start = clock()
        run(r)
        spent = clock() - start
        if r >= warmup:
            times.append(spent)
        else:
            began = time.perf_counter()
        r += 1
    return min(times)


def split_by_time(
    model: nn.Module,
    stages: int,
    inputs: Any,
    target: torch.Tensor,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    *,
    leaf_modules: Sequence[str | type] = (),
    concrete_args: Mapping[str, Any] | None = None,
    costs: Mapping[str, float] | None = None,
    repeats: int = 5,
    init: Any = None,
    seed: int = 0,
) -> tuple[StagedModel, StageChoice]:
    """``model`` cut into ``stages`` stages of near-equal measured time, and the record of it.

    A traced model's unit that takes more than ``1/stages`` of the time is opened into its parts
    and the parts are timed, as long as that lowers the slowest stage's time (at most 3 times).
    ``costs`` (a previous measurement, :attr:`StageChoice.unit_seconds`) replaces measuring, and
    reproduces that cut. A model built on meta is timed one unit at a time, each materialised with
    ``init`` under ``seed`` (:func:`measure_unit_costs`).
    """
    trace = dict(leaf_modules=leaf_modules, concrete_args=concrete_args)
    if costs is None:
        names = unit_names(model, stages, **trace)
        timing = dict(repeats=repeats, init=init, seed=seed)
        costs = measure_unit_costs(model, inputs, target, loss_fn, stages=stages, units=names, **timing, **trace)
        if declared_units(model) is None and not _cut_between_children(model, leaf_modules, concrete_args):
            costs = _refined(model, stages, names, costs, inputs, target, loss_fn, timing, trace)
    names = _cost_order(model, costs, trace)
    staged = split_model(model, stages=stages, costs=dict(costs), **trace)
    return staged, StageChoice.of(staged, "measured time", names, costs)


def _cost_order(model: nn.Module, costs: Mapping[str, float], trace: dict) -> list[str]:
    """The units that ``costs`` times, in execution order (checked to fit the model)."""
    declared = declared_units(model)
    if declared is not None or _cut_between_children(model, trace["leaf_modules"], trace["concrete_args"]):
        names = [n for n, _ in declared] if declared is not None else [n for n, _ in model.named_children()]
        missing = [n for n in names if n not in costs]
        if missing:
            raise ConfigError(f"the unit costs lack {missing[:3]}: they were measured for another model")
        return names
    positions, _ = _positions(model, trace["leaf_modules"], trace["concrete_args"])
    order = cost_units(model, positions, costs)
    if order is None:
        unknown = [k for k in costs if k not in positions.first][:3]
        raise ConfigError(f"the unit costs name {unknown}, which are not modules this model runs: they were "
                          f"measured for another model")
    return order


def _refined(model, stages, names, costs, inputs, target, loss_fn, timing, trace) -> dict[str, float]:
    positions, first_compute = _positions(model, trace["leaf_modules"], trace["concrete_args"])
    for _ in range(3):
        total = sum(costs.values())
        heavy = [u for u in names if costs[u] * stages > total and open_unit(model, positions, u)]
        if not heavy:
            break
        unit = max(heavy, key=costs.__getitem__)
        i = names.index(unit)
        trial = _startable(names[:i] + open_unit(model, positions, unit) + names[i + 1 :], positions, first_compute)
        timed = measure_unit_costs(model, inputs, target, loss_fn, stages=stages, units=trial, **timing, **trace)
        if largest_block([timed[n] for n in trial], stages) >= largest_block([costs[n] for n in names], stages):
            break
        names, costs = trial, timed
    return costs
