"""How a training run cuts its model into stages: by ``--balance`` / ``--split-at`` / a plan, by
parameter count, or by measured time (each unit timed once, on the run's first microbatch, by rank
0 alone under torch.distributed, or with the unit times of the run being resumed); and how
``--schedule auto`` prices the units it chooses for.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from pipetrain.data import BatchSampler, get_batch
from pipetrain.errors import ConfigError, option, written
from pipetrain.execution import UnitLayout
from pipetrain.execution.unit_timing import split_by_time
from pipetrain.execution.recompute import STOCHASTIC
from pipetrain.plan.choose import AutoChoice, choose_schedule, parse_auto
from pipetrain.runtime.checkpoint import MANIFEST
from pipetrain.runtime.errors import CheckpointMismatchError, collective
from pipetrain.schedule import ASYNCHRONOUS
from pipetrain.schedule.costs import load_costs
from pipetrain.schedule.presets import LOOPED
from pipetrain.stages import StageChoice, StagedModel, split_model, unit_names, unit_pieces
from pipetrain.stages.balance import cost_order
from pipetrain.initialiser import Init
from pipetrain.stages.split import declared_units
from pipetrain.structure import cast_floating, rows
from pipetrain.training.checkpoints import resumed_checkpoint
from pipetrain.training.config import TrainConfig

__all__ = ["BALANCE_BY", "cut", "balance_by", "first_microbatch", "unit_names_of", "check_auto", "choose_auto",
           "choose_by_parameters"]

BALANCE_BY = ("auto", "time", "params")

#: a loss function: ``loss_fn(output, target)``, the mean over the samples
LossFn = Callable[[Any, Tensor], Tensor]


def cut(config: TrainConfig, model: nn.Module, name: str, pieces: int, units: int, train_set: Dataset,
        dtype: torch.dtype, loss_fn: LossFn, init: Init | None = None, costs: dict[str, float] | None = None,
        ) -> tuple[StagedModel, StageChoice, dict[str, float] | None]:
    """The stages, the record of how they were chosen, and the measured seconds per unit when the
    split balanced time (None otherwise). ``units``: microbatches per update (a microbatch is what
    the units are timed on). ``costs``: unit times measured before (by the launcher, so that worker
    processes cut alike; or by the run being resumed), used instead of timing. A model built on
    meta is timed one unit at a time, each materialised with ``init`` and freed."""
    trace = _trace(config)
    if config.balance:
        staged = split_model(model, balance=config.balance, **trace)
        return staged, StageChoice.of(staged, "--plan" if config.plan else "--balance", unit_names_of(model)), None
    if config.split_at:
        staged = split_model(model, split_at=config.split_at, **trace)
        return staged, StageChoice.of(staged, "--split-at", unit_names_of(model)), None
    by, why = balance_by(config, name, model, pieces)
    if by == "params" or pieces == 1:
        staged = split_model(model, stages=pieces, **trace)
        names = unit_names(model, pieces, **trace) if staged.balance is not None else None
        return staged, StageChoice.of(staged, "parameter count", names, note=why), None
    costs = costs or _resumed_costs(config, model, trace)
    inputs = target = None
    if costs is None:
        inputs, target = first_microbatch(config, units, train_set, dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(config.threads_per_worker)  # time the units as a worker will run them
    try:
        staged, choice = _measured_once(
            lambda: split_by_time(model, pieces, inputs, target, loss_fn, costs=costs, init=init, seed=config.seed,
                                  **trace), model,
            pieces, trace,
        )
    finally:
        torch.set_num_threads(threads)
    return staged, choice, choice.unit_seconds


def balance_by(config: TrainConfig, name: str, model: nn.Module, pieces: int) -> tuple[str, str]:
    """``("time" | "params", why)`` for an automatic split. ``auto`` measures time where the cut
    cannot change what the run computes: a synchronous schedule trains the same for every cut
    (bitwise, as plain training), while on an asynchronous one the cut sets each layer's delay,
    dropout masks are drawn per stage, and tied weights add their stages' gradients in an order
    set by the cut (unless only the first and the last unit use them). There it keeps the
    deterministic parameter count, so that two runs (or the emulator and the runtime) cut alike."""
    if config.balance_by not in BALANCE_BY:
        raise ConfigError(f"unknown {option('balance_by')} {config.balance_by!r}; choose auto, time or params")
    if config.balance_by != "auto":
        return config.balance_by, ""
    if name in ASYNCHRONOUS:
        return "params", written(f"{name}: the cut sets each stage's delay; {option('balance_by', 'time')} to time it")
    if any(isinstance(m, STOCHASTIC) and m.p > 0 and m.training for m in model.modules()):
        return "params", written(f"dropout masks depend on the cut; {option('balance_by', 'time')} to time it")
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    if len({id(p) for p in params}) < len(params) and not _ties_fixed_by_any_cut(config, model, pieces):
        return "params", written(f"tied weights add in an order set by the cut; {option('balance_by', 'time')} to time it")
    return "time", ""


def _ties_fixed_by_any_cut(config: TrainConfig, model: nn.Module, pieces: int) -> bool:
    """Whether every shared parameter is used by the first unit and the last only (an input
    embedding and the LM head reusing it): every cut then gives it to the first and the last stage,
    which sum its gradient in the same order."""
    names, units = unit_pieces(model, pieces, **_trace(config))
    return all(set(t.stages) <= {0, len(names) - 1} for t in units.tied)


def unit_names_of(model: nn.Module) -> list[str] | None:
    """The names of the model's units, for the record of its cut: its declared units, or a
    Sequential's children (None: neither)."""
    declared = declared_units(model)
    if declared is not None:
        return [n for n, _ in declared]
    return [n for n, _ in model.named_children()] if isinstance(model, nn.Sequential) else None


