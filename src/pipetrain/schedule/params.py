"""Checks of schedule parameters, shared by the generators, with messages that say what works."""

from __future__ import annotations

from typing import Sequence

from pipetrain.errors import ScheduleError, option

__all__ = ["check_positive", "normalise_replicas"]


def check_positive(name: str, value: int) -> None:
    """Refuse ``value`` of the parameter (and option) ``name`` unless it is an integer of 1 or more."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ScheduleError(f"{option(name)} must be a positive integer (1 or more), got {value!r}")


def normalise_replicas(stages: int, replicas: Sequence[int] | None, schedule: str) -> list[int]:
    """Replicas per stage (all 1 when not given), checked against the stage count."""
    if replicas is None:
        return [1] * stages
    replicas = list(replicas)
    if len(replicas) != stages:
        raise ScheduleError(
            f"{option('replicas')} lists {len(replicas)} counts but there are {stages} stages; give one count per "
            f"stage, e.g. {option('replicas', [1] * stages)}"
        )
    if any((not isinstance(r, int)) or r < 1 for r in replicas):
        raise ScheduleError(f"every replica count must be a positive integer, got {replicas}")
    return replicas
