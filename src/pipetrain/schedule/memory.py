"""Memory a schedule needs, from program order alone: activations in flight and weight versions.

A microbatch's activations are held on a stage from its forward until its backward (B, or I when
the backward is split: W needs only the stage input and output gradient). A weight version is
held from the STEP that creates it until it is no longer current and its last reader has run.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.schedule._gc import gc_paused
from pipetrain.schedule.ir import Kind, Schedule

__all__ = ["StageMemory", "memory_by_rank"]


@dataclass
class StageMemory:
    """Peaks on one rank: per stage held, and for the rank as a whole."""

    rank: int
    peak_activations: dict[int, int]
    peak_versions: dict[int, int]
    rank_peak_activations: int


def memory_by_rank(schedule: Schedule) -> list[StageMemory]:
    """Peak in-flight microbatches and live weight versions of every rank and stage it holds."""
    with gc_paused():
        return [_rank_memory(rank, program) for rank, program in enumerate(schedule.programs)]


def _rank_memory(rank: int, program) -> StageMemory:
    F, B, I = Kind.F, Kind.B, Kind.I
    in_flight: dict[int, int] = {}
    peak: dict[int, int] = {}
    total = total_peak = 0
    for kind, stage, _, _, _ in program:
        if kind is F:
            count = in_flight.get(stage, 0) + 1
            in_flight[stage] = count
            if count > peak.get(stage, 0):
                peak[stage] = count
            total += 1
            if total > total_peak:
                total_peak = total
        elif kind is B or kind is I:
            in_flight[stage] = in_flight.get(stage, 0) - 1
            total -= 1
    return StageMemory(rank, peak, _peak_versions(program), total_peak)


def _peak_versions(program) -> dict[int, int]:
    """Per stage, the most versions alive at once.

    Version v of a stage is born at the STEP that makes it (version 0 before the program) and dies
    at the later of the next version's birth and its last read.
    """
    births: dict[int, list[int]] = {}
    last_read: dict[int, dict[int, int]] = {}
    STEP = Kind.STEP
    for position, (kind, stage, _, version, _) in enumerate(program):
        if kind is STEP:
            births.setdefault(stage, [-1]).append(position)
        elif version is not None:
            reads = last_read.get(stage)
            if reads is None:
                births.setdefault(stage, [-1])
                reads = last_read[stage] = {}
            reads[version] = position
    peaks = {}
    for stage, born in births.items():
        reads = last_read.get(stage, {})
        events = []
        for version, birth in enumerate(born):
            successor = born[version + 1] if version + 1 < len(born) else len(program)
            death = max(successor, reads.get(version, -1) + 1)
            events.append((birth, 1))
            events.append((death, -1))
        events.sort()
        alive = best = 0
        for _, delta in events:
            alive += delta
            best = max(best, alive)
        peaks[stage] = best
    return peaks
