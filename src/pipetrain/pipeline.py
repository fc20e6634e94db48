"""The Python entry point: train a model (or a list of stage modules) with any schedule.

>>> import torch, torch.nn as nn
>>> from pipetrain import Pipeline
>>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
>>> pipe = Pipeline(model, balance=[2, 1], schedule="1f1b", microbatches=4,
...                 optimizer="sgd:lr=0.1,momentum=0.9")
>>> x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
>>> losses = pipe.train([(x, y)] * 3)          # three updates of one 32-sample batch each
>>> len(losses)
3

``train`` runs the schedule on the single-process emulator, so the result is exactly what the
distributed runtime computes for the same schedule and seed; ``model`` holds the trained weights
afterwards.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from pipetrain.emulate.executor import Emulator
from pipetrain.errors import ConfigError
from pipetrain.execution import StageExecutor, TiedGradients, UnitData, UnitLayout
from pipetrain.schedule import ASYNCHRONOUS, Schedule, build, check, resolve_name, staleness, units_per_update

__all__ = ["Pipeline"]

OptimizerFactory = Callable[[int, int], Any]  # (stage, delay) -> StageOptimizer


class Pipeline:
    """A model cut into stages plus a schedule, trained with the emulator.

    Args:
        model: an ``nn.Sequential`` (cut by ``balance`` or into ``stages`` of near-equal parameter
            count), any ``nn.Module`` torch.fx can trace (cut at ``split_at`` module names, or into
            ``stages``), or a list of stage modules.
        schedule: gpipe, 1f1b, interleaved, zb-h1, pipedream, 2bw or pb.
        microbatches: units per update (microbatches per step; pipedream/pb: minibatches/samples
            accumulated per update, default 1).
        loss_fn: ``loss_fn(output, target)``, a mean over samples (default cross entropy).
        optimizer: an optimizer spec (``"sgd:lr=0.1,momentum=0.9"``, ``"adam:lr=1e-3"``) or a
            factory ``(stage, delay) -> StageOptimizer``.
        compensation: ``none``, ``sc``, ``lwp`` or ``sc+lwp`` (with a spec optimizer).
        replicas, chunks, policy: as for :func:`pipetrain.schedule.build`.
        leaf_modules, concrete_args: for models cut by tracing (see
            :func:`pipetrain.stages.trace_model`): modules called as a whole (qualified names,
            classes or class names) and values fixed for non-tensor ``forward`` arguments.

    A parameter that several stages share (tied weights) trains as one parameter on the
    synchronous schedules (its holders sum its gradient); the others refuse it.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        *,
        balance: Sequence[int] | None = None,
        stages: int | None = None,
        split_at: Sequence[str] | None = None,
        schedule: str = "1f1b",
        microbatches: int | None = None,
        loss_fn: Callable[[Any, Tensor], Tensor] | None = None,
        optimizer: str | OptimizerFactory = "sgd:lr=0.01",
        compensation: str = "none",
        replicas: Sequence[int] | None = None,
        chunks: int = 1,
        policy: str | None = None,
        seed: int = 0,
        leaf_modules: Sequence[str | type] = (),
        concrete_args: dict[str, Any] | None = None,
    ) -> None:
        from pipetrain.stages import split_model
        from pipetrain.models.loss import cross_entropy

        self.schedule_name = resolve_name(schedule)
        self.staged = split_model(
            model, stages=stages, balance=balance, split_at=split_at, leaf_modules=leaf_modules,
            concrete_args=concrete_args,
        )
        self.model = model
        asynchronous = self.schedule_name in ASYNCHRONOUS and self.schedule_name != "2bw"
        self.microbatches = microbatches if microbatches is not None else (1 if asynchronous else 4)
        self.loss_fn = loss_fn or cross_entropy
        self.optimizer = optimizer
        self.compensation = compensation
        self.replicas = list(replicas) if replicas else None
        self.chunks = chunks
        self.policy = policy
        self.seed = seed
        self._asynchronous = asynchronous
        self.last_schedule: Schedule | None = None
        if self.staged.tied:  # refuse a schedule that cannot keep tied copies equal, before any work
            TiedGradients(self.staged.tied, self._schedule(1))

    @property
    def stages(self) -> list[nn.Module]:
        return list(self.staged.stages)

    def _schedule(self, updates: int) -> Schedule:
        count = len(self.staged.stages) // (self.chunks if self.schedule_name == "interleaved" else 1)
        policy = self.policy
        if policy is None and "lwp" in self.compensation.split("+"):
            policy = "predict"
        if self._asynchronous:
            schedule = build(self.schedule_name, count, updates * self.microbatches, replicas=self.replicas,
                             policy=policy, update_every=self.microbatches)
        else:
            schedule = build(self.schedule_name, count, self.microbatches, steps=updates, chunks=self.chunks,
                             replicas=self.replicas, policy=policy)
        check(schedule)
        return schedule

    def _optimizer(self, stage: int, delay: int):
        if callable(self.optimizer):
            return self.optimizer(stage, delay)
        from pipetrain.optim import build_stage_optimizer

        return build_stage_optimizer(self.optimizer, stage_delay=delay, compensation=self.compensation)

    def train(self, batches: Sequence[tuple[Any, Tensor]]) -> list[float]:
        """One update per ``(inputs, targets)`` batch; returns each update's mean loss.

        Every batch must hold the same number of samples (the samples of one update).
        """
        batches = list(batches)
        if not batches:
            raise ConfigError("train() needs at least one (inputs, targets) batch")
        size = batches[0][1].shape[0]
        if any(b[1].shape[0] != size for b in batches):
            raise ConfigError("every batch passed to train() must hold the same number of samples")
        schedule = self._schedule(len(batches))
        self.last_schedule = schedule
        delays = staleness(schedule)
        per_update = units_per_update(schedule)
        executors: list[dict[int, StageExecutor]] = []
        import copy

        for rank, held in enumerate(schedule.rank_stages()):
            executors.append({})
            for stage in held:
                module = self.staged.stages[stage]
                if schedule.replica_of(rank, stage) > 0:
                    module = copy.deepcopy(module)
                executors[rank][stage] = StageExecutor(
                    stage, module, self._optimizer(stage, delays[stage]),
                    loss_fn=self.loss_fn if stage == schedule.num_stages - 1 else None,
                    policy=schedule.policy, grad_scale=per_update[-1] / per_update[stage], seed=self.seed,
                )
        layout = UnitLayout(size, self.microbatches)
        data = UnitData(None, layout, lambda update: update, lambda _dataset, update: batches[update])
        tied = TiedGradients(self.staged.tied, schedule, [per_update[-1] / u for u in per_update])
        losses = Emulator(schedule, executors, data, tied=tied).run()
        for stage, ranks in enumerate(schedule.stage_ranks):
            executors[ranks[0]][stage].write_back()
        units = self.microbatches
        return [
            sum(losses[k] * layout.loss_scale(k) for k in range(t * units, (t + 1) * units))
            for t in range(len(batches))
        ]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained weights under the unsplit model's keys."""
        return self.staged.merge_state_dict([stage.state_dict() for stage in self.staged.stages])
