"""Set-up of a training run, identical on every executor and every rank.

From a :class:`TrainConfig`: the data and the fixed batch order, the model (initialised under the
seed) cut into stages, the schedule of the whole run (versions assigned, validated), the optimizer
of each stage (with the schedule's delays for SC and LWP), and the mapping from units to samples.
Every rank of the distributed runtime calls :func:`prepare` with the same configuration and gets
the same run; it then builds executors only for the stages it holds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from pipetrain.errors import ConfigError, option, written
from pipetrain.execution import StageExecutor, TiedGradients, UnitData, UnitLayout
from pipetrain.execution.failures import StageNames
from pipetrain.runtime.errors import CheckpointMismatchError, collective
from pipetrain.schedule import ASYNCHRONOUS, Schedule, build, check, resolve_name, staleness, units_per_update
from pipetrain.plan.choose import is_auto
from pipetrain.schedule.presets import LOOPED, V_SHAPED, check_chunks, chunks_per_rank
from pipetrain.schedule.vshape import V_SCHEDULES, check_v_parameters
from pipetrain.schedule.drains import drained
from pipetrain.schedule.recompute import recompute_stages
from pipetrain.training.config import TrainConfig
from pipetrain.training.parts import RunParts
from pipetrain.training.validate import loss_scale_of

__all__ = ["Run", "prepare", "plan_recompute", "ranks_of_balance", "EXECUTORS", "AUTOCAST"]

EXECUTORS = ("distributed", "emulate")
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: ``--precision``: the dtype each stage's forward autocasts to (fp16 with a loss scale)
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Run:
    """A prepared training run (see the module docstring)."""

    config: TrainConfig
    train_set: Dataset
    test_set: Dataset | None
    model: nn.Module
    staged: Any  # pipetrain.stages.StagedModel
    schedule: Schedule
    layout: UnitLayout
    sampler: Any  # pipetrain.data.BatchSampler (a LoaderBatches when the data is a DataLoader)
    loss_fn: Callable[[Any, Tensor], Tensor]
    delays: list[int]
    grad_scales: list[float]
    updates: int
    dtype: torch.dtype
    optimizer_factory: Any = None  # see RunParts.optimizer
    tied: TiedGradients | None = None  # where stages sharing a parameter sum its gradient (None: none shared)
    stage_choice: Any = None  # pipetrain.stages.StageChoice: how the stages were chosen, their sizes and times
    stage_costs: dict[str, float] | None = None  # measured seconds per unit that cut the model by time (None: not by time)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this process's stages compute
    _cuts: dict = field(default_factory=dict, repr=False)  # step -> cut, see cut_after
    _messages: Any = field(default=None, repr=False)  # the schedule's schedule.messages.Messages
    data_note: str = ""  # one line: the training samples, how they are read, where the held-out data comes from
    recompute: frozenset[int] = frozenset()  # the stages that recompute their activations (--recompute, the plan)
    drains: tuple[int, ...] = ()  # updates after which the pipeline drains and fills again (--extend)
    init: Any = None  # pipetrain.stages.materialize.Init: first values of the stages of a model built on meta
    meta: bool = False  # the model was built on the meta device: each rank materialises its own stages
    schedule_choice: Any = None  # pipetrain.plan.choose.AutoChoice: how schedule "auto" chose (None: named)

    @property
    def gathers_weights(self) -> bool:
        """Whether rank 0 gathers every stage's trained weights at the end: for a model every rank
        holds whole anyway, or for a one-file ``--save``; a model built on meta is never gathered
        otherwise (each rank's model holds its own stages, ``--save DIR`` is written by stage)."""
        from pipetrain.paths import is_weights_dir

        return not self.meta or bool(self.config.save and not is_weights_dir(self.config.save))

    @property
    def num_stages(self) -> int:
        return self.schedule.num_stages

    @property
    def samples_per_update(self) -> int:
        return self.layout.batch_size

    def evaluation_steps(self) -> list[int]:
        """Updates after which ``--eval-every K`` evaluates (every K-th, and always the last)."""
        every = self.config.eval_every
        if not every:
            return []
        steps = list(range(every, self.updates, every))
        return steps + [self.updates]

    def cut_after(self, step: int):
        """Where each rank pauses after ``step`` updates (for an evaluation or a checkpoint): a
        consistent cut, computed once per step."""
        return self.cuts_after([step])[0]

    def cuts_after(self, steps: list[int]) -> list:
        """:meth:`cut_after` for many steps, those not yet known computed in one pass."""
        missing = sorted({step for step in steps if step not in self._cuts})
        if missing:
            from pipetrain.schedule.cuts import cuts

            units = self.layout.units_per_update
            for step, found in zip(missing, cuts(self.schedule, [s * units for s in missing], self.messages)):
                self._cuts[step] = found
        return [self._cuts[step] for step in steps]

    @property
    def messages(self):
        """Where each message of the schedule is sent and received
        (:class:`~pipetrain.schedule.messages.Messages`), built once per run."""
        if self._messages is None:
            from pipetrain.schedule.messages import Messages

            self._messages = Messages(self.schedule)
        return self._messages

    def unit_data(self, prefetch: Sequence[int] | None = None) -> UnitData:
        """The run's training data by unit; ``prefetch``: the updates the caller reads, in order
        (default: every update of the run), read ahead as :class:`~pipetrain.data.DatasetBatches`
        says (background thread, or DataLoader worker processes under per-update seeds)."""
        from pipetrain.data import DatasetBatches, LoaderBatches

        if isinstance(self.sampler, LoaderBatches):  # a DataLoader as the data: read in its own order
            return UnitData.of(self.sampler, self.layout)
        batches = DatasetBatches(
            self.train_set, self.sampler.indices, seed=self.config.seed,
            order=range(self.updates) if prefetch is None else prefetch,
            workers=self.config.data_workers, pin_memory=self.config.pin_memory or self.device.type == "cuda",
            dtype=self.dtype,
        )
        return UnitData.of(batches, self.layout)

    def stage_optimizer(self, stage: int):
        """A new optimizer for a replica of ``stage``: the parts' factory, or ``--optimizer``'s spec
        (with ``--compensation`` and ``--lr-schedule``), given the stage's delay."""
        if self.optimizer_factory is not None:
            return self.optimizer_factory(stage, self.delays[stage])
        from pipetrain.optim import build_stage_optimizer

        config = self.config
        return build_stage_optimizer(
            config.optimizer, stage_delay=self.delays[stage], compensation=(config.compensation or "none"),
            lr_schedule=config.lr_schedule,
        )

    def make_executor(self, rank: int, stage: int) -> StageExecutor:
        """The executor of ``stage``'s replica on ``rank`` (replicas beyond the first get copies).

        A stage of a model built on the meta device is materialised here, on the rank that runs it
        (:mod:`pipetrain.stages.materialize`): its executor then holds the only copy of its weights."""
        replica = self.schedule.replica_of(rank, stage)
        module = self.staged.stages[stage]
        made = self.materialize(stage)
        own = frozenset()
        if made is not None:  # the executor's alone, but for parameters another stage holds too (tied)
            fresh, tied = {id(t) for t in made.made}, self._tied_names(stage)
            own = frozenset(n for n, p in module.named_parameters() if id(p) in fresh and n not in tied)
        if replica > 0:
            module = copy.deepcopy(module)  # a copy of its own (the weights the first replica starts from)
            if made is not None and made.made:
                made.release()  # this rank runs the copy only: the model's stage goes back to meta
                own = frozenset(n for n, _ in module.named_parameters() if n not in self._tied_names(stage))
        module.to(self.device)  # the first replica's parameters stay those of the model (moved with them)
        return StageExecutor(
            stage,
            module,
            self.stage_optimizer(stage),
            loss_fn=self.loss_fn if stage == self.num_stages - 1 else None,
            policy=self.schedule.policy,
            grad_scale=self.grad_scales[stage],
            seed=self.config.seed,
            nonfinite=self.config.on_nonfinite,
            recompute=stage in self.recompute,
            autocast=AUTOCAST[self.config.precision],
            device=self.device,
            scaler=loss_scale_of(self.config),
            units_per_update=self.layout.units_per_update,
            own_weights=own,
            update_in_backward=self._updates_in_backward(stage),
            names=StageNames.of(self.schedule),
        )

    def _updates_in_backward(self, stage: int) -> bool:
        """Whether ``stage`` may make each update during its backward (one microbatch per update on
        one weight version, no replicas, no parameter shared with another stage:
        :mod:`pipetrain.execution.update_in_backward`)."""
        return (self.schedule.policy == "flush" and self.layout.units_per_update == 1
                and len(self.schedule.stage_ranks[stage]) == 1 and not self._tied_names(stage))

    def _tied_names(self, stage: int) -> set[str]:
        return {name for t in self.staged.tied for s, name in t.holders if s == stage}

    def materialize(self, stage: int):
        """Give ``stage``'s meta tensors (stage 0: also those of modules ``forward`` never calls)
        real ones with their first values, or with a weights directory as ``init``, load its
        values into an eagerly built stage; returns the
        :class:`~pipetrain.stages.materialize.Materialized` record (``None``: nothing to do)."""
        if self.init is None:
            return None
        from pipetrain.stages.materialize import materialize

        unused = list(self.staged.unused) if stage == 0 else []
        made = materialize(self.model, self.staged.stages[stage], self.init, seed=self.config.seed, keys=unused)
        if unused:
            state = self.model.state_dict(keep_vars=True)
            self.staged.unused.update({key: state[key].detach() for key in unused})
        return made

    def make_executors(self, ranks: list[int] | None = None) -> list[dict[int, StageExecutor]]:
        """``executors[rank][stage]`` for the given ranks (default: all; others stay empty)."""
        wanted = set(range(self.schedule.num_ranks) if ranks is None else ranks)
        held = self.schedule.rank_stages()
        return [
            {stage: self.make_executor(rank, stage) for stage in held[rank]} if rank in wanted else {}
            for rank in range(self.schedule.num_ranks)
        ]


def _stage_count(config: TrainConfig, name: str) -> int:
    if config.replicas:
        if config.stages is not None and config.stages != len(config.replicas):
            raise ConfigError(f"{option('replicas', config.replicas)} gives {len(config.replicas)} stages but "
                              f"{option('stages', config.stages)}")
        stages = len(config.replicas)
    elif config.stages is not None:
        stages = config.stages
    elif config.balance:
        stages = len(config.balance)
    elif config.split_at:
        stages = len(config.split_at) + 1
    else:
        stages = config.workers or 2
    chunked = name in LOOPED or name in V_SHAPED or name == "zb-auto"
    if chunked and config.balance and not config.replicas and len(config.balance) != stages * chunks_per_rank(
            name, stages, _units_per_update(config, name), config.chunks):
        stages = ranks_of_balance(config, name, len(config.balance))  # the balance lists every chunk
    workers = (sum(config.replicas) if config.replicas else stages)
    if config.workers is not None and config.workers != workers:
        raise ConfigError(
            f"{option('workers', config.workers)} does not match the plan: {stages} stages"
            + (f" with replicas {config.replicas}" if config.replicas else "")
            + f" use {workers} workers; change {option('workers')} or {option('stages')}/{option('replicas')}"
        )
    return stages


def ranks_of_balance(config: TrainConfig, name: str, pieces: int) -> int:
    """The ranks that a cut into ``pieces`` stages fills: fewer where each rank holds several
    chunks (interleaved, the V schedules, zb-auto when it picks a V)."""
    if name == "zb-auto":
        units = _units_per_update(config, name)
        if chunks_per_rank(name, pieces, units) == 1:
            return pieces
        if pieces % 2 == 0 and chunks_per_rank(name, pieces // 2, units) == 2:
            return pieces // 2
        raise ConfigError(f"zb-auto cannot tell from {option('balance', config.balance)} how many ranks to use; "
                          f"give {option('stages')} (ranks)")
    per_rank = chunks_per_rank(name, pieces, 1, config.chunks)
    return max(pieces // per_rank, 1)


def apply_plan(config: TrainConfig) -> TrainConfig:
    """Fill stages, replicas, schedule and microbatches from a `pipetrain plan` JSON file (of a chunked
    schedule: ranks, and the looped schedules' chunks per rank)."""
    from dataclasses import replace

    from pipetrain.training.validate import read_plan

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
    from pipetrain.schedule.recompute import format_recompute

    stages = plan.get("stages", [])
    return format_recompute([s for s, stage in enumerate(stages) if stage.get("recompute")], len(stages))


def _check_auto(config: TrainConfig) -> None:
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


def _choose_auto(config: TrainConfig, model: nn.Module, ranks: int, train_set: Dataset, dtype: torch.dtype,
                 loss_fn: Callable[[Any, Tensor], Tensor], init: Any, costs: dict[str, float] | None):
    """``(config naming the chosen schedule, its AutoChoice, unit costs)`` for ``schedule="auto"``
    (:mod:`pipetrain.plan.choose`). Units are priced as the run will cut them: by measured time
    (each unit timed once; the cut then reuses those times, and the launcher hands them to the
    workers, which choose alike), else by parameter count. The looped schedules get 2 chunks."""
    from dataclasses import replace

    from pipetrain.plan.choose import choose_schedule, parse_auto
    from pipetrain.stages import unit_names
    from pipetrain.stages.balance import cost_order, unit_pieces

    trace = dict(leaf_modules=list(config.leaf_modules or ()), concrete_args=config.concrete_args)
    pieces = 2 * ranks if len(unit_names(model, 2 * ranks, **trace)) >= 2 * ranks else ranks
    by, _ = _balance_by(config, "1f1b", model, pieces)
    if by == "time" and pieces > 1:
        _, _, costs = _cut(config, model, "1f1b", pieces, train_set, dtype, loss_fn, init, costs)
        assert costs is not None  # a cut by time returns its unit times
        values = [costs[unit] for unit in cost_order(model, costs, trace)]
        how = "measured unit times"
    else:
        _, units = unit_pieces(model, pieces, **trace)
        values = [float(sum(p.numel() for p in stage.parameters())) for stage in units.stages]
        how = "unit parameter counts"
    choice = choose_schedule(values, ranks, _units_per_update(config, "1f1b"), memory=parse_auto(config.schedule))
    choice.priced_by = how
    chunks = choice.chunks if choice.schedule in LOOPED else 1
    return replace(config, schedule=choice.schedule, chunks=chunks), choice, costs


def _check_pauses(config: TrainConfig, schedule: Schedule, units: int, updates: int) -> None:
    """Refuse --eval-every/--checkpoint-every values whose pauses would split an update that the
    replicas of a stage make together (asynchronous schedules with replicas)."""
    every = {"eval_every": config.eval_every, "checkpoint_every": config.checkpoint_every}
    if not any(every.values()) or all(len(ranks) < 2 for ranks in schedule.stage_ranks):
        return
    from pipetrain.schedule.cuts import split_counts

    split = split_counts(schedule)

    def fits(period: int) -> bool:
        return all(step * units not in split for step in range(period, updates, period))

    for name, period in every.items():
        if period and not fits(period):
            better = next(p for p in range(period + 1, updates + 1) if fits(p))
            raise ConfigError(
                f"{option(name, period)} would pause the run in the middle of an update that the replicas of a "
                f"stage make together (replicas {list(schedule.replicas)}); use for example {option(name, better)}"
            )


def _units_per_update(config: TrainConfig, name: str) -> int:
    """Microbatches per update: ``--microbatches``, else 1 for pipedream and pb, else up to 4."""
    if config.microbatches is not None:
        return config.microbatches
    return 1 if name in ASYNCHRONOUS and name != "2bw" else min(4, config.batch_size)


BALANCE_BY = ("auto", "time", "params")


def _balance_by(config: TrainConfig, name: str, model: nn.Module, pieces: int) -> tuple[str, str]:
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
    from pipetrain.execution.recompute import STOCHASTIC as _STOCHASTIC

    if any(isinstance(m, _STOCHASTIC) and m.p > 0 and m.training for m in model.modules()):
        return "params", written(f"dropout masks depend on the cut; {option('balance_by', 'time')} to time it")
    params = [p for _, p in model.named_parameters(remove_duplicate=False)]
    if len({id(p) for p in params}) < len(params) and not _ties_fixed_by_any_cut(config, model, pieces):
        return "params", written(f"tied weights add in an order set by the cut; {option('balance_by', 'time')} to time it")
    return "time", ""


def _ties_fixed_by_any_cut(config: TrainConfig, model: nn.Module, pieces: int) -> bool:
    """Whether every shared parameter is used by the first unit and the last only (an input
    embedding and the LM head reusing it): every cut then gives it to the first and the last stage,
    which sum its gradient in the same order."""
    from pipetrain.stages import unit_pieces

    names, units = unit_pieces(model, pieces, leaf_modules=list(config.leaf_modules or ()),
                               concrete_args=config.concrete_args)
    return all(set(t.stages) <= {0, len(names) - 1} for t in units.tied)


def _cut(config: TrainConfig, model: nn.Module, name: str, pieces: int, train_set: Dataset, dtype: torch.dtype,
         loss_fn: Callable[[Any, Tensor], Tensor], init: Any = None, costs: dict[str, float] | None = None):
    """The stages, the record of how they were chosen, and the measured seconds per unit when the
    split balanced time (None otherwise). ``costs``: unit times measured before (by the launcher,
    so that worker processes cut alike; or by the run being resumed), used instead of timing. A
    model built on meta is timed one unit at a time, each materialised with ``init`` and freed."""
    from pipetrain.execution.unit_timing import split_by_time
    from pipetrain.stages import StageChoice, split_model, unit_names

    trace = dict(leaf_modules=list(config.leaf_modules or ()), concrete_args=config.concrete_args)
    if config.balance:
        staged = split_model(model, balance=config.balance, **trace)
        return staged, StageChoice.of(staged, "--plan" if config.plan else "--balance", _names(model)), None
    if config.split_at:
        staged = split_model(model, split_at=config.split_at, **trace)
        return staged, StageChoice.of(staged, "--split-at", _names(model)), None
    by, why = _balance_by(config, name, model, pieces)
    if by == "params" or pieces == 1:
        staged = split_model(model, stages=pieces, **trace)
        names = unit_names(model, pieces, **trace) if staged.balance is not None else None
        return staged, StageChoice.of(staged, "parameter count", names, note=why), None
    costs = costs or _resumed_costs(config, model, trace)
    inputs = target = None
    if costs is None:
        inputs, target = _first_microbatch(config, name, train_set, dtype)
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


def _names(model: nn.Module) -> list[str] | None:
    from pipetrain.stages.split import declared_units

    declared = declared_units(model)
    if declared is not None:
        return [n for n, _ in declared]
    return [n for n, _ in model.named_children()] if isinstance(model, nn.Sequential) else None


def _first_microbatch(config: TrainConfig, name: str, train_set: Dataset, dtype: torch.dtype):
    """The inputs and targets of the run's first microbatch, read without touching any random state."""
    from pipetrain.data import BatchSampler, get_batch
    from pipetrain.structure import cast_floating, rows

    layout = UnitLayout(config.batch_size, max(_units_per_update(config, name), 1))
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


def _measured_once(split: Callable[[], tuple], model: nn.Module, pieces: int, trace: dict):
    """``split()`` in this process; under torch.distributed only rank 0 measures and every rank cuts
    by its unit times (ranks measuring each for itself could cut differently)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return split()
    from pipetrain.execution.unit_timing import split_by_time

    shared: list[Any] = [None]
    if dist.get_rank() == 0:
        staged, choice = split()
        shared[0] = choice.unit_seconds
    collective("sharing the measured unit times", lambda: dist.broadcast_object_list(shared, src=0))
    if dist.get_rank() == 0:
        return staged, choice
    return split_by_time(model, pieces, None, None, None, costs=shared[0], **trace)  # type: ignore[arg-type]


def _resumed(config: TrainConfig):
    """The checkpoint the run will resume (None: afresh, or none usable), read before the run is
    built: the named checkpoint, or the newest one in ``--checkpoint-dir`` (which a run with that
    option alone resumes). The runtime chooses again, and reports, when it resumes."""
    if not config.resume and not config.checkpoint_dir:
        return None
    from pipetrain.runtime.checkpoint import find_latest, resolve

    try:
        if isinstance(config.resume, str):
            return resolve(config.resume)
        if config.resume:
            return resolve(config.checkpoint_dir or "")
        return find_latest(config.checkpoint_dir, verify=False, skipped=[])  # the runtime warns
    except Exception:  # noqa: BLE001 - no usable checkpoint: the runtime reports it when it resumes
        return None


def _resumed_costs(config: TrainConfig, model: nn.Module, trace: dict[str, Any]) -> dict[str, float] | None:
    """The unit times of the run being resumed (its checkpoint's fingerprint), so that it is cut
    as before; a checkpoint of another model is refused as such (its times name other modules)."""
    from pipetrain.runtime.checkpoint import MANIFEST
    from pipetrain.stages.balance import cost_order

    checkpoint = _resumed(config)
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


def _drains(config: TrainConfig, name: str, updates: int) -> tuple[tuple[int, ...], str]:
    """The updates after which an asynchronous run drains its pipeline (see
    :mod:`pipetrain.schedule.drains`), and what the data line says of them. With ``--extend``:
    where the run being continued drained (its checkpoint's own drains and its end, when this run
    is longer); else ``config.drain_at``."""
    if name not in ASYNCHRONOUS:
        return (), ""  # a synchronous schedule drains after every update anyway
    if not config.extend:
        return tuple(config.drain_at), ""
    checkpoint = _resumed(config)
    if checkpoint is None:
        return (), ""
    drains = [int(d) for d in checkpoint.meta.get("drains", [])]
    old = int(checkpoint.meta.get("updates", checkpoint.step))
    if old < updates:
        drains.append(old)
    if not drains:
        return (), ""
    at = ", ".join(map(str, drains))
    return tuple(drains), (f"extends the run of {checkpoint.path}: its pipeline drained after update{'s' * (len(drains) > 1)} "
                           f"{at}, so this is not the uninterrupted {updates}-update run")


def prepare(config: TrainConfig, parts: RunParts | None = None, *, stage_costs: dict[str, float] | None = None) -> Run:
    """Build everything the run needs from ``config`` and its ``parts`` (deterministic); without
    ``parts``, they are built from the configuration's specs (the command line). ``stage_costs``:
    seconds per unit measured before (the launcher's, handed to its workers), so that a split by
    time cuts as it did there instead of timing again; the run's own are ``Run.stage_costs``."""
    from pipetrain.data import BatchSampler, LoaderBatches
    from pipetrain.data.batches import describe_reading, resolve_workers
    from pipetrain.models import refuse_batchnorm
    from pipetrain.training.parts import parts_from_config

    from pipetrain.training.validate import check_execution

    from pipetrain.execution.device import resolve_device

    config = apply_plan(config)
    check_execution(config)
    device = resolve_device(config.device)
    auto = is_auto(config.schedule)
    if auto:
        _check_auto(config)
    name = "1f1b" if auto else resolve_name(config.schedule)  # auto: chosen once the model is there
    if config.executor not in EXECUTORS:
        raise ConfigError(f"unknown executor {config.executor!r}; choose one of {', '.join(EXECUTORS)}")
    if config.dtype is not None and config.dtype not in _DTYPES:
        raise ConfigError(f"unknown {option('dtype')} {config.dtype!r}; choose float32 or float64")
    if config.batch_size < 1:
        raise ConfigError(f"{option('batch_size')} must be at least 1, got {config.batch_size}")
    stages = _stage_count(config, name)

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
    init, meta = _initialiser(model, parts.init if parts.init is not None else config.init)
    choice = parts.schedule_choice
    if auto:
        config, choice, stage_costs = _choose_auto(config, model, stages, train_set, dtype, parts.loss_fn, init,
                                                   stage_costs)
        name = config.schedule

    check_chunks(name, config.chunks)
    if name in V_SCHEDULES:  # before the cut, which may time the model
        check_v_parameters(name, stages, _units_per_update(config, name), config.replicas)
    per_rank = chunks_per_rank(name, stages, _units_per_update(config, name), config.chunks)
    pieces = stages * per_rank
    if per_rank > 1 and parts.staged is None and isinstance(model, nn.Sequential) and pieces > len(model):
        raise ConfigError(
            f"the {name} schedule cuts the model into {per_rank} chunks per rank, {pieces} stages for {stages} ranks, "
            f"but it has {len(model)} top-level modules: use {option('stages', max(len(model) // per_rank, 1))} "
            f"or fewer (ranks), or a deeper model")
    if parts.staged is not None:
        staged = parts.staged
        from pipetrain.stages import StageChoice

        stage_choice = parts.stage_choice or StageChoice.of(staged, "the caller's cut", _names(model))
        stage_costs = None
    else:
        if config.balance and config.plan and isinstance(model, nn.Sequential) and sum(config.balance) != len(model):
            raise ConfigError(
                f"plan {config.plan!r} cuts {sum(config.balance)} layers but the model {config.model!r} has "
                f"{len(model)}; make the plan from a profile of this model (pipetrain profile --model ...)"
            )
        staged, stage_choice, stage_costs = _cut(config, model, name, pieces, train_set, dtype, parts.loss_fn, init,
                                                 stage_costs)
    if len(staged.stages) != pieces:
        raise ConfigError(
            f"the model was cut into {len(staged.stages)} stages but the {name} schedule needs {pieces}"
            + (f" ({stages} ranks x {per_rank} chunks)" if per_rank > 1 else "")
        )

    asynchronous = name in ASYNCHRONOUS and name != "2bw"
    units = _units_per_update(config, name)
    if units < 1:
        raise ConfigError(f"{option('microbatches')} must be at least 1, got {units}")
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
    if asynchronous and config.replicas:
        from math import lcm

        group = lcm(*config.replicas)
        if (updates * units) % group:
            fixed = -(-updates * units // group) * group // units
            raise ConfigError(
                f"with replicas {config.replicas} the {name} units ({updates} steps x {units}) must divide evenly "
                f"among the replicas of every stage (a multiple of {group}); use {option('steps', fixed)}"
            )

    def schedule_of(count: int) -> Schedule:
        if asynchronous:
            return build(name, stages, count * units, replicas=config.replicas, policy=policy, update_every=units,
                         pattern=True)
        return build(name, stages, units, steps=count, chunks=config.chunks, replicas=config.replicas, policy=policy,
                     pattern=True)

    drains, extension = _drains(config, name, updates)
    schedule = drained(schedule_of, updates, drains, units, asynchronous) if drains else schedule_of(updates)
    check(schedule)
    recompute = recompute_stages(config.recompute, schedule.num_stages)
    _check_pauses(config, schedule, units, updates)
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
        stage_choice=stage_choice, stage_costs=stage_costs, schedule_choice=choice, device=device, recompute=recompute, init=init, meta=meta,
        data_note="; ".join(filter(None, [
            "data: batches fed by step()" if getattr(train_set, "fed_by_step", False)
            else f"data: {_samples(train_set)}, read {reading}", parts.data_note, extension])),
        drains=drains,
    )
    run.stage_optimizer(0)  # a bad optimizer (or --compensation) fails here, before any work
    from pipetrain.training.shapes import check_data

    check_data(run)  # the first training microbatch and held-out batch through the stages, on meta
    return run


def _initialiser(model: nn.Module, init: Any):
    """``(Init or None, whether the model is on meta)``: the run's initialiser, checked against the model
    (a meta model needs one; reset and functions initialise meta models only; a weights
    directory must hold every tensor of the model, with its shape: its index and headers are read)."""
    from pipetrain.stages.materialize import has_meta, resolve_init

    resolved = resolve_init(init)
    meta = has_meta(model)
    if resolved is None:
        if meta:
            from pipetrain.stages.materialize import materialize

            materialize(model, model, None, seed=0)  # raises the message that says what to give
        return None, False
    if resolved.kind == "weights":
        from pipetrain.weights import check_against

        check_against(resolved.weights, model)
    elif not meta:
        raise ConfigError(
            f"{option('init', init if isinstance(init, str) else resolved.describe())} gives the first values of a "
            f"model built on the meta device, but this model has values already: build it under "
            f"torch.device('meta') (on the command line: `pipetrain train --init meta`), or drop {option('init')} to "
            f"train it as it is"
        )
    return resolved, meta


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
