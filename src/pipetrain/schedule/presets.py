"""Named schedules: each a preset of an action order and a weight-version policy.

=============  ===============================================  ==========  ============
name           order                                            policy      flushes
=============  ===============================================  ==========  ============
gpipe          all forwards, then all backwards                 flush       every step
1f1b           warm-up S-1-s, then one forward / one backward   flush       every step
interleaved    1F1B over v model chunks per rank (Megatron)     flush       every step
zb-h1          1F1B with the backward split into I and W        flush       every step
zb-h2          2(S-1-s) warm-up forwards, W deferred by 2s      flush       every step
zb-v           V of 2 chunks per rank, 1f1b's memory (greedy)   flush       every step
v-half         V, about 1/2 of 1f1b's activations               flush       every step
v-min          V, about 1/3 of 1f1b's activations               flush       every step
zb-auto        best order for given costs and memory limit      flush       every step
bfs            looped breadth-first: all microbatches chunk     flush       every step
               by chunk, v chunks per rank (torch's LoopedBFS)
interleaved-zb ZB1P: interleaved with I and W split, W lagging  flush       every step
               r backwards on rank r (InterleavedZeroBubble)
dualpipev      DeepSeek's DualPipeV: 2 stages per rank in a V,  flush       every step
               forward and backward paired in one action
pipedream      1F1B with NOAM warm-up, update per minibatch     stash       never
2bw            1F1B over batches of m >= S, update per batch    2bw         never
pb             tick order, warm-up 2(S-1-s), update per sample  latest      never
=============  ===============================================  ==========  ============

:func:`build` makes the order, assigns versions (any policy of :mod:`~pipetrain.schedule.versions`
may replace the preset's) and adds communication. torch's names, as torchtitan's
``--parallelism.pipeline_parallel_schedule`` takes them (GPipe, 1F1B, Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV; in any case, as torch reads them), name the same
schedules.

The V schedules (zb-v, v-half, v-min, dualpipev; zb-auto when it picks a V) hold 2 chunks per rank,
stage r and 2R-1-r on rank r: ``stages`` counts ranks, as for interleaved, bfs and interleaved-zb,
and the model is cut into 2R stages (:func:`chunks_per_rank`).
"""

from __future__ import annotations

import difflib
from typing import Callable, Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.collector import gc_paused
from pipetrain.schedule.auto import zb_auto
from pipetrain.schedule.bfs import looped_bfs
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.dualpipe import dualpipe_v
from pipetrain.schedule.flush import gpipe, one_f_one_b, zb_h1, zb_h2
from pipetrain.schedule.interleaved import interleaved
from pipetrain.schedule.interleaved_zb import interleaved_zero_bubble
from pipetrain.schedule.ir import Schedule
from pipetrain.schedule.lower import add_communication
from pipetrain.schedule.pattern import period_units, periodic
from pipetrain.schedule.pb import pb
from pipetrain.schedule.pipedream import pipedream, two_bw
from pipetrain.schedule.versions import POLICIES, assign_versions
from pipetrain.schedule.vshape import V_SCHEDULES, v_schedule

__all__ = ["SCHEDULES", "ASYNCHRONOUS", "LOOPED", "V_SHAPED", "build", "build_updates", "order", "resolve_name", "estimated_seconds",
           "LIMIT_SECONDS", "check_chunks", "chunks_per_rank"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw", "pb", "zb-h2", "zb-v", "v-half", "v-min",
             "zb-auto", "bfs", "interleaved-zb", "dualpipev")
#: Schedules that never flush: each of their pipeline units is its own update (2bw: each batch).
ASYNCHRONOUS = frozenset({"pipedream", "2bw", "pb"})
#: Schedules whose ranks hold ``chunks`` model chunks each, chunk c of rank r being stage c * P + r.
LOOPED = frozenset({"interleaved", "bfs", "interleaved-zb"})
#: Schedules whose ranks hold two stages each in a V (rank r: stages r and 2P - 1 - r).
V_SHAPED = frozenset({*V_SCHEDULES, "dualpipev"})
_ALIASES = {"pipedream-flush": "1f1b", "1F1B": "1f1b", "zbh1": "zb-h1", "zb": "zb-h1", "pipedream-2bw": "2bw",
            "zbh2": "zb-h2", "zbv": "zb-v", "zb-vshape": "zb-v", "vhalf": "v-half", "vmin": "v-min",
            "looped-bfs": "bfs", "zb1p": "interleaved-zb", "dualpipe-v": "dualpipev",
            # torch's names (torch.distributed.pipelining.schedules.get_schedule_class, torchtitan's
            # --parallelism.pipeline_parallel_schedule), which torch reads in any case
            "GPipe": "gpipe", "Interleaved1F1B": "interleaved", "LoopedBFS": "bfs",
            "InterleavedZeroBubble": "interleaved-zb", "ZBVZeroBubble": "zb-v", "DualPipeV": "dualpipev"}
