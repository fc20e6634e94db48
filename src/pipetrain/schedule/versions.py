"""Weight-version policies: which version each F, B, I and W reads.

A policy is applied to a program order after the fact, so order and policy stay independent
(docs/design.md section 2). Versions count the stage's updates: version v exists after the stage's
v-th STEP.

=========  ==========================================  ==========================================
policy     forward reads                               backward (B, I, W) reads
=========  ==========================================  ==========================================
flush      the current version                         the forward's version (= the current one)
stash      the current version                         the forward's version (weight stashing)
vsync      the version stage 0 used for the microbatch  the same
2bw        ``max(0, t-1)`` for microbatch of batch t    the same
latest     the current version                         the current version (no stashing; PB)
predict    the current version, extrapolated (LWP)     the current version
=========  ==========================================  ==========================================
"""

from __future__ import annotations

from dataclasses import replace

from pipetrain.errors import ScheduleError
from pipetrain.collector import gc_paused
from pipetrain.schedule.ir import Action, Kind, Schedule, halves
from pipetrain.schedule.pattern import PeriodicProgram, pattern_of

__all__ = ["POLICIES", "assign_versions", "staleness", "units_per_update"]

POLICIES = ("flush", "stash", "vsync", "2bw", "latest", "predict")
_STASHING = frozenset({"flush", "stash", "vsync", "2bw"})


def assign_versions(schedule: Schedule, policy: str | None = None) -> Schedule:
    """A copy of ``schedule`` whose F/B/I/W carry the versions ``policy`` reads."""
    policy = policy or schedule.policy
    if policy not in POLICIES:
        raise ScheduleError(f"unknown version policy {policy!r}; choose one of {', '.join(POLICIES)}")
    tags = _stage0_tags(schedule) if policy == "vsync" else None
    per_batch = max(schedule.microbatches, 1)
    stash = policy in _STASHING
    two_bw = policy == "2bw"
    F, STEP, FB = Kind.F, Kind.STEP, Kind.FB
    compute = (F, Kind.B, Kind.I, Kind.W)
    new = tuple.__new__
    programs = []
    with gc_paused():
        for program in schedule.programs:
            counts: dict[int, int] = {}
            forward_version: dict[tuple[int, int], int] = {}
            out: list[Action] = []
            append = out.append

            def read(kind: Kind, stage: int, k: int) -> int | None:
                if kind is F:
                    if tags is not None:
                        version = tags.get(k, 0)
                    elif two_bw:
                        version = max(0, k // per_batch - 1)
                    else:
                        version = counts.get(stage, 0)
                    forward_version[(stage, k)] = version
                    return version
                if stash:
                    return forward_version.get((stage, k))
                return counts.get(stage, 0)

            for action in program:
                kind, stage, k, _, peer = action
                if kind is STEP:
                    counts[stage] = counts.get(stage, 0) + 1
                    append(action)
                    continue
                if kind is FB:  # a pair: each half reads as it would alone, the forward first
                    version = read(F, stage, k)
                    other = peer
                    append(new(Action, (FB, stage, k, version, new(Action, (
                        other[0], other[1], other[2], read(other[0], other[1], other[2]), None)))))
                    continue
                if k is None or kind not in compute:
                    append(action)
                    continue
                append(new(Action, (kind, stage, k, read(kind, stage, k), peer)))
            programs.append(out)
    return replace(schedule, programs=programs, policy=policy)


def _stage0_tags(schedule: Schedule) -> dict[int, int]:
    """Vertical sync: the version stage 0 reads for each microbatch travels with it."""
    tags: dict[int, int] = {}
    for rank in schedule.stage_ranks[0] if schedule.stage_ranks else []:
        steps = 0
        for whole in schedule.programs[rank]:
            for action in halves(whole):
                if action.stage != 0:
                    continue
                if action.kind is Kind.STEP:
                    steps += 1
                elif action.kind is Kind.F:
                    tags[action.microbatch] = steps
    return tags


def staleness(schedule: Schedule) -> list[int]:
    """Per stage, the largest delay D_s in updates between the version a forward reads and the
    version its gradient is applied to (0 for flushing schedules, W_s for PipeDream, 1 for 2BW,
    2(S-1-s) for PB). Delay compensation (SC's D, LWP's T) defaults to it. A long schedule's
    pattern repeats its delays: they are its sample's."""
    pattern = pattern_of(schedule)
    if pattern is not None:
        return staleness(pattern.check_sample)
    delays = [0] * schedule.num_stages
    for program in schedule.programs:
        counts: dict[int, int] = {}
        pending: dict[int, list[int]] = {}
        forward_version: dict[tuple[int, int], int] = {}
        for action in (half for whole in program for half in halves(whole)):
            kind, stage = action.kind, action.stage
            if kind is Kind.F and action.version is not None:
                forward_version[(stage, action.microbatch)] = action.version
            elif kind is Kind.B or kind is Kind.W:
                version = forward_version.get((stage, action.microbatch))
                if version is not None:
                    pending.setdefault(stage, []).append(version)
            elif kind is Kind.STEP:
                current = counts.get(stage, 0)
                for version in pending.pop(stage, []):
                    delays[stage] = max(delays[stage], current - version)
                counts[stage] = current + 1
    return delays


def units_per_update(schedule: Schedule) -> list[float]:
    """Per stage, the microbatches whose gradients one update applies (all replicas together)."""
    result = []
    for stage, ranks in enumerate(schedule.stage_ranks):
        program = schedule.programs[ranks[0]]
        if isinstance(program, PeriodicProgram):
            steps = program.count_where(lambda a, stage=stage: a.kind is Kind.STEP and a.stage == stage)
        else:
            steps = sum(1 for a in program if a.kind is Kind.STEP and a.stage == stage)
        result.append(schedule.total_microbatches / steps if steps else 1.0)
    return result
