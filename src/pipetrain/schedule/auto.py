"""zb-auto: the zero-bubble order searched for given stage costs and an activation-memory limit.

Qi et al. (2023) schedule the split backward by simulating time under a memory limit. zb-auto
does that with :func:`~pipetrain.schedule.greedy.greedy_order` on the costs it is given (per
stage, or per rank for the V), on the straight placement and on the V, holding a microbatch's
activations until its W or only until its I (W late), and puts the fixed schedules beside them
(1f1b, zb-h1, zb-h2, zb-v, v-half, v-min): of every candidate whose peak activations fit the
limit it keeps the one that simulates two steps in the least time (a step and the next: what a
run pays per step, zb-h2's overlap of steps included). Over two steps it is therefore never slower
than the best fixed schedule under the same limit, and on unbalanced stages the greedy orders,
which wait where the costs say, often beat them.

The limit counts a rank's activations in microbatches of one stage of the straight cut (1f1b holds
S on rank 0; a V chunk is half a stage); the default is 1f1b's S. The costs default to F = I = W = 1.
The chosen candidate is recorded as ``meta["chosen"]``; the schedule holds 2 chunks per rank when it
is a V.
"""

from __future__ import annotations

from typing import Callable, Sequence

from pipetrain.errors import ScheduleError, option
from pipetrain.schedule.costs import Costs
from pipetrain.schedule.flush import one_f_one_b, zb_h1, zb_h2
from pipetrain.schedule.greedy import greedy_order
from pipetrain.schedule.ir import Schedule
from pipetrain.schedule.lower import add_communication
from pipetrain.schedule.memory import memory_by_rank
from pipetrain.schedule.params import check_positive
from pipetrain.schedule.timeline import position_of, simulate
from pipetrain.schedule.versions import assign_versions
from pipetrain.schedule.vshape import repeat_steps, v_placement, v_schedule

__all__ = ["zb_auto", "candidates", "peak_activations", "DEFAULT_COSTS"]

DEFAULT_COSTS = Costs(F=1, B=1, W=1)
#: steps a candidate is simulated over, whatever the run's (zb-h2 gains from steps that follow one
#: another; the choice, and so the cut into chunks, must not depend on the run's length)
_EVALUATED_STEPS = 2


def peak_activations(schedule: Schedule) -> float:
    """The largest activation memory of a rank, in microbatches of one stage of the straight cut."""
    return max(m.rank_peak_activations for m in memory_by_rank(schedule)) / schedule.chunks


def _greedy(stages: int, microbatches: int, steps: int, costs: Costs, limit: int, v: bool,
            until_w: bool) -> Schedule:
    if v and microbatches < 2 * stages - 1:
        raise ScheduleError("a V needs 2R-1 microbatches")  # as v_schedule: zb_auto leaves it out
    placement = v_placement(stages) if v else list(range(stages))
    chunks = 2 if v else 1
    shell = Schedule([[] for _ in range(stages)], [[r] for r in placement], chunks=chunks)
    resolved = costs.resolve(len(placement), stages, chunks, position_of(shell))
    step = greedy_order(placement, microbatches, resolved.forward, resolved.backward, resolved.weight,
                        [limit * chunks] * stages, until_w=until_w)
    programs = repeat_steps(step, placement, microbatches, steps)
    return Schedule(programs, [[r] for r in placement], name="greedy-v" if v else "greedy", policy="flush",
                    microbatches=microbatches, steps=steps, chunks=chunks)


def candidates(stages: int, microbatches: int, costs: Costs, limit: int) -> dict[str, Callable[[int], Schedule]]:
    """Every candidate of zb-auto, by name: ``make(steps)`` builds its order."""
    found: dict[str, Callable[[int], Schedule]] = {
        "1f1b": lambda steps: one_f_one_b(stages, microbatches, steps),
        "zb-h1": lambda steps: zb_h1(stages, microbatches, steps),
        "zb-h2": lambda steps: zb_h2(stages, microbatches, steps),
    }
    for name in ("zb-v", "v-half", "v-min"):
        found[name] = lambda steps, name=name: v_schedule(name, stages, microbatches, steps)
    for v in (False, True):
        for until_w in (True, False):
            name = "greedy" + ("-v" if v else "") + ("" if until_w else "-late-w")
            found[name] = lambda steps, v=v, until_w=until_w: _greedy(stages, microbatches, steps, costs, limit, v,
                                                                      until_w)
    return found


def zb_auto(stages: int, microbatches: int, steps: int = 1, replicas: Sequence[int] | None = None,
            costs: Costs | None = None, memory_limit: int | None = None) -> Schedule:
    """The fastest order under ``memory_limit`` for ``costs`` (see the module docstring)."""
    check_positive("stages", stages)
    check_positive("microbatches", microbatches)
    check_positive("steps", steps)
    if replicas is not None and any(r != 1 for r in replicas):
        raise ScheduleError(f"zb-auto does not support replicated stages; use 1f1b or pipedream with "
                            f"{option('replicas')}")
    limit = stages if memory_limit is None else memory_limit
    check_positive("memory_limit", limit)
    costs = DEFAULT_COSTS if costs is None else costs
    best: tuple[float, str, Callable[[int], Schedule]] | None = None
    for name, make in candidates(stages, microbatches, costs, limit).items():
        try:
            sample = make(_EVALUATED_STEPS)  # a V refuses too few microbatches
            if peak_activations(sample) > limit:
                continue
            makespan = simulate(add_communication(assign_versions(sample)), costs).makespan
        except ScheduleError:  # or costs per stage of the other placement
            continue
        if best is None or makespan < best[0]:
            best = (makespan, name, make)
    if best is None:
        raise ScheduleError(f"zb-auto: the costs fit neither {stages} stages nor {2 * stages} chunks; give one cost "
                            f"per stage, per rank or one for all")
    _, name, make = best
    schedule = make(steps)
    schedule.name = "zb-auto"
    schedule.meta = {**schedule.meta, "chosen": name}
    return schedule
