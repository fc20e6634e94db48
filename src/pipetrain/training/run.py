"""A prepared training run: what :func:`pipetrain.training.setup.prepare` builds from a
configuration, the same on every executor and every rank, and what every executor asks of it
(the executor of each stage, the data by unit, the cuts where the run pauses)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from pipetrain.data import BatchSampler, DatasetBatches, LoaderBatches
from pipetrain.execution import StageExecutor, TiedGradients, UnitData, UnitLayout
from pipetrain.execution.failures import StageNames
from pipetrain.optim import build_stage_optimizer
from pipetrain.paths import is_weights_dir
from pipetrain.plan.choose import AutoChoice
from pipetrain.schedule import Schedule
from pipetrain.schedule.costs import Costs, load_calibration
from pipetrain.schedule.cuts import Cut, cuts
from pipetrain.schedule.messages import Messages
from pipetrain.stages import StageChoice, StagedModel
from pipetrain.initialiser import Init
from pipetrain.stages.materialize import Materialized, materialize
from pipetrain.training.config import TrainConfig
from pipetrain.training.parts import OptimizerFactory
from pipetrain.training.validate import loss_scale_of

__all__ = ["Run", "AUTOCAST"]

#: ``--precision``: the dtype each stage's forward autocasts to (fp16 with a loss scale)
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Run:
    """A prepared training run (see the module docstring)."""

    config: TrainConfig
    train_set: Dataset
    test_set: Dataset | None
    model: nn.Module
    staged: StagedModel
    schedule: Schedule
    layout: UnitLayout
    sampler: BatchSampler | LoaderBatches  # a LoaderBatches when the data is a DataLoader
    loss_fn: Callable[[Any, Tensor], Tensor]
    delays: list[int]
    grad_scales: list[float]
    updates: int
    dtype: torch.dtype
    optimizer_factory: OptimizerFactory | None = None  # see RunParts.optimizer
    tied: TiedGradients | None = None  # where stages sharing a parameter sum its gradient (None: none shared)
    stage_choice: StageChoice | None = None  # how the stages were chosen, their sizes and times
    stage_costs: dict[str, float] | None = None  # measured seconds per unit that cut the model by time (None: not by time)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where this process's stages compute
    _cuts: dict[int, Cut] = field(default_factory=dict, repr=False)  # step -> cut, see cut_after
    _messages: Messages | None = field(default=None, repr=False)  # the schedule's, see messages
    data_note: str = ""  # one line: the training samples, how they are read, where the held-out data comes from
    recompute: frozenset[int] = frozenset()  # the stages that recompute their activations (--recompute, the plan)
    drains: tuple[int, ...] = ()  # updates after which the pipeline drains and fills again (--extend)
    init: Init | None = None  # first values of the stages of a model built on meta
    on_meta: bool = False  # the model was built on the meta device: each rank materialises its own stages
    schedule_choice: AutoChoice | None = None  # how schedule "auto" chose (None: named)
    _calibration: tuple[str | None, Costs | None] = field(default=(None, None), repr=False)  # see calibration
    #: (the stages sized, each one's bytes of one microbatch): kept by
    #: :func:`pipetrain.training.shapes.microbatch_bytes`, which sizes them once
    microbatch_sizes: tuple[tuple[int, ...], list[Any]] | None = field(default=None, repr=False)

    @property
    def gathers_weights(self) -> bool:
        """Whether rank 0 gathers every stage's trained weights at the end: for a model every rank
        holds whole anyway, or for a one-file ``--save``; a model built on meta is never gathered
        otherwise (each rank's model holds its own stages, ``--save DIR`` is written by stage)."""
        return not self.on_meta or bool(self.config.save and not is_weights_dir(self.config.save))

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

    def cut_after(self, step: int) -> Cut:
        """Where each rank pauses after ``step`` updates (for an evaluation or a checkpoint): a
        consistent cut, computed once per step."""
        return self.cuts_after([step])[0]

    def cuts_after(self, steps: list[int]) -> list[Cut]:
        """:meth:`cut_after` for many steps, those not yet known computed in one pass."""
        missing = sorted({step for step in steps if step not in self._cuts})
        if missing:
            units = self.layout.units_per_update
            for step, found in zip(missing, cuts(self.schedule, [s * units for s in missing], self.messages)):
                self._cuts[step] = found
        return [self._cuts[step] for step in steps]

    @property
    def calibration(self) -> Costs | None:
        """The ``costs_file`` calibration (None without one), read once per file."""
        path, costs = self._calibration
        if path != self.config.costs_file:
            self._calibration = path, costs = self.config.costs_file, load_calibration(self.config.costs_file)
        return costs

    @property
    def messages(self) -> Messages:
        """Where each message of the schedule is sent and received
        (:class:`~pipetrain.schedule.messages.Messages`), built once per run."""
        if self._messages is None:
            self._messages = Messages(self.schedule)
        return self._messages

    def unit_data(self, prefetch: Sequence[int] | None = None) -> UnitData:
        """The run's training data by unit; ``prefetch``: the updates the caller reads, in order
        (default: every update of the run), read ahead as :class:`~pipetrain.data.DatasetBatches`
        says (background thread, or DataLoader worker processes under per-update seeds)."""
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
            update_in_backward=self.updates_in_backward(stage),
            names=StageNames.of(self.schedule),
        )

    def updates_in_backward(self, stage: int) -> bool:
        """Whether ``stage`` may make each update during its backward (one microbatch per update on
        one weight version, no replicas, no parameter shared with another stage:
        :mod:`pipetrain.execution.update_in_backward`)."""
        return (self.schedule.policy == "flush" and self.layout.units_per_update == 1
                and len(self.schedule.stage_ranks[stage]) == 1 and not self._tied_names(stage))

    def _tied_names(self, stage: int) -> set[str]:
        return {name for t in self.staged.tied for s, name in t.holders if s == stage}

    def materialize(self, stage: int) -> Materialized | None:
        """Give ``stage``'s meta tensors (stage 0: also those of modules ``forward`` never calls)
        real ones with their first values, or with a weights directory as ``init``, load its
        values into an eagerly built stage; returns the
        :class:`~pipetrain.stages.materialize.Materialized` record (``None``: nothing to do)."""
        if self.init is None:
            return None
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
