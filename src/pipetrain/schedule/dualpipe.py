"""DualPipeV (DeepSeek, 2024; torch's ScheduleDualPipeV): the V-shaped half of DualPipe.

Each of the P ranks holds two stages of the 2P, in a V: rank r holds stage r (going down) and
stage ``2P - 1 - r`` (coming back), so the first and the last stage share rank 0 and a microbatch
turns around on rank ``P - 1``. In its steady state a rank runs *pairs* (:func:`~pipetrain.
schedule.ir.pair`): the forward of one microbatch on one of its stages together with the full
backward of another on the other stage, one action. DualPipe pairs them so that a GPU overlaps
the two: while one half computes, the other's communication (the all-to-all of expert
parallelism, the pipeline's sends) runs; on a CPU, and in pipetrain's executors, the halves run one
after the other, forward first, with the same result. The warm-up and cool-down split some
backwards into I and W, as zero-bubble schedules do. With P = 2, m = 4 (``(F;B)`` is a pair)::

    rank 0:  0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1) (3F2;0B0) 3B2 (3F3;0B1) 3B3 0I2 0W2 0I3 0W3
    rank 1:  1F0 2F0 1F1 2F1 1F2 2B0 (2F2;1B0) (1F3;2B1) (2F3;1B1) 2B2 1B2 2I3 1I3 2W3 1W3

It needs at least 2P microbatches per step.
"""

from __future__ import annotations

from collections import deque

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.flush import update_actions
from pipetrain.schedule.ir import Action, Kind, Schedule, pair
from pipetrain.schedule.params import check_positive
from pipetrain.schedule.vshape import v_placement

__all__ = ["dualpipe_v"]


class _Rank:
    """The order of one rank's step, built phase by phase as DualPipeV's reference does."""

    def __init__(self, rank: int, ranks: int, base: int) -> None:
        self.down, self.up = rank, 2 * ranks - 1 - rank
        self.base = base
        self.forwards = {self.down: 0, self.up: 0}
        self.backwards = {self.down: 0, self.up: 0}
        self.weights: deque[tuple[int, int]] = deque()  # the (stage, microbatch) of each I awaiting its W
        self.program: list[Action] = []

    def forward(self, stage: int) -> Action:
        k = self.forwards[stage]
        self.forwards[stage] = k + 1
        return Action(Kind.F, stage, self.base + k)

    def backward(self, stage: int, split: bool = False) -> Action:
        k = self.backwards[stage]
        self.backwards[stage] = k + 1
        if split:
            self.weights.append((stage, self.base + k))
        return Action(Kind.I if split else Kind.B, stage, self.base + k)

    def weight(self) -> None:
        if self.weights:
            self.program.append(Action(Kind.W, *self.weights.popleft()))

    def add(self, *actions: Action) -> None:
        self.program.extend(actions)


def _rank_order(rank: int, ranks: int, microbatches: int, base: int) -> list[Action]:
    me = _Rank(rank, ranks, base)
    down, up = me.down, me.up
    later = ranks - 1 - rank  # hops to the turn of the V
    for _ in range(2 * later):  # 1: forwards down
        me.add(me.forward(down))
    for _ in range(rank + 1):  # 2: down and up in turn
        me.add(me.forward(down), me.forward(up))
    for _ in range(later):  # 3: zero bubble on the way up: I, a pending W, F
        me.add(me.backward(up, split=True))
        me.weight()
        me.add(me.forward(up))
    for i in range(microbatches - 2 * ranks + rank + 1):  # 4: the steady state, pairs
        if i == 0 and rank == ranks - 1:  # the turn itself: nothing to overlap yet
            me.add(me.forward(down), me.backward(up))
        else:
            me.add(pair(me.forward(down), me.backward(up)))
        me.add(pair(me.forward(up), me.backward(down)))
    for _ in range(later):  # 5: the last forwards up, paired
        me.add(me.backward(up))
        me.add(pair(me.forward(up), me.backward(down)))
    split = False
    for i in range(rank + 1):  # 6: backwards of both stages, the later half split
        if i == (rank + 1) // 2 and rank % 2 == 1:
            split = True
        me.add(me.backward(up, split))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            split = True
        me.add(me.backward(down, split))
    for _ in range(later):  # 7: the pending W between the last backwards down
        me.weight()
        me.add(me.backward(down, split))
    while me.weights:  # 8: what is left of W
        me.weight()
    return me.program


def dualpipe_v(stages: int, microbatches: int, steps: int = 1, replicas=None) -> Schedule:
    """DualPipeV over ``stages`` ranks, two stages each (``2 * stages`` stages)."""
    for name, value in (("stages", stages), ("microbatches", microbatches), ("steps", steps)):
        check_positive(name, value)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(
            f"dualpipev does not support replicated stages; use 1f1b or pipedream with {option('replicas')}")
    if microbatches < 2 * stages:
        raise ScheduleError(
            f"dualpipev needs at least as many microbatches per step as stages (2 per rank, {2 * stages}); got "
            f"{microbatches}: use {option('microbatches', 2 * stages)} or more")
    placement = [[rank] for rank in v_placement(stages)]
    programs = []
    for rank in range(stages):
        program: list[Action] = []
        for step in range(steps):
            program.extend(_rank_order(rank, stages, microbatches, step * microbatches))
            for stage in (rank, 2 * stages - 1 - rank):
                program.extend(update_actions(stage, False))
        programs.append(program)
    return Schedule(programs, placement, name="dualpipev", policy="flush", microbatches=microbatches, steps=steps,
                    chunks=2)
