"""Tied parameters at work: the stages that share a parameter sum its gradient before they update.

Each stage executor holds its own copy of a parameter that several stages use (an LM head tied to
the input embedding), see :mod:`pipetrain.stages.tied`. On a synchronous schedule the copies start
equal, and before the n-th STEP of its stages every holder replaces its accumulated gradient of
the shared parameter by the sum over the holders (from the last stage to the first, the order in
which one process's backward reaches the uses, after each stage's replicas have summed theirs with
SYNC). Every copy then takes the same update from the same optimizer state, so
the copies stay bitwise equal and training is plain tied training, as Megatron does for its tied
embeddings. Only the order of additions differs from one process: plain PyTorch adds the uses'
gradients per microbatch and then accumulates, the pipeline accumulates per stage and then adds,
which rounds alike with one microbatch per step (for any number of uses: T5's embedding has three)
and to within float tolerance otherwise.

Where a rank sums: at the first STEP of step n of any holder stage it holds (that stage's
gradient is final there, and so is every other holder stage's on that rank: checked). The
emulator meets the other holders there (a rendezvous); the runtime broadcasts each holder's
gradient from its first replica's rank in a process group of the ranks that hold the parameter
(every rank creates the groups in the same order, :func:`pipetrain.runtime.rank_runner.sync_groups`),
and every rank adds the parts in the same order, as the emulator does, so both give the same bits.

Schedules with several weight versions per stage (pipedream, 2bw, pb, any policy but ``flush``)
are refused: the copies would be read at different versions and diverge.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import Tensor

from pipetrain.errors import ConfigError
from pipetrain.execution.stage import StageExecutor
from pipetrain.schedule.ir import Kind, Schedule, halves
from pipetrain.schedule.pattern import pattern_of
from pipetrain.schedule.presets import ASYNCHRONOUS
from pipetrain.stages.tied import TiedParameter, refuse_tied

__all__ = ["TiedGradients", "gradient_of", "tied_sum"]

_CHANGES_GRADIENT = frozenset({Kind.B, Kind.W, Kind.SYNC})


def tied_sum(parts: Sequence[Tensor]) -> Tensor:
    """The sum of ``parts`` in order, in a new tensor (the same arithmetic on every executor)."""
    total = parts[0].clone()
    for part in parts[1:]:
        total.add_(part)
    return total


class TiedGradients:
    """Where each rank sums the gradients of the shared parameters, and who takes part.

    Args:
        tied: the shared parameters (:attr:`StagedModel.tied <pipetrain.stages.StagedModel.tied>`);
            frozen ones need nothing and are left out.
        schedule: the run's schedule; refused (ConfigError naming the parameter and its stages)
            unless it is synchronous with one weight version.
        grad_scales: per stage, the factor each update applies to its gradient; the holders of a
            parameter must agree.

    Attributes:
        tied: the trainable shared parameters, by index.
        ranks: ``ranks[t]``, the ranks that hold a replica of a holder of parameter ``t``.
        sources: ``sources[t]``, per holder in stage order ``(stage, name, rank)``: the rank of the
            holder's first replica, whose (replica-summed) gradient is that holder's part.
    """

    def __init__(self, tied: Sequence[TiedParameter], schedule: Schedule, grad_scales: Sequence[float] = ()) -> None:
        self.tied = [t for t in tied if t.trainable]
        name = schedule.name
        if name in ASYNCHRONOUS or schedule.policy != "flush":
            refuse_tied(
                self.tied,
                f"the {name} schedule (version policy {schedule.policy}) keeps several weight versions per stage "
                f"and updates its stages at different times",
            )
        for t in self.tied:
            scales = {grad_scales[s] for s in t.stages} if grad_scales else set()
            if len(scales) > 1:
                raise ConfigError(
                    f"the stages sharing parameter {t.describe()} scale their updates differently "
                    f"({sorted(scales)}); give them the same replicas"
                )
        # a long schedule's pattern repeats where the holders sum: read off its sample
        self._pattern = pattern_of(schedule) if self.tied else None
        self.schedule = schedule if self._pattern is None else self._pattern.sample
        self._updates = [self._update_count(t) for t in self.tied]
        self.ranks = [sorted({r for s in t.stages for r in schedule.stage_ranks[s]}) for t in self.tied]
        self.sources = [[(s, n, schedule.stage_ranks[s][0]) for s, n in t.holders] for t in self.tied]
        self._due = [self._points(rank) if self.tied else {} for rank in range(schedule.num_ranks)]
        self.schedule = schedule

    def __bool__(self) -> bool:
        return bool(self.tied)

    def _update_count(self, tie: TiedParameter) -> int:
        """The number of STEPs every holder of ``tie`` makes (refused unless they agree)."""
        schedule = self.schedule
        counts = {
            sum(1 for a in schedule.programs[schedule.stage_ranks[s][0]] if a.kind is Kind.STEP and a.stage == s)
            for s in tie.stages
        }
        if len(counts) != 1:
            raise ConfigError(
                f"the stages sharing parameter {tie.describe()} make different numbers of updates in this "
                f"schedule; tied parameters need every holder to update once per step"
            )
        return counts.pop()

    def _points(self, rank: int) -> dict[int, list[tuple[int, int]]]:
        """Position -> ``[(parameter, occurrence)]`` summed there by ``rank``, checked to be a place
        where the gradients of every holder stage on this rank are final."""
        program = self.schedule.programs[rank]
        steps: dict[int, list[int]] = {}  # stage -> positions of its STEPs
        for position, action in enumerate(program):
            if action.kind is Kind.STEP:
                steps.setdefault(action.stage, []).append(position)
        due: dict[int, list[tuple[int, int]]] = {}
        for t, tie in enumerate(self.tied):
            mine = [s for s in dict.fromkeys(tie.stages) if rank in self.schedule.stage_ranks[s]]
            if not mine:
                continue
            for n in range(self._updates[t]):
                at = min(steps[s][n] for s in mine)
                for s in mine:
                    late = [a for a in program[at : steps[s][n]]
                            if any(h.stage == s and h.kind in _CHANGES_GRADIENT for h in halves(a))]
                    if late:
                        raise ConfigError(
                            f"rank {rank} updates stage {min(mine, key=lambda x: steps[x][n])} before stage {s} has "
                            f"its whole gradient ({late[0]} comes later), so it cannot sum the gradient of shared "
                            f"parameter {tie.describe()} there; keep each step's STEPs after its backward work"
                        )
                due.setdefault(at, []).append((t, n))
        return due

    def due(self, rank: int, position: int) -> list[tuple[int, int]]:
        """``[(parameter, occurrence)]`` whose gradient ``rank`` sums before its action at ``position``."""
        pattern = self._pattern
        if pattern is None:
            return self._due[rank].get(position, [])
        program = pattern.programs[rank]
        shift = pattern.shift_of_position(rank, position)
        found = self._due[rank].get(position - shift * len(program.body), [])
        if not shift or not found:
            return found
        per_period = program.versions  # the updates of each stage in one period of the pattern
        return [(t, n + shift * max(per_period.get(stage, 0) for stage in self.tied[t].stages)) for t, n in found]

    def total(self, t: int, part: Callable[[int, str], Tensor]) -> Tensor:
        """The summed gradient of parameter ``t``; ``part(stage, name)`` gives each holder's, asked
        for (and added) from the last holder to the first, as one process's backward adds them."""
        return tied_sum([part(stage, name) for stage, name, _ in reversed(self.sources[t])])

    def assign(self, t: int, total: Tensor, executors: Iterable[StageExecutor]) -> None:
        """Give every copy of parameter ``t`` among ``executors`` the summed gradient."""
        holders = dict(self.tied[t].holders)
        first = True
        for executor in executors:
            name = holders.get(executor.stage)
            if name is None:
                continue
            grads = executor.grads
            if grads is None:
                executor.grads = grads = {}
            grads[name] = total if first else total.clone()
            first = False


def gradient_of(executor: StageExecutor, name: str) -> Tensor:
    """``executor``'s accumulated gradient of parameter ``name`` (zeros when none arrived)."""
    grads = executor.grads or {}
    value = grads.get(name)
    return value if value is not None else torch.zeros_like(executor.versions.latest[name])
