"""Set-up of a training run, identical on every executor and every rank.

From a :class:`TrainConfig`: the data and the fixed batch order, the model (initialised under the
seed) cut into stages (:mod:`~pipetrain.training.cutting`), the schedule of the whole run
(:mod:`~pipetrain.training.scheduling`), the optimizer of each stage (with the schedule's delays
for SC and LWP), and the mapping from units to samples: a :class:`~pipetrain.training.run.Run`.
Every rank of the distributed runtime calls :func:`prepare` with the same configuration and gets
the same run; it then builds executors only for the stages it holds.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from pipetrain.data import BatchSampler, LoaderBatches
from pipetrain.data.batches import describe_reading, resolve_workers
from pipetrain.errors import ConfigError, option
from pipetrain.execution import TiedGradients, UnitLayout
from pipetrain.execution.device import resolve_device
from pipetrain.models import refuse_batchnorm
from pipetrain.plan.choose import is_auto
from pipetrain.schedule import resolve_name, staleness, units_per_update
from pipetrain.schedule.presets import LOOPED, check_chunks, chunks_per_rank
from pipetrain.schedule.recompute_stages import format_recompute, recompute_stages
from pipetrain.schedule.vshape import V_SCHEDULES, check_v_parameters
from pipetrain.stages import StageChoice
from pipetrain.initialiser import Init
from pipetrain.stages.materialize import has_meta, materialize, opened
from pipetrain.training import scheduling
from pipetrain.training.config import TrainConfig
from pipetrain.training.cutting import check_auto, choose_auto, cut, unit_names_of
from pipetrain.training.parts import RunParts, parts_from_config
from pipetrain.training.run import Run
from pipetrain.training.shapes import check_data
from pipetrain.training.validate import check_execution, read_plan
from pipetrain.weights import check_against

__all__ = ["Run", "prepare", "apply_plan", "plan_recompute", "EXECUTORS"]

EXECUTORS = ("distributed", "emulate")
_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def apply_plan(config: TrainConfig) -> TrainConfig:
    """Fill stages, replicas, schedule and microbatches from a `pipetrain plan` JSON file (of a chunked
    schedule: ranks, and the looped schedules' chunks per rank)."""
    if not config.plan:
        return replace(config, schedule=config.schedule or "1f1b", recompute=config.recompute or "none")
    plan, balance, replicas = read_plan(config)
    chunks = int(plan.get("chunks", 1))  # a chunked plan lists every chunk: its workers hold `chunks` stages each
    return replace(
        config,
        balance=balance,
        replicas=replicas if chunks == 1 else None,
        stages=len(balance) // chunks,
        chunks=chunks if chunks > 1 and config.chunks == 1 and plan.get("schedule") in LOOPED else config.chunks,
        schedule=config.schedule or plan.get("schedule") or "1f1b",
        microbatches=config.microbatches if config.microbatches is not None else plan.get("microbatches"),
        recompute=config.recompute if config.recompute is not None else plan_recompute(plan),
    )


def plan_recompute(plan: dict) -> str:
    """The ``--recompute`` text of a plan: the stages it says recompute (``"recompute": true``)."""
    stages = plan.get("stages", [])
    return format_recompute([s for s, stage in enumerate(stages) if stage.get("recompute")], len(stages))


def prepare(config: TrainConfig, parts: RunParts | None = None, *, stage_costs: dict[str, float] | None = None) -> Run:
    """Build everything the run needs from ``config`` and its ``parts`` (deterministic); without
    ``parts``, they are built from the configuration's specs (the command line). ``stage_costs``:
    seconds per unit measured before (the launcher's, handed to its workers), so that a split by
    time cuts as it did there instead of timing again; the run's own are ``Run.stage_costs``."""
    config = apply_plan(config)
    check_execution(config)
    device = resolve_device(config.device)
    auto = is_auto(config.schedule)
    if auto:
        check_auto(config)
    name = "1f1b" if auto else resolve_name(config.schedule)  # auto: chosen once the model is there
    if config.executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {config.executor!r}; choose one of {', '.join(EXECUTORS)}")
    if config.dtype is not None and config.dtype not in _DTYPES:
        raise ConfigError(f"unknown {option('dtype')} {config.dtype!r}; choose float32 or float64")
    if config.batch_size < 1:
        raise ConfigError(f"{option('batch_size')} must be at least 1, got {config.batch_size}")
    units = scheduling.resolved_microbatches(config, name)  # --microbatches, its default and its check: here only
    stages = scheduling.stage_count(config, name, units)

    resolve_workers(config.data_workers)  # a bad data_workers fails before the data loads
    parts = parts_from_config(config) if parts is None else parts
    train_set, test_set = parts.train_set, parts.test_set
    _check_batch_size(config, train_set)
    reading = describe_reading(train_set, config.data_workers)
    model = parts.model
    if isinstance(model, (list, tuple)):
        model = nn.Sequential(*model)  # the unsplit model of a list of stages (keys "0.", "1.", ...)
    if config.dtype is not None:
        model = model.to(_DTYPES[config.dtype])
    dtype = _DTYPES[config.dtype] if config.dtype is not None else _model_dtype(model)
    if config.precision != "fp32" and dtype != torch.float32:
        raise ConfigError(f"{option('precision', config.precision)} autocasts a float32 model (its master weights), "
                          f"not a {str(dtype).replace('torch.', '')} one: use a float32 model or "
                          f"{option('precision', 'fp32')}")
    init, on_meta = _initialiser(model, config.init)  # its weights opened here, once, for every stage
    choice = parts.schedule_choice
    if auto:
        config, choice, stage_costs = choose_auto(config, model, stages, units, train_set, dtype, parts.loss_fn, init,
                                                  stage_costs)
        name = config.schedule

    check_chunks(name, config.chunks)
    if name in V_SCHEDULES:  # before the cut, which may time the model
        check_v_parameters(name, stages, units, config.replicas)
    per_rank = chunks_per_rank(name, stages, units, config.chunks)
    pieces = stages * per_rank
    if per_rank > 1 and parts.staged is None and isinstance(model, nn.Sequential) and pieces > len(model):
        raise ConfigError(
            f"the {name} schedule cuts the model into {per_rank} chunks per rank, {pieces} stages for {stages} ranks, "
            f"but it has {len(model)} top-level modules: use {option('stages', max(len(model) // per_rank, 1))} "
            f"or fewer (ranks), or a deeper model")
    if parts.staged is not None:
        staged = parts.staged
        stage_choice = parts.stage_choice or StageChoice.of(staged, "the caller's cut", unit_names_of(model))
        stage_costs = None
    else:
        if config.balance and config.plan and isinstance(model, nn.Sequential) and sum(config.balance) != len(model):
            raise ConfigError(
                f"plan {config.plan!r} cuts {sum(config.balance)} layers but the model {config.model!r} has "
                f"{len(model)}; make the plan from a profile of this model (pipetrain profile --model ...)"
            )
        staged, stage_choice, stage_costs = cut(config, model, name, pieces, units, train_set, dtype, parts.loss_fn,
                                                init, stage_costs)
    if len(staged.stages) != pieces:
        raise ConfigError(
            f"the model was cut into {len(staged.stages)} stages but the {name} schedule needs {pieces}"
            + (f" ({stages} ranks x {per_rank} chunks)" if per_rank > 1 else "")
        )

    layout = UnitLayout(config.batch_size, units)
    if isinstance(train_set, DataLoader):
        sampler = LoaderBatches(train_set, seed=config.seed, dtype=dtype, batch_size=config.batch_size)
    else:
        sampler = BatchSampler(train_set, config.batch_size, seed=config.seed, shuffle=config.shuffle)
    if config.steps is not None and config.epochs is not None:
        raise ConfigError(f"give either {option('steps')} or {option('epochs')}, not both")
    if config.steps is not None:
        updates = config.steps
    else:
        updates = sampler.steps_for_epochs(config.epochs if config.epochs is not None else 1.0)
    if updates < 1:
        raise ConfigError(f"the run must make at least one update; got {updates} ({option('steps')} / "
                          f"{option('epochs')})")

    compensation = (config.compensation or "none").replace(" ", "")
    policy = config.policy
    if "lwp" in compensation.split("+") and policy is None:
        policy = "predict"
    drains, extension = scheduling.drains_of(config, name, updates)
    schedule = scheduling.run_schedule(config, name, stages, units, updates, policy, drains)
    recompute = recompute_stages(config.recompute, schedule.num_stages)
    scheduling.check_pauses(config, schedule, units, updates)
    if schedule.policy in ("latest", "predict") or name == "pb":
        refuse_batchnorm(model, context=f"the {name} schedule with the {schedule.policy} version policy")

    delays = staleness(schedule)
    per_update = units_per_update(schedule)
    grad_scales = [per_update[-1] / u for u in per_update]
    tied = TiedGradients(staged.tied, schedule, grad_scales)  # refuses versioned schedules
    run = Run(
        config=config, train_set=train_set, test_set=test_set, model=model, staged=staged, schedule=schedule,
        layout=layout, sampler=sampler, loss_fn=parts.loss_fn, delays=delays, grad_scales=grad_scales,
        updates=updates, dtype=dtype, optimizer_factory=parts.optimizer, tied=tied if tied else None,
        stage_choice=stage_choice, stage_costs=stage_costs, schedule_choice=choice, device=device, recompute=recompute, init=init, on_meta=on_meta,
        data_note="; ".join(filter(None, [
            "data: batches fed by step()" if getattr(train_set, "fed_by_step", False)
            else f"data: {_samples(train_set)}, read {reading}", parts.data_note, extension])),
        drains=drains,
    )
    run.stage_optimizer(0)  # a bad optimizer (or --compensation) fails here, before any work
    check_data(run)  # the first training microbatch and held-out batch through the stages, on meta
    return run


def _initialiser(model: nn.Module, init: Init | None) -> tuple[Init | None, bool]:
    """``(Init or None, whether the model is on meta)``: the run's initialiser, checked against the model
    (a meta model needs one; reset and functions initialise meta models only; a weights
    directory is opened here, once, and must hold every tensor of the model, with its shape)."""
    on_meta = has_meta(model)
    if init is None:
        if on_meta:
            materialize(model, model, None, seed=0)  # raises the message that says what to give
        return None, False
    if init.kind == "weights":
        init = opened(init)
        check_against(init.weights, model)
    elif not on_meta:
        raise ConfigError(
            f"{option('init', init.given)} gives the first values of a "
            f"model built on the meta device, but this model has values already: build it under "
            f"torch.device('meta') (on the command line: `pipetrain train --init meta`), or drop {option('init')} to "
            f"train it as it is"
        )
    return init, on_meta


def _check_batch_size(config: TrainConfig, train_set: Any) -> None:
    """Refuse an update larger than the data set it samples (it would hold samples twice): a
    ``DataLoader``'s batches are its own, and a run fed by ``step()`` has no data set."""
    if isinstance(train_set, DataLoader) or getattr(train_set, "fed_by_step", False):
        return
    try:
        samples = len(train_set)
    except TypeError:
        return
    if config.batch_size > samples:
        raise ConfigError(
            f"{option('batch_size', config.batch_size)} is more than the {samples} training samples: every update "
            f"would read the data {config.batch_size / samples:.3g} times over, holding each sample more than once; "
            f"use {option('batch_size', samples)} or less, or more data"
        )


def _samples(data: Any) -> str:
    """How much training data there is, in words: a data set's samples, a DataLoader's batches (its
    data set's items may be samples or whole batches: a loader with ``batch_size=None``)."""
    unit = "batches" if isinstance(data, DataLoader) else "samples"
    try:
        return f"{len(data)} {unit}"
    except TypeError:
        return f"a stream of {unit}"


def _model_dtype(model: nn.Module) -> torch.dtype:
    """The floating dtype of the model's parameters (inputs are cast to it), float32 if none."""
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.float32