_FOLDED = {alias.lower(): name for alias, name in _ALIASES.items()}
#: Schedules whose order splits the backward into I and W.
_SPLIT = frozenset({"zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "zb-auto", "interleaved-zb"})

# What `pipetrain schedule` costs on the project's 2-core box under load (benchmarks/RESULTS.md,
# section 1): per compute action through generation, versions, communication, validation,
# simulation and the summary, and per rank (its program, memory and summary rows).
_ACTION_SECONDS = 12.5e-6
_RANK_SECONDS = 1.5e-4
LIMIT_SECONDS = 30.0  #: larger schedules are refused, with the largest that fits


def resolve_name(name: str) -> str:
    """The canonical schedule name, or a ScheduleError suggesting the closest ones."""
    name = _ALIASES.get(name, name)
    if name in SCHEDULES:
        return name
    folded = _FOLDED.get(name.lower())
    if folded is not None and folded in SCHEDULES:
        return folded
    known = {**{alias.lower(): target for alias, target in _ALIASES.items() if target in SCHEDULES},
             **{schedule: schedule for schedule in SCHEDULES}}  # written as users may -> the schedule it names
    close = list(dict.fromkeys(known[c] for c in difflib.get_close_matches(name.lower(), list(known), n=3,
                                                                           cutoff=0.4)))[:2]
    hint = f" (did you mean {' or '.join(close)}?)" if close else ""
    raise ScheduleError(f"unknown schedule {name!r}{hint}; choose one of {', '.join(SCHEDULES)}")


def _actions_per_cell(name: str, chunks: int) -> int:
    """Compute actions per (stage, microbatch, step): forward and backward (zero-bubble: and W);
    zb-auto builds and simulates its ten candidates too (about eleven schedules' work)."""
    per_rank = chunks if name in LOOPED else 2 if name in V_SHAPED or name == "zb-auto" else 1
    return (3 if name in _SPLIT else 2) * per_rank * (11 if name == "zb-auto" else 1)


def chunks_per_rank(name: str, stages: int, microbatches: int, chunks: int = 1, *, costs: Costs | None = None,
                    memory_limit: int | None = None) -> int:
    """Model chunks each rank holds: ``chunks`` for the looped schedules (interleaved, bfs,
    interleaved-zb), 2 for a V schedule, zb-auto's choice for these parameters, else 1 (the model is
    cut into ``stages`` times as many stages)."""
    name = resolve_name(name)
    if name in LOOPED:
        return chunks
    if name in V_SHAPED:
        return 2
    if name == "zb-auto":
        return order(name, stages, microbatches, costs=costs, memory_limit=memory_limit).chunks
    return 1


def estimated_seconds(name: str, stages: int, microbatches: int, steps: int = 1, chunks: int = 1,
                      replicas: Sequence[int] | None = None) -> float:
    """About how long building, checking and simulating this schedule takes here."""
    name = resolve_name(name)
    ranks = sum(replicas) if replicas else stages
    cells = max(stages, 1) * max(microbatches, 1) * max(steps, 1)
    return cells * _actions_per_cell(name, chunks) * _ACTION_SECONDS + ranks * _RANK_SECONDS


def _check_size(name: str, stages: int, microbatches: int, steps: int, chunks: int,
                replicas: Sequence[int] | None) -> None:
    """Refuse a schedule that would take minutes, naming the largest sizes that fit."""
    seconds = estimated_seconds(name, stages, microbatches, steps, chunks, replicas)
    if seconds <= LIMIT_SECONDS:
        return
    per_action = _actions_per_cell(name, chunks) * _ACTION_SECONDS * max(steps, 1)
    extra = (sum(replicas) - stages) * _RANK_SECONDS if replicas else 0.0
    most_stages = _largest(
        lambda count: estimated_seconds(name, count, microbatches, steps, chunks) + extra
        <= LIMIT_SECONDS,
        int((LIMIT_SECONDS - extra) // (microbatches * per_action + _RANK_SECONDS)))
    most_microbatches = _largest(
        lambda count: estimated_seconds(name, stages, count, steps, chunks, replicas)
        <= LIMIT_SECONDS,
        int((LIMIT_SECONDS - (sum(replicas) if replicas else stages) * _RANK_SECONDS)
            // (stages * per_action)))
    raise ScheduleError(
        f"{name} over {stages:,} stages and {microbatches:,} microbatches"
        + (f" x {steps:,} steps" if steps > 1 else "")
        + f" would take about {seconds:,.0f} s here, more than {LIMIT_SECONDS:.0f} s; at most "
        f"{max(most_stages, 0):,} stages fit with {microbatches:,} microbatches"
        + (f", or {most_microbatches:,} microbatches with {stages:,} stages"
           if most_microbatches else "")
        + f": lower {option('stages')} or {option('microbatches')}")


def build_updates(name: str, stages: int, units_per_update: int, updates: int, *, chunks: int = 1,
                  replicas: Sequence[int] | None = None, policy: str | None = None, pattern: bool = False) -> Schedule:
    """The schedule of ``updates`` optimizer updates of ``units_per_update`` microbatches each: the
    two numbers mean the same for every schedule (a training run's). :func:`build` counts otherwise
    for pipedream and pb, which have no steps: all their units in ``microbatches``, an update every
    ``update_every`` of them."""
    if resolve_name(name) in ("pipedream", "pb"):
        return build(name, stages, updates * units_per_update, replicas=replicas, policy=policy,
                     update_every=units_per_update, pattern=pattern)
    return build(name, stages, units_per_update, steps=updates, chunks=chunks, replicas=replicas, policy=policy,
                 pattern=pattern)


def _largest(fits: Callable[[int], bool], guess: int) -> int:
    """The largest count that ``fits`` (0 if none), from a guess off by rounding."""
    count = max(guess, 0)
    while count > 0 and not fits(count):
        count -= 1
    while fits(count + 1):
        count += 1
    return count


def _as_pattern(name: str, stages: int, microbatches: int, steps: int, chunks: int,
                replicas: Sequence[int] | None, policy: str | None, update_every: int,
                costs: Costs | None = None, memory_limit: int | None = None) -> Schedule | None:
    """The schedule as a pattern (see :func:`build`), or None if it is short or does not repeat."""
    name = resolve_name(name)
    if name in ("pipedream", "pb"):
        if steps != 1 or microbatches < 1 or update_every < 1:
            return None
        units = period_units(name, microbatches, stages, replicas, chunks, update_every)
        copies, rest = divmod(microbatches, units)

        def make(n: int) -> Schedule:
            return build(name, stages, rest + n * units, replicas=replicas, policy=policy,
                         update_every=update_every)

        return periodic(make, copies, units, microbatches, 1)
    if microbatches < 1 or steps < 1:
        return None

    def make_steps(n: int) -> Schedule:
        return build(name, stages, microbatches, steps=n, chunks=chunks, replicas=replicas, policy=policy,
                     update_every=update_every, costs=costs, memory_limit=memory_limit)

    return periodic(make_steps, steps, microbatches, microbatches, steps)


def check_chunks(name: str, chunks: int) -> None:
    """Refuse model chunks on a schedule that has none (the same words for ``pipetrain schedule``,
    ``train`` and ``Pipeline``); a V schedule's own 2 are fine."""
    if chunks != 1 and name not in LOOPED and not (chunks == 2 and name in V_SHAPED):
        looped = ", ".join(sorted(LOOPED))
        raise ScheduleError(f"{option('chunks')} applies to the looped schedules ({looped}) only, not to {name}"
                            + (" (a V schedule always holds 2 chunks per rank)" if name in V_SHAPED else ""))


def order(
    name: str,
    stages: int,
    microbatches: int,
    *,
    steps: int = 1,
    chunks: int = 1,
    replicas: Sequence[int] | None = None,
    update_every: int = 1,
    costs: Costs | None = None,
    memory_limit: int | None = None,
) -> Schedule:
    """The compute-only order of a named schedule (versions unassigned, no communication).

    ``costs`` and ``memory_limit`` (per rank, in microbatches of one stage) steer zb-auto's search
    (:mod:`~pipetrain.schedule.auto`); the other schedules have a fixed order."""
    name = resolve_name(name)
    check_chunks(name, chunks)
    if memory_limit is not None and name != "zb-auto":
        raise ScheduleError(f"{option('memory_limit')} applies to zb-auto only, not to {name}")
    if update_every != 1 and name not in ("pipedream", "pb"):
        raise ScheduleError(f"{option('update_every')} applies to pipedream and pb only; {name} updates once per step")
    if name in ("pipedream", "pb") and steps != 1:
        raise ScheduleError(
            f"{name} has no steps: every pipeline unit is its own update, so {option('microbatches')} counts all of "
            f"them; drop {option('steps')}"
        )
    _check_size(name, stages, microbatches, steps, chunks, replicas)
    makers: dict[str, Callable[[], Schedule]] = {
        "gpipe": lambda: gpipe(stages, microbatches, steps, replicas),
        "1f1b": lambda: one_f_one_b(stages, microbatches, steps, replicas),
        "interleaved": lambda: interleaved(stages, microbatches, steps, chunks, replicas),
        "zb-h1": lambda: zb_h1(stages, microbatches, steps, replicas),
        "bfs": lambda: looped_bfs(stages, microbatches, steps, chunks, replicas),
        "interleaved-zb": lambda: interleaved_zero_bubble(stages, microbatches, steps, chunks, replicas),
        "dualpipev": lambda: dualpipe_v(stages, microbatches, steps, replicas),
        "pipedream": lambda: pipedream(stages, microbatches, replicas, update_every),
        "2bw": lambda: two_bw(stages, microbatches, steps, replicas),
        "pb": lambda: pb(stages, microbatches, update_every, replicas),
        "zb-h2": lambda: zb_h2(stages, microbatches, steps, replicas),
        "zb-auto": lambda: zb_auto(stages, microbatches, steps, replicas, costs, memory_limit),
        **{v: (lambda v=v: v_schedule(v, stages, microbatches, steps, replicas)) for v in V_SCHEDULES},
    }
    return makers[name]()


def build(
    name: str,
    stages: int,
    microbatches: int,
    *,
    steps: int = 1,
    chunks: int = 1,
    replicas: Sequence[int] | None = None,
    policy: str | None = None,
    update_every: int = 1,
    communication: bool = True,
    pattern: bool = False,
    costs: Costs | None = None,
    memory_limit: int | None = None,
) -> Schedule:
    """A complete schedule: order, versions under ``policy`` (default: the preset's), communication.

    With ``pattern``, a long schedule comes as its steady-state pattern: programs that compute each
    action when it is asked for (:mod:`~pipetrain.schedule.pattern`), so that memory and build time
    do not grow with ``steps`` (or, for pipedream and pb, with ``microbatches``). ``costs`` and
    ``memory_limit``: zb-auto's (see :func:`order`).
    """
    if policy is not None and policy not in POLICIES:
        raise ScheduleError(f"unknown version policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if pattern and communication:
        found = _as_pattern(name, stages, microbatches, steps, chunks, replicas, policy, update_every, costs,
                            memory_limit)
        if found is not None:
            return found
    with gc_paused():
        schedule = order(
            name, stages, microbatches, steps=steps, chunks=chunks, replicas=replicas, update_every=update_every,
            costs=costs, memory_limit=memory_limit,
        )
    if policy is not None and policy != schedule.policy:
        if policy == "2bw" or schedule.policy == "2bw":
            raise ScheduleError("the 2bw policy goes with the 2bw order only (it reads version t-1 of batch t)")
        if schedule.policy == "flush" and policy != "flush":
            policy = "flush" if policy in ("stash",) else policy
    schedule = assign_versions(schedule, policy)
    return add_communication(schedule) if communication else schedule
