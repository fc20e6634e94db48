"""Measured timelines next to simulated ones: the simulator fed with the measured action times."""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from pipetrain.schedule.costs import Costs
from pipetrain.schedule.ir import Kind
from pipetrain.schedule.timeline import Timeline, simulate

__all__ = ["measured_costs", "simulated_counterpart", "plot_measured_and_simulated"]


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
    return Costs(
        F=per_stage(Kind.F),
        B=[b if b else i for b, i in zip(backward, inputs)],
        W=per_stage(Kind.W),
        step=per_stage(Kind.STEP),
    )


def simulated_counterpart(measured: Timeline) -> Timeline:
    return simulate(measured.schedule, measured_costs(measured))


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
                                updates_shown: int = 6) -> None:
    """One picture: a window of the measured timeline above the same window simulated with the
    measured median action times (a whole run has too many actions to read), on one time axis,
    with a caption that says why the measured one is longer."""
    from pipetrain.schedule.plot import plot_comparison

    simulated = simulated_counterpart(measured)
    total = measured.schedule.total_microbatches
    shown = min(total, updates_shown * units_per_update)
    first = max(0, (total - shown) // 2 // units_per_update * units_per_update)
    window = (crop(measured, first, first + shown), crop(simulated, first, first + shown))
    label = f"units {first}..{first + shown - 1} of {total}"
    ratio = measured.makespan / simulated.makespan if simulated.makespan > 0 else float("nan")
    plot_comparison(
        list(window),
        [f"{title}, {label}: measured ({window[0].makespan * 1e3:.3g} ms; whole run {measured.makespan:.3g} s)",
         f"simulated with the measured median action times ({window[1].makespan * 1e3:.3g} ms; "
         f"whole run {simulated.makespan:.3g} s)"],
        path,
        time_unit="seconds",
        caption=(f"Why the measured run takes {ratio:.1f}x the simulated time: the simulation charges each action "
                 "only its measured median compute time (F, B, W, STEP);\nmessages sent and received, the waits for "
                 "them and the Python between actions are not in it. Numbers: microbatches, in the bars wide enough "
                 "to hold them."),
    )
