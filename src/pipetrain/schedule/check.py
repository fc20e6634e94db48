"""Validation of a schedule: every rule an executor relies on, checked before anything runs.

Static rules, rank by rank: each action belongs to a stage its rank holds and each microbatch to
the replica that 1F1B-RR routing gives it; every (stage, microbatch) runs F exactly once and a
backward exactly once (B, or I then W); F comes before its backward and I before W; an input
comes from a RECV or the previous stage on the same rank; every SEND has its RECV on the peer and
back; a version is read only after the STEP that creates it; replicated stages SYNC before each
STEP. Then a dry run of all ranks together finds deadlocks (:func:`~pipetrain.schedule.timeline.dry_run`).
"""

from __future__ import annotations

from pipetrain.errors import ScheduleError
from pipetrain.collector import gc_paused
from pipetrain.schedule.ir import Kind, Schedule, format_action, halves
from pipetrain.schedule.pattern import pattern_of
from pipetrain.schedule.timeline import dry_run

__all__ = ["check", "problems"]

_MAX_LISTED = 10


def check(schedule: Schedule, *, deadlock: bool = True) -> None:
    """Raise :class:`ScheduleError` listing the first problems, or return if the schedule is valid.

    A long schedule expanded from a pattern (:mod:`~pipetrain.schedule.pattern`) is checked as its
    sample of the head, two more periods than the pattern was read from, and the tail: every rule on
    the pattern and on each seam (head to body, body to body, body to tail).
    """
    pattern = pattern_of(schedule)
    if pattern is not None:
        schedule = pattern.check_sample
    found = problems(schedule)
    if found:
        shown = "\n  ".join(found[:_MAX_LISTED])
        more = f"\n  ... and {len(found) - _MAX_LISTED} more" if len(found) > _MAX_LISTED else ""
        raise ScheduleError(f"the schedule is invalid ({len(found)} problems):\n  {shown}{more}")
    if deadlock:
        dry_run(schedule)


class _TooMany(Exception):
    """Enough problems found to stop looking."""


def problems(schedule: Schedule) -> list[str]:
    """Every static rule violation, as one readable line each (empty when valid); of a long
    schedule's pattern, its sample's (see :func:`check`)."""
    pattern = pattern_of(schedule)
    if pattern is not None:
        schedule = pattern.check_sample
    with gc_paused():
        return _problems(schedule)


