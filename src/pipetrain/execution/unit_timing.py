"""Timing a model's pipeline units as a stage executor runs them, and balancing stages by those times.

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

Times vary from run to run, and so may the chosen cut: it is recorded
(:class:`~pipetrain.stages.StageChoice`, printed and in the run's report) with the measurements,
which reproduce it.

A model built on the meta device is timed one unit at a time (:func:`each_piece_alone`, which
:func:`pipetrain.plan.profiler.profile_by_unit` uses too).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.execution.stage import StageExecutor
from pipetrain.initialiser import Init
from pipetrain.stages.balance import (StageChoice, cost_order, cut_between_children, startable, unit_names,
                                      unit_pieces, unit_positions)
from pipetrain.stages.materialize import has_meta, materialize
from pipetrain.stages.points import largest_block, open_unit
from pipetrain.stages.split import declared_units, split_model
from pipetrain.stages.staged import StagedModel, call_stage
from pipetrain.structure import flatten

__all__ = ["measure_unit_costs", "split_by_time", "each_piece_alone"]


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
    init: Init | None = None,
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
                           target: torch.Tensor, loss_fn: Callable, init: Init | None, seed: int,
                           rounds: dict[str, Any]) -> dict[str, float]:
    """:func:`measure_unit_costs` of a model built on meta: one materialised piece at a time."""
    last = len(pieces) - 1
    samples = int(target.shape[0]) if isinstance(target, torch.Tensor) and target.dim() else 1
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    costs: dict[str, float] = {}
    try:
        for s, piece, values in each_piece_alone(model, pieces, inputs, init, seed):
            executor = StageExecutor(s, piece, None, loss_fn=loss_fn if s == last else None)

            def round_trip(r: int, s: int = s, executor: StageExecutor = executor) -> None:
                out = executor.forward(r, 0, values[s], target=target if s == last else None, samples=samples)
                grads = None if s == last else tuple(
                    torch.ones_like(t) if t.is_floating_point() else None for t in flatten(out)[0])
                executor.backward(r, 0, grads)

            costs[names[s]] = _fastest(round_trip, clock, **rounds)
            del executor
    except PipetrainError as error:
        raise ConfigError(f"cannot time the model's units to balance its stages: {error}") from None
    return costs


def each_piece_alone(model: nn.Module, pieces: StagedModel, inputs: Any, init: Init | None,
                     seed: int) -> Iterator[tuple[int, nn.Module, list[Any]]]:
    """Each piece of a model built on meta, materialised alone (``init`` under ``seed``) while the
    caller times it, then put back on meta: ``(s, piece, values)``, ``values[s]`` its input.

    First the forwards alone give every piece its input (``values``, each piece materialised and
    released in turn); all of it under a forked random state, so the caller's is left as it was.
    """
    with torch.random.fork_rng(devices=[]):
        values = [inputs]
        for piece in pieces.stages[:-1]:  # every piece's input, from the forwards alone
            made = materialize(model, piece, init, seed=seed)
            try:
                with torch.no_grad():
                    values.append(call_stage(piece, values[-1]))
            finally:
                made.release()
        for s, piece in enumerate(pieces.stages):
            made = materialize(model, piece, init, seed=seed)
            try:
                yield s, piece, values
            finally:
                made.release()


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
    init: Init | None = None,
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
        if declared_units(model) is None and not cut_between_children(model, leaf_modules, concrete_args):
            costs = _refined(model, stages, names, costs, inputs, target, loss_fn, timing, trace)
    names = cost_order(model, costs, trace)
    staged = split_model(model, stages=stages, costs=dict(costs), **trace)
    return staged, StageChoice.of(staged, "measured time", names, costs)


def _refined(model, stages, names, costs, inputs, target, loss_fn, timing, trace) -> dict[str, float]:
    positions, first_compute = unit_positions(model, trace["leaf_modules"], trace["concrete_args"])
    for _ in range(3):
        total = sum(costs.values())
        heavy = [u for u in names if costs[u] * stages > total and open_unit(model, positions, u)]
        if not heavy:
            break
        unit = max(heavy, key=costs.__getitem__)
        i = names.index(unit)
        trial = startable(names[:i] + open_unit(model, positions, unit) + names[i + 1 :], positions, first_compute)
        timed = measure_unit_costs(model, inputs, target, loss_fn, stages=stages, units=trial, **timing, **trace)
        if largest_block([timed[n] for n in trial], stages) >= largest_block([costs[n] for n in names], stages):
            break
        names, costs = trial, timed
    return costs
