"""Measured timelines next to simulated ones: the simulator fed with the measured action times."""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Sequence

from pipetrain.schedule.costs import Costs
from pipetrain.schedule.ir import Kind
from pipetrain.schedule.plot import plot_comparison
from pipetrain.schedule.timeline import Timeline, simulate

__all__ = ["measured_costs", "simulated_counterpart", "update_ends", "seconds_per_update", "action_overhead", "plot_measured_and_simulated"]

#: the share of a run's updates left out of its steady state as start-up
SKIP = 0.2


def measured_costs(measured: Timeline) -> Costs:
    """Per-stage median F, B (or I), W and STEP durations of a measured timeline."""
    schedule = measured.schedule
    durations: dict[tuple[Kind, int], list[float]] = {}
    for rank in range(schedule.num_ranks):
        for action, start, end in measured.spans(rank):
            if action.kind in (Kind.F, Kind.B, Kind.I, Kind.W, Kind.STEP):
                durations.setdefault((action.kind, action.stage), []).append(end - start)

    def per_stage(kind: Kind) -> list[float]:
        return [median(durations.get((kind, s), [0.0])) for s in range(schedule.num_stages)]

    backward = per_stage(Kind.B)
    inputs = per_stage(Kind.I)
    weight = per_stage(Kind.W)
    split = [(Kind.I, s) in durations for s in range(schedule.num_stages)]
    whole = [(Kind.B, s) in durations for s in range(schedule.num_stages)]
    # an order that runs some backwards whole and splits others (DualPipe's) has both: each its own
    full = [b if w else i + wt for b, i, wt, w in zip(backward, inputs, weight, whole)] \
        if any(c and w for c, w in zip(split, whole)) else None
    return Costs(
        F=per_stage(Kind.F),
        B=[i if cut else b for b, i, cut in zip(backward, inputs, split)],
        W=weight,
        full=full,
        step=per_stage(Kind.STEP),
    )


def simulated_counterpart(measured: Timeline, costs: Costs | None = None) -> Timeline:
    """``measured``'s schedule simulated with ``costs`` (default: its measured median action times)."""
    return simulate(measured.schedule, measured_costs(measured) if costs is None else costs)


def update_ends(timeline: Timeline) -> list[float]:
    """End times of the last stage's updates (its first replica's STEPs)."""
    schedule = timeline.schedule
    last = schedule.num_stages - 1
    rank = schedule.stage_ranks[last][0]
    return [end for action, _, end in timeline.spans(rank) if action.kind is Kind.STEP and action.stage == last]


def seconds_per_update(ends: Sequence[float], skip: float = SKIP) -> float | None:
    """Steady-state time per update: the median gap between consecutive update ends after the
    first ``skip`` of them (None with fewer than two left)."""
    first = int(len(ends) * skip)
    gaps = [b - a for a, b in zip(ends[first:-1], ends[first + 1:])]
    return median(gaps) if gaps else None


def action_overhead(measured: Timeline) -> float:
    """The interpreter's time per action: the median gap between the end of one action and the
    start of the next, over every rank (a wait for a message is inside its RECV, not in a gap)."""
    gaps = [b[1] - a[2] for rank in range(measured.schedule.num_ranks)
            for a, b in zip(measured.spans(rank), measured.spans(rank)[1:])]
    return max(median(gaps), 0.0) if gaps else 0.0


def crop(timeline: Timeline, first: int, stop: int) -> Timeline:
    """The part of ``timeline`` that works on units ``first .. stop-1`` (and the updates between
    them), shifted to start at time 0."""
    schedule = timeline.schedule
    spans = []
    for rank in range(schedule.num_ranks):
        mine = [(a, s, e) for a, s, e in timeline.spans(rank) if a.microbatch is not None and first <= a.microbatch < stop]
        spans.append(mine)
    begin = min((s for rank in spans for _, s, _ in rank), default=0.0)
    end = max((e for rank in spans for _, _, e in rank), default=0.0)
    programs, starts, ends = [], [], []
    for rank in range(schedule.num_ranks):
        kept = [(a, s, e) for a, s, e in timeline.spans(rank)
                if s >= begin and e <= end and (a.microbatch is None or first <= a.microbatch < stop)]
        programs.append([a for a, _, _ in kept])
        starts.append([s - begin for _, s, _ in kept])
        ends.append([e - begin for _, _, e in kept])
    return Timeline(replace(schedule, programs=programs), starts, ends)


def plot_measured_and_simulated(measured: Timeline, path: str, title: str, units_per_update: int = 1,
                                updates_shown: int = 6, costs: Costs | None = None) -> None:
    """One picture: a window of the measured timeline above the same window simulated (a whole run
    has too many actions to read), on one time axis, with a caption that gives the ratio of their
    times per update and says what the simulation models. ``costs``: a calibrated model
    (:func:`pipetrain.training.prediction.simulation_costs`); default: the measured median action
    times alone."""
    simulated = simulated_counterpart(measured, costs)
    total = measured.schedule.total_microbatches
    shown = min(total, updates_shown * units_per_update)
    first = max(0, (total - shown) // 2 // units_per_update * units_per_update)
    window = (crop(measured, first, first + shown), crop(simulated, first, first + shown))
    label = f"units {first}..{first + shown - 1} of {total}"
    per_update = [seconds_per_update(update_ends(t)) for t in (measured, simulated)]
    if per_update[0] and per_update[1]:
        ratio, what = per_update[0] / per_update[1], "time per update (steady state)"
    else:
        ratio = measured.makespan / simulated.makespan if simulated.makespan > 0 else float("nan")
        what = "time"
    if costs is None:
        model = "the measured median action times"
        caption = (f"The measured run takes {ratio:.2f}x the simulated {what}. The simulation charges each action only "
                   "its measured median compute time (F, B, W, STEP);\nmessages, the waits for them and the Python "
                   "between actions are not in it (a calibration by pipetrain calibrate adds them).")
    else:
        model = "the measured median action times and the calibration"
        caption = (f"The measured run takes {ratio:.2f}x the simulated {what}. Modelled: the measured median F, B, W "
                   "and STEP times; each message's sender and receiver busy time and time in flight\nby size; the "
                   "interpreter's time before every action; all-reduces. Not modelled: transfers overlapping compute "
                   "on the rank's own core, the spread of action times\naround their median, the machine's other load.")
    plot_comparison(
        list(window),
        [f"{title}, {label}: measured ({window[0].makespan * 1e3:.3g} ms; whole run {measured.makespan:.3g} s)",
         f"simulated with {model} ({window[1].makespan * 1e3:.3g} ms; whole run {simulated.makespan:.3g} s)"],
        path,
        time_unit="seconds",
        caption=caption + " Numbers: microbatches, in the bars wide enough to hold them.",
    )
