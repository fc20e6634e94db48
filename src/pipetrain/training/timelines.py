"""Measured timelines next to simulated ones: the simulator fed with the measured action times."""

from __future__ import annotations

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


def plot_measured_and_simulated(measured: Timeline, path: str, title: str) -> None:
    """One picture: the measured timeline above the simulated one, on a shared time axis (s)."""
    from pipetrain.schedule.plot import plot_comparison

    simulated = simulated_counterpart(measured)
    plot_comparison(
        [measured, simulated],
        [f"{title}: measured (makespan {measured.makespan:.3g} s)",
         f"simulated with the measured median action times (makespan {simulated.makespan:.3g} s)"],
        path,
        time_unit="seconds",
    )
