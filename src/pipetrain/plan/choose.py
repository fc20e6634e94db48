"""``schedule="auto"`` for a run: the synchronous schedule that the timeline simulator says is fastest
for the run's ranks, microbatches and unit costs, within an activation-memory bound.

Every candidate (:data:`CANDIDATES`) cuts the run's units into its stages (``ranks``, or ``2 * ranks``
for the schedules whose ranks hold two chunks) by a balanced block partition of the unit costs; a
stage's forward costs a third of its units' cost and its backward two thirds, the zero-bubble
schedules' backward split into equal input- and weight-gradient halves (the usual 1 : 1 : 1 of
F : I : W). Each is scored by its time per step in steady state, as the planner scores plans: the
simulated makespan of 4 steps less that of 2, halved (a step's drain may overlap the next step's
fill, as zb-h2's and zb-v's do). Communication is not charged (the run's messages are
small beside its compute on one machine; ``pipetrain plan`` prices them for a profile), unless a
calibration is given with unit costs in seconds: then every action pays its overhead and every
message its sender's and receiver's busy time and its latency (sizes unknown here: the per-message
parts), which count against the schedules with many small actions.

Peak activations are counted in microbatches of the whole model, each stage holding an equal share
(units' activations are not measured): rank r of 1f1b holds ``min(R - r, m)`` microbatches of a
1/R stage, at most ``min(R, m) / R``; a candidate is kept where its worst rank holds at most
``memory`` times that (default 1: 1f1b's own peak), read off its generated order
(:func:`pipetrain.schedule.memory_by_rank`). The fastest kept wins; of equal times (to a relative
1e-9) the one holding less, then the earlier in :data:`CANDIDATES` (one stage per rank first, then
the V schedules, whose turn is a hand-off on the rank where a looped schedule sends a message). The result depends only on its
arguments: every worker of a run chooses alike from the same unit costs.

Never chosen: the asynchronous schedules (pipedream, 2bw, pb), which change what is trained
(stale weights) and not only how fast, and zb-auto, itself a search of orders (name it to use it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pipetrain.errors import ConfigError, PipetrainError, option
from pipetrain.plan.baselines import block_partition
from pipetrain.schedule import Costs, build, memory_by_rank, simulate
from pipetrain.schedule.presets import LOOPED, V_SHAPED

__all__ = ["CANDIDATES", "AutoChoice", "choose_schedule", "parse_auto", "is_auto"]

#: what ``auto`` compares, in the order that breaks exact ties
CANDIDATES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "dualpipev", "interleaved", "interleaved-zb",
              "bfs", "gpipe")
#: the candidates whose backward runs split into I and W somewhere in their order (costed F : I : W)
_SPLIT = {"zb-h1", "zb-h2", "interleaved-zb", "zb-v", "v-half", "v-min", "dualpipev"}


@dataclass
class AutoChoice:
    """The chosen schedule and how every candidate fared (for the run's heading and report)."""

    schedule: str
    chunks: int                   # the model chunks each rank holds under it
    memory: float                 # the activation bound, in multiples of 1f1b's peak
    candidates: list[dict] = field(default_factory=list)
    priced_by: str = "the given unit costs"  # what the unit costs were (measured times, parameter counts)

    def as_dict(self) -> dict:
        return {"schedule": self.schedule, "chunks": self.chunks, "memory_vs_1f1b": self.memory,
                "priced_by": self.priced_by, "candidates": [dict(c) for c in self.candidates]}

    def text(self) -> str:
        """One line: what was chosen, and each candidate's simulated step or why it was left out."""
        parts = []
        unit = " s" if "time" in self.priced_by else ""  # parameter counts price a step in parameters
        for c in self.candidates:
            if "seconds" in c:
                parts.append(f"{c['schedule']} {c['seconds']:.3g}{unit}" + ("" if c["fits"] else " (over memory)"))
            else:
                parts.append(f"{c['schedule']} -")
        return (f"schedule auto chose {self.schedule}: the fastest simulated step within "
                f"{self.memory:g}x 1f1b's activations, units priced by {self.priced_by} ({'; '.join(parts)})")


def is_auto(name: str | None) -> bool:
    return name is not None and (name == "auto" or name.startswith("auto:"))


def parse_auto(name: str) -> float:
    """The activation bound of ``auto`` (1: 1f1b's) or ``auto:memory=X`` (X times 1f1b's)."""
    if name == "auto":
        return 1.0
    key, _, value = name[len("auto:"):].partition("=")
    try:
        bound = float(value) if key == "memory" else float("nan")
    except ValueError:
        bound = float("nan")
    if not bound > 0:
        raise ConfigError(f"cannot read {option('schedule', name)}; write auto, or auto:memory=X for X times "
                          f"1f1b's peak activations (e.g. auto:memory=2)")
    return bound


def choose_schedule(unit_costs: Sequence[float], ranks: int, microbatches: int, *,
                    memory: float = 1.0, calibration: Costs | None = None) -> AutoChoice:
    """The fastest candidate over ``ranks`` ranks and ``microbatches`` per step for units costing
    ``unit_costs`` (forward + backward, in execution order), holding at most ``memory`` times
    1f1b's peak activations (module docstring); ``calibration``: per-action and per-message costs
    to charge too (``unit_costs`` must then be seconds)."""
    if ranks < 1 or microbatches < 1:
        raise ConfigError(f"schedule auto needs at least one rank and microbatch, got {ranks} and {microbatches}")
    bound = memory * min(ranks, microbatches) / ranks
    found: list[dict] = []
    best: dict | None = None
    for name in CANDIDATES:
        chunks = 2 if name in LOOPED or name in V_SHAPED else 1
        pieces = ranks * chunks
        entry: dict = {"schedule": name, "chunks": chunks}
        found.append(entry)
        if pieces > len(unit_costs):
            entry["skipped"] = f"needs {pieces} units, the model has {len(unit_costs)}"
            continue
        if chunks > 1 and ranks == 1 and name in LOOPED:
            entry["skipped"] = "one rank"
            continue
        bounds = block_partition(list(unit_costs), pieces)
        stage = [float(sum(unit_costs[a:b])) for a, b in zip(bounds, bounds[1:])]
        split = name in _SPLIT
        costs = Costs(F=[t / 3 for t in stage], B=[t / 3 if split else 2 * t / 3 for t in stage],
                      W=[t / 3 for t in stage] if split else 0.0)
        if calibration is not None:  # no message sizes here: the per-byte parts charge nothing
            costs.charging(calibration)
        try:
            looped = chunks if name in LOOPED else 1
            spans = [simulate(build(name, ranks, microbatches, steps=steps, chunks=looped), costs).makespan
                     for steps in (2, 4)]
            seconds = (spans[1] - spans[0]) / 2
            schedule = build(name, ranks, microbatches, chunks=looped)
        except PipetrainError as error:
            entry["skipped"] = str(error).split(";")[0]
            continue
        held = max(rank.rank_peak_activations for rank in memory_by_rank(schedule)) / pieces
        entry.update(seconds=seconds, activations=held, fits=held <= bound * (1 + 1e-9))
        if entry["fits"] and (best is None or _better(entry, best)):
            best = entry
    if best is None:
        raise ConfigError(f"no schedule fits {memory:g}x 1f1b's activations over {ranks} ranks with {microbatches} "
                          f"microbatches; raise the bound ({option('schedule', 'auto:memory=2')}) or name a schedule")
    return AutoChoice(schedule=best["schedule"], chunks=best["chunks"], memory=memory, candidates=found)


def _better(entry: dict, best: dict) -> bool:
    """Faster, or as fast (relative 1e-9) holding less; the candidates' order breaks what is left."""
    tolerance = 1e-9 * max(abs(best["seconds"]), 1e-300)
    if entry["seconds"] < best["seconds"] - tolerance:
        return True
    return entry["seconds"] <= best["seconds"] + tolerance and entry["activations"] < best["activations"] - 1e-12