def _problems(schedule: Schedule) -> list[str]:
    out: list[str] = []
    num_stages = schedule.num_stages
    num_ranks = schedule.num_ranks
    held = schedule.rank_stages()
    for stage, ranks in enumerate(schedule.stage_ranks):
        for rank in ranks:
            if not 0 <= rank < num_ranks:
                out.append(f"placement puts stage {stage} on rank {rank}, but ranks are 0..{num_ranks - 1}")
                return out
    F, I, W, FB = Kind.F, Kind.I, Kind.W, Kind.FB
    SEND_F, RECV_F, SEND_B, RECV_B, SYNC, STEP = (
        Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B, Kind.SYNC, Kind.STEP,
    )
    owners = [(ranks, len(ranks)) for ranks in schedule.stage_ranks]
    flush = schedule.policy == "flush"
    S = num_stages
    # Keys: k * S + stage names a (stage, microbatch) pair; a message is (key * 2 + forward) * R + rank.
    R = num_ranks
    all_forwards: set[int] = set()
    all_backwards: set[int] = set()
    sent: dict[int, int] = {}
    received: dict[int, int] = {}

    for rank, program in enumerate(schedule.programs):
        mine = set(held[rank])
        replicated = {s for s in mine if len(schedule.stage_ranks[s]) > 1}
        fdone: set[int] = set()
        bdone: set[int] = set()  # B or I done
        idone: set[int] = set()
        wdone: set[int] = set()
        recvf: set[int] = set()
        recvb: set[int] = set()
        steps = dict.fromkeys(mine, 0)
        synced = dict.fromkeys(mine, False)

        def bad(position: int, message: str) -> None:
            out.append(f"rank {rank} action #{position} {format_action(program[position])}: {message}")
            if len(out) > 5 * _MAX_LISTED:
                raise _TooMany

        try:
            for position, whole in enumerate(program):
                for action in (halves(whole) if whole[0] is FB else (whole,)):  # a pair: F, then B or I
                    kind, stage, k, version, peer = action
                    if stage not in mine:
                        if 0 <= stage < S:
                            bad(position, f"rank {rank} does not hold stage {stage} (it holds {sorted(mine)})")
                        else:
                            bad(position, f"stage {stage} does not exist (stages are 0..{S - 1})")
                        continue
                    if kind is SEND_F or kind is SEND_B:
                        forward = kind is SEND_F
                        key = k * S + stage
                        if key not in (fdone if forward else bdone):
                            bad(position, "sends a result that this rank has not computed yet")
                        target = stage + 1 if forward else stage - 1
                        if not 0 <= target < S:
                            bad(position, f"there is no stage {target} to send to")
                            continue
                        ranks, count = owners[target]
                        if peer is not None and peer != ranks[k % count]:
                            bad(position, f"microbatch {k} of stage {target} lives on rank {ranks[k % count]}")
                        message = ((k * S + target) * 2 + forward) * R + rank
                        if message in sent:
                            sent[message] += 1
                        else:
                            sent[message] = 1
                        continue
                    if kind is RECV_F or kind is RECV_B:
                        forward = kind is RECV_F
                        source = stage - 1 if forward else stage + 1
                        if not 0 <= source < S:
                            bad(position, f"there is no stage {source} to receive from")
                            continue
                        if peer is None:
                            ranks, count = owners[source]
                            peer = ranks[k % count]
                        key = k * S + stage
                        (recvf if forward else recvb).add(key)
                        message = (key * 2 + forward) * R + peer
                        if message in received:
                            received[message] += 1
                        else:
                            received[message] = 1
                        continue
                    if kind is STEP:
                        if stage in replicated and not synced[stage]:
                            bad(position, f"stage {stage} is replicated, so each STEP needs a SYNC before it")
                        steps[stage] += 1
                        synced[stage] = False
                        continue
                    if kind is SYNC:
                        synced[stage] = True
                        continue
                    key = k * S + stage
                    ranks, count = owners[stage]
                    if count > 1 and ranks[k % count] != rank:
                        bad(position, f"microbatch {k} of stage {stage} is routed to rank {ranks[k % count]} "
                            f"(replica k mod {count})")
                    if version is not None:
                        current = steps[stage]
                        if version > current:
                            bad(position, f"reads version {version}, but stage {stage} has only made versions "
                                f"0..{current} at this point")
                        elif flush and version != current:
                            bad(position, f"policy 'flush' keeps one weight version, but this reads version {version} "
                                f"while version {current} is current; use a stashing policy")
                    if kind is F:
                        if key in fdone:
                            bad(position, f"microbatch {k} already ran its forward on stage {stage}")
                        if stage > 0 and key not in recvf and key - 1 not in fdone:
                            bad(position, "its input was neither received (RECV_F) nor computed here before")
                        fdone.add(key)
                        all_forwards.add(key)
                    elif kind is W:
                        if key not in idone:
                            bad(position, f"W before the I of microbatch {k} (W needs the input gradient pass)")
                        if key in wdone:
                            bad(position, f"microbatch {k} already ran its W on stage {stage}")
                        wdone.add(key)
                    else:  # B or I
                        if key not in fdone:
                            bad(position, f"backward before the forward of microbatch {k} on this rank")
                        if key in bdone:
                            bad(position, f"microbatch {k} already ran its backward on stage {stage}")
                        if stage < S - 1 and key not in recvb and key + 1 not in bdone:
                            bad(position, "its output gradient was neither received (RECV_B) nor computed here before")
                        bdone.add(key)
                        if kind is I:
                            idone.add(key)
                        all_backwards.add(key)
        except _TooMany:
            return out
        missing_w = idone - wdone
        for key in sorted(missing_w)[:_MAX_LISTED]:
            out.append(f"rank {rank}: stage {key % S}, microbatch {key // S} runs I but never W")

    def unpack(message: int) -> tuple[bool, int, int, int]:
        rest, rank = divmod(message, R)
        key, forward = divmod(rest, 2)
        return bool(forward), key % S, key // S, rank

    for message, count in sent.items():
        match = received.get(message, 0)
        if match != count:
            forward, target, k, sender = unpack(message)
            ranks, n = owners[target]
            out.append(
                f"rank {sender} has {count} {'SEND_F' if forward else 'SEND_B'} of microbatch {k} to stage {target} "
                f"but rank {ranks[k % n]} has {match} matching {'RECV_F' if forward else 'RECV_B'}"
            )
    for message in received.keys() - sent.keys():
        forward, stage, k, peer = unpack(message)
        ranks, n = owners[stage]
        out.append(
            f"rank {ranks[k % n]} has {'RECV_F' if forward else 'RECV_B'} of microbatch {k} for stage {stage} "
            f"from rank {peer}, but no rank sends it"
        )
    if all_forwards != all_backwards:
        for key in sorted(all_forwards ^ all_backwards)[:_MAX_LISTED]:
            what = "a forward but no backward" if key in all_forwards else "a backward but no forward"
            out.append(f"stage {key % S}, microbatch {key // S} has {what}")
    microbatches = {key // S for key in all_forwards}
    per_stage = [0] * S
    for key in all_forwards:
        per_stage[key % S] += 1
    for stage, count in enumerate(per_stage):
        if count != len(microbatches):
            have = {key // S for key in all_forwards if key % S == stage}
            lacking = sorted(microbatches - have)
            out.append(
                f"stage {stage} never runs microbatches {lacking[:8]}{' ...' if len(lacking) > 8 else ''}, "
                "which other stages run"
            )
    return out
