"""How long a planner table takes here, and what to do when it is long: a bar, or a refusal.

A level's sweep (:mod:`pipetrain.plan.sweep`) costs about ``STEP_SECONDS`` per machine count
(the numpy calls of one step) plus ``ELEMENT_SECONDS`` per (triple, machine count) it visits, and
holds two ``(machines + 1) x rows x cuts`` tables of float64. The constants are this project's
2-core box under load, rounded up (benchmarks/RESULTS.md, section 6): an estimate to decide
between running quietly, showing progress, and refusing a size that would not finish.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

from pipetrain.errors import PipetrainError, option

__all__ = ["Effort", "STEP_SECONDS", "ELEMENT_SECONDS", "LIMIT_SECONDS", "LIMIT_BYTES"]

STEP_SECONDS = 1.5e-4      # one machine count's step: some 30 numpy calls
ELEMENT_SECONDS = 1.0e-7   # one (triple, machine count), windows and memory limits included
LIMIT_SECONDS = 120.0      # longer than this is refused
LIMIT_BYTES = 2.0e9        # tables larger than this are refused
NOTE_SECONDS = 3.0         # longer than this shows progress


@dataclass
class Effort:
    """One level's table: ``machines`` steps visiting ``elements`` (triple, machine count)
    pairs in all, over rows of ``width`` entries."""

    machines: int
    elements: int
    width: int
    what: str

    @property
    def seconds(self) -> float:
        return self.machines * STEP_SECONDS + self.elements * ELEMENT_SECONDS

    @property
    def bytes(self) -> float:
        return 2.0 * 8.0 * (self.machines + 1) * self.width

    def largest(self) -> int:
        """The most machines this level could have within both limits, the work per machine
        count staying what it is."""
        per_machine = self.elements / max(self.machines, 1)

        def fits(machines: int) -> bool:
            size = Effort(machines, round(per_machine * machines), self.width, self.what)
            return size.seconds <= LIMIT_SECONDS and size.bytes <= LIMIT_BYTES

        count = max(0, min(math.floor(LIMIT_SECONDS / (STEP_SECONDS + per_machine *
                                                       ELEMENT_SECONDS)),
                           math.floor(LIMIT_BYTES / (16.0 * self.width)) - 1))
        while count > 0 and not fits(count):        # the guess is off by rounding at most
            count -= 1
        while fits(count + 1):
            count += 1
        return count

    def check(self) -> None:
        """Refuse a table that would not finish (or fit) here, naming the size that would."""
        if self.seconds <= LIMIT_SECONDS and self.bytes <= LIMIT_BYTES:
            return
        raise PipetrainError(
            f"planning {self.what} would take about {self.seconds:,.0f} s and "
            f"{self.bytes / 1e9:,.1f} GB here ({self.machines:,} machine counts, "
            f"{self.elements:,} stage-range steps), more than the limits of "
            f"{LIMIT_SECONDS:.0f} s and {LIMIT_BYTES / 1e9:.0f} GB; this level can have at most "
            f"{self.largest():,} machines: use fewer workers there ({option('workers')} / {option('topology')})")

    def progress(self, enabled: bool) -> tuple[Callable[[int], None] | None, Callable[[], None]]:
        """A per-machine-count callback and a closer: a tqdm bar on a terminal, one line on
        stderr otherwise, nothing for a short table or when not ``enabled``."""
        if not enabled or self.seconds < NOTE_SECONDS:
            return None, (lambda: None)
        if sys.stderr.isatty():
            from tqdm import tqdm  # only for a bar on a terminal (slow to import beside a plan)

            bar = tqdm(total=self.machines, desc=f"planning {self.what}", unit="machines",
                       leave=False, file=sys.stderr)
            return (lambda machines: bar.update(1)), bar.close
        print(f"planning {self.what}: {self.machines:,} machine counts, about "
              f"{self.seconds:,.0f} s", file=sys.stderr, flush=True)
        return None, (lambda: None)
