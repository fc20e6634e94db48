"""Lowering passes: turn a compute-only order into a program with explicit communication.

``add_communication`` inserts, for every stage boundary that crosses ranks, a SEND right after the
action that produces a tensor and the matching RECV right before the action that consumes it::

    rank 0: 0F0             ->  0F0 0SEND_F0>1
    rank 1: 1F0 1B0         ->  1RECV_F0<0 1F0 1B0 1SEND_B0>0
    rank 0: 0B0             ->  0RECV_B0<1 0B0

Where the neighbouring stage lives on the same rank (interleaved with one rank; the turn of a V,
stages R-1 and R on rank R-1) nothing is added: the interpreter hands the tensor over locally.
A pair (``(1F3;2B1)``) gets the receives of both halves before it and their sends after it::

    rank 1: (1F3;2B1)       ->  1RECV_F3<0 2RECV_B1<0 (1F3;2B1) 1SEND_F3>... 2SEND_B1>...

Executors may post receives earlier than their place in the program; the place marks where the
data is needed.
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.collector import gc_paused
from pipetrain.schedule.ir import Action, Kind, Schedule, halves

__all__ = ["add_communication", "strip_communication"]

_COMM = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})


def add_communication(schedule: Schedule) -> Schedule:
    """A copy of ``schedule`` with SEND/RECV actions for every cross-rank stage boundary."""
    last = schedule.num_stages - 1
    F, B, I, FB = Kind.F, Kind.B, Kind.I, Kind.FB
    SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B
    new = tuple.__new__
    # owners[s] = (ranks, count): microbatch k of stage s runs on ranks[k % count]
    owners = [(ranks, len(ranks)) for ranks in schedule.stage_ranks]
    programs = []
    with gc_paused():
        for rank, program in enumerate(schedule.programs):
            out: list[Action] = []
            append = out.append
            for action in program:
                kind = action[0]
                if kind is F:
                    stage, k = action[1], action[2]
                    if stage > 0:
                        ranks, count = owners[stage - 1]
                        src = ranks[k % count]
                        if src != rank:
                            append(new(Action, (RECV_F, stage, k, None, src)))
                    append(action)
                    if stage < last:
                        ranks, count = owners[stage + 1]
                        dst = ranks[k % count]
                        if dst != rank:
                            append(new(Action, (SEND_F, stage, k, None, dst)))
                elif kind is B or kind is I:
                    stage, k = action[1], action[2]
                    if stage < last:
                        ranks, count = owners[stage + 1]
                        src = ranks[k % count]
                        if src != rank:
                            append(new(Action, (RECV_B, stage, k, None, src)))
                    append(action)
                    if stage > 0:
                        ranks, count = owners[stage - 1]
                        dst = ranks[k % count]
                        if dst != rank:
                            append(new(Action, (SEND_B, stage, k, None, dst)))
                elif kind is FB:
                    forward, backward = halves(action)
                    before, after = _pair_messages(rank, forward, backward, owners, last)
                    out.extend(before)
                    append(action)
                    out.extend(after)
                else:
                    append(action)
            programs.append(out)
    return replace(schedule, programs=programs)


def _pair_messages(rank: int, forward: Action, backward: Action, owners, last: int) -> tuple[list[Action], list[Action]]:
    """The receives a pair waits for (its forward's input, its backward's output gradient) and
    the sends of what it makes (its forward's output, its backward's input gradient)."""
    before: list[Action] = []
    after: list[Action] = []
    for half, step, receive, send in ((forward, 1, Kind.RECV_F, Kind.SEND_F), (backward, -1, Kind.RECV_B, Kind.SEND_B)):
        stage, k = half.stage, half.microbatch
        source, target = stage - step, stage + step
        if 0 <= source <= last:
            ranks, count = owners[source]
            if ranks[k % count] != rank:
                before.append(Action(receive, stage, k, None, ranks[k % count]))
        if 0 <= target <= last:
            ranks, count = owners[target]
            if ranks[k % count] != rank:
                after.append(Action(send, stage, k, None, ranks[k % count]))
    return before, after


def strip_communication(schedule: Schedule) -> Schedule:
    """The compute-only order: ``schedule`` without its SEND/RECV actions."""
    programs = [[a for a in program if a.kind not in _COMM] for program in schedule.programs]
    return replace(schedule, programs=programs)