def first_microbatch(config: TrainConfig, units: int, train_set: Dataset, dtype: torch.dtype) -> tuple[Any, Any]:
    """The inputs and targets of the run's first microbatch (``units`` per update), read without
    touching any random state."""
    layout = UnitLayout(config.batch_size, units)
    _, start, stop = layout.bounds(0)
    with torch.random.fork_rng(devices=[]):
        if isinstance(train_set, DataLoader):  # a microbatch's worth of its samples times the stages alike
            if isinstance(train_set.dataset, IterableDataset):
                x, y = next(iter(train_set))
                x, y = rows(x, start, stop), rows(y, start, stop)
            else:
                x, y = get_batch(train_set.dataset, range(start, min(stop, len(train_set.dataset))))
        else:
            indices = BatchSampler(train_set, config.batch_size, seed=config.seed, shuffle=config.shuffle).indices(0)
            x, y = get_batch(train_set, indices[start:stop])
    return cast_floating(x, dtype), y


def _measured_once(split: Callable[[], tuple[StagedModel, StageChoice]], model: nn.Module, pieces: int,
                   trace: dict[str, Any]) -> tuple[StagedModel, StageChoice]:
    """``split()`` in this process; under torch.distributed only rank 0 measures and every rank cuts
    by its unit times (ranks measuring each for itself could cut differently)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return split()
    shared: list[Any] = [None]
    if dist.get_rank() == 0:
        staged, choice = split()
        shared[0] = choice.unit_seconds
    collective("sharing the measured unit times", lambda: dist.broadcast_object_list(shared, src=0))
    if dist.get_rank() == 0:
        return staged, choice
    return split_by_time(model, pieces, None, None, None, costs=shared[0], **trace)  # type: ignore[arg-type]


def _resumed_costs(config: TrainConfig, model: nn.Module, trace: dict[str, Any]) -> dict[str, float] | None:
    """The unit times of the run being resumed (its checkpoint's fingerprint), so that it is cut
    as before; a checkpoint of another model is refused as such (its times name other modules)."""
    checkpoint = resumed_checkpoint(config)
    costs = None if checkpoint is None else checkpoint.meta.get("stage_costs")
    if not costs:
        return None
    saved, tell = checkpoint.meta.get("model"), f"its {MANIFEST} names the model under \"model\""
    if saved is not None and saved != config.model:
        differs = f"written by a run of {option('model', saved)}, not {option('model', config.model)} ({tell})"
    else:
        try:
            cost_order(model, costs, trace)
            return costs
        except ConfigError:
            timed = ", ".join(list(costs)[:4]) + (", ..." if len(costs) > 4 else "")
            differs = (f"its run timed the modules {timed} to cut the model (its {MANIFEST} lists them under "
                       f"\"stage_costs\"), which are not this model's: the model changed since it was written")
    raise CheckpointMismatchError(
        f"checkpoint {checkpoint.path} is of another model: {differs}; resume it with the model it was written "
        f"for, or start afresh with another {option('checkpoint_dir')}"
    )


def check_auto(config: TrainConfig) -> None:
    """``auto`` chooses the cut with the schedule: refuse what fixes the cut (or its stage count)."""
    if config.plan:  # its stages and replicas fill the cut options: name it alone
        raise ConfigError(f"{option('schedule', config.schedule)} chooses the schedule and cut that a plan fixes: drop "
                          f"{option('plan')} (pipetrain plan chooses for a profile with its own auto) or "
                          f"{option('schedule')}")
    given = [option(field) for field in ("balance", "split_at", "replicas") if getattr(config, field)]
    if given:
        raise ConfigError(f"{option('schedule', config.schedule)} cuts the model for the schedule it chooses: drop "
                          f"{', '.join(given)} (give {option('stages')}, the ranks) or name a schedule")
    if config.chunks != 1:
        raise ConfigError(f"{option('schedule', config.schedule)} chooses the chunks per rank too: drop "
                          f"{option('chunks')}")


def choose_auto(config: TrainConfig, model: nn.Module, ranks: int, units: int, train_set: Dataset,
                dtype: torch.dtype, loss_fn: LossFn, init: Init | None, costs: dict[str, float] | None,
                ) -> tuple[TrainConfig, AutoChoice, dict[str, float] | None]:
    """``(config naming the chosen schedule, its AutoChoice, unit costs)`` for ``schedule="auto"``
    (:mod:`pipetrain.plan.choose`). Units are priced as the run will cut them: by measured time
    (each unit timed once; the cut then reuses those times, and the launcher hands them to the
    workers, which choose alike), else by parameter count. With measured times, a calibration
    (``costs_file``) charges every action and message too. The looped schedules get 2 chunks."""
    trace = _trace(config)
    pieces = _auto_pieces(model, ranks, trace)
    by, _ = balance_by(config, "1f1b", model, pieces)
    if by != "time" or pieces == 1:
        config, choice = choose_by_parameters(config, model, ranks, units, trace)
        return config, choice, costs
    _, _, costs = cut(config, model, "1f1b", pieces, units, train_set, dtype, loss_fn, init, costs)
    assert costs is not None  # a cut by time returns its unit times
    values = [costs[unit] for unit in cost_order(model, costs, trace)]
    calibration = load_costs(config.costs_file) if config.costs_file else None
    choice = choose_schedule(values, ranks, units, memory=parse_auto(config.schedule), calibration=calibration)
    choice.priced_by = "measured unit times" + (" and the calibration's per-action and message costs"
                                                if calibration else "")
    return _naming(config, choice), choice, costs


def choose_by_parameters(config: TrainConfig, model: nn.Module, ranks: int, units: int, trace: dict[str, Any],
                         ) -> tuple[TrainConfig, AutoChoice]:
    """``schedule="auto"`` with each unit priced by its parameter count, over the units the tracer
    finds with ``trace`` (``leaf_modules``, ``concrete_args``): no data is needed to time them (the
    Python API chooses so when it is made, and so does a run not cut by time)."""
    _, pieced = unit_pieces(model, _auto_pieces(model, ranks, trace), **trace)
    values = [float(sum(p.numel() for p in stage.parameters())) for stage in pieced.stages]
    choice = choose_schedule(values, ranks, units, memory=parse_auto(config.schedule))
    choice.priced_by = "unit parameter counts"
    return _naming(config, choice), choice


def _trace(config: TrainConfig) -> dict[str, Any]:
    """What the tracer is told for a model torch.fx splits (``leaf_modules``, ``concrete_args``)."""
    return dict(leaf_modules=list(config.leaf_modules or ()), concrete_args=config.concrete_args)


def _auto_pieces(model: nn.Module, ranks: int, trace: dict[str, Any]) -> int:
    """The units ``auto`` prices: two per rank where the model has them (the looped schedules'
    chunks), else one."""
    return 2 * ranks if len(unit_names(model, 2 * ranks, **trace)) >= 2 * ranks else ranks


def _naming(config: TrainConfig, choice: AutoChoice) -> TrainConfig:
    """``config`` naming the chosen schedule (the looped ones with their chunks)."""
    return replace(config, schedule=choice.schedule, chunks=choice.chunks if choice.schedule in LOOPED else 1)
