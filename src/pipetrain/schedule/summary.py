"""Summaries of a timeline: makespan, bubbles, per-stage busy/idle and memory, versions read.

Two bubble figures are reported, both over all ranks: ``bubble_fraction`` is idle time over total
time (makespan times ranks; GPipe's and this project's convention, (S-1)/(m+S-1) for balanced
1F1B) and ``bubble_fraction_megatron`` is idle time over busy ("ideal") time, Megatron-LM's
(S-1)/m form. ``peak_activation_memory`` is the most activations a rank holds, in microbatches of
one stage of the unchunked model (a chunk of an interleaved or V schedule counts 1/v), so that
schedules with and without chunks compare.
"""

from __future__ import annotations

from typing import Any, Collection

from pipetrain.schedule.ir import Kind, Schedule, halves
from pipetrain.schedule.memory import memory_by_rank
from pipetrain.schedule.recompute_stages import format_recompute, recompute_stages
from pipetrain.schedule.timeline import Timeline, positions

__all__ = ["summarize", "versions_read", "format_summary"]


def versions_read(schedule: Schedule) -> list[list[tuple[int | None, int | None]]]:
    """``versions[stage][k] = (version read by F, version read by the backward (B or I))``."""
    total = schedule.total_microbatches
    forward = [[None] * total for _ in range(schedule.num_stages)]
    backward = [[None] * total for _ in range(schedule.num_stages)]
    F, B, I = Kind.F, Kind.B, Kind.I
    for program in schedule.programs:
        for kind, stage, k, version, _ in (half for action in program for half in halves(action)):
            if kind is F:
                if k < total:
                    forward[stage][k] = version
            elif kind is B or kind is I:
                if k < total:
                    backward[stage][k] = version
    return [list(zip(f, b)) for f, b in zip(forward, backward)]


def summarize(timeline: Timeline, *, include_versions: bool = True,
              recompute: bool | str | Collection[int] = False) -> dict[str, Any]:
    """The JSON summary of a simulated (or measured) timeline; ``recompute``: memory with activation
    recomputation on those stages (``True``: all; see :func:`memory_by_rank`): their
    ``peak_activations`` then count whole graphs, ``peak_inputs`` kept inputs."""
    schedule = timeline.schedule
    makespan = timeline.makespan
    busy = [timeline.busy(rank) for rank in range(schedule.num_ranks)]
    again = recompute_stages(recompute, schedule.num_stages)
    memory = memory_by_rank(schedule, recompute=again)
    held = schedule.rank_stages()
    stages = []
    for position, ranks in enumerate(positions(schedule)):
        position_busy = sum(busy[r] for r in ranks) / len(ranks)
        if schedule.chunks > 1:
            activations = max(memory[r].rank_peak_activations for r in ranks)
        else:
            activations = max(memory[r].peak_activations.get(position, 0) for r in ranks)
        versions = max((max(memory[r].peak_versions.values(), default=1) for r in ranks), default=1)
        stages.append(
            {
                "stage": position,
                "ranks": ranks,
                "busy": position_busy,
                "idle": makespan - position_busy,
                "peak_activations": activations,
                "peak_versions": versions,
            }
        )
        if any(again.intersection(held[r]) for r in ranks):
            stages[-1]["peak_inputs"] = max(max(memory[r].peak_inputs.values(), default=0) for r in ranks)
    total_busy = sum(busy)
    total_time = makespan * schedule.num_ranks
    idle = total_time - total_busy
    units = schedule.total_microbatches
    summary: dict[str, Any] = {
        "schedule": schedule.name,
        "policy": schedule.policy,
        "num_stages": len(stages),
        "num_ranks": schedule.num_ranks,
        "microbatches": schedule.microbatches,
        "steps": schedule.steps,
        "chunks": schedule.chunks,
        "replicas": schedule.replicas if schedule.chunks == 1 else [1] * schedule.num_ranks,
        "makespan": makespan,
        "bubble_fraction": idle / total_time if total_time else 0.0,
        "bubble_fraction_megatron": idle / total_busy if total_busy else 0.0,
        "time_per_microbatch": makespan / units if units else 0.0,
        "peak_activation_memory": max((s["peak_activations"] for s in stages), default=0) / schedule.chunks,
        "stages": stages,
        "ranks": [{"rank": r, "busy": busy[r], "idle": makespan - busy[r]} for r in range(schedule.num_ranks)],
    }
    if again:
        summary["recompute"] = format_recompute(again, schedule.num_stages)
    if include_versions:
        summary["versions"] = versions_read(schedule)
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """A readable table of :func:`summarize`'s result."""
    head = (
        f"{summary['schedule']} (policy {summary['policy']}): {summary['num_stages']} stages on "
        f"{summary['num_ranks']} ranks, {summary['microbatches']} microbatches x {summary['steps']} steps"
        + (f", {summary['chunks']} chunks per rank" if summary["chunks"] > 1 else "")
    )
    lines = [
        head,
        f"  makespan             {summary['makespan']:.6g}",
        f"  time per microbatch  {summary['time_per_microbatch']:.6g}",
        f"  bubble               {100 * summary['bubble_fraction']:.1f} % of total time (idle / total); "
        f"{100 * summary['bubble_fraction_megatron']:.1f} % idle / busy (Megatron)",
        f"  peak activations     {summary['peak_activation_memory']:g} microbatches of one stage on a rank"
        + (f" (a chunk counts 1/{summary['chunks']}; the rows count chunks)" if summary["chunks"] > 1 else ""),
        "",
        f"  {'stage':>5}  {'ranks':<10} {'busy':>10} {'idle':>10} {'peak activations':>17} {'peak versions':>14}",
    ]
    for stage in summary["stages"]:
        ranks = ",".join(str(r) for r in stage["ranks"])
        lines.append(
            f"  {stage['stage']:>5}  {ranks:<10} {stage['busy']:>10.6g} {stage['idle']:>10.6g} "
            f"{stage['peak_activations']:>17} {stage['peak_versions']:>14}"
            + (f"  (+{stage['peak_inputs']} inputs kept)" if "peak_inputs" in stage else "")
        )
    if summary.get("recompute", "none") != "none":
        lines.append(f"  with recomputation ({summary['recompute']}): peak activations count whole graphs, inputs "
                     "kept are stage inputs only")
    return "\n".join(lines)
