"""Memory a schedule needs, from program order alone: activations in flight and weight versions.

A microbatch's activations are held on a stage from its forward until its backward (B, or I when
the backward is split: W needs only the stage input and output gradient). A pair (DualPipe's F
and B in one action) counts as its forward and then its backward: the forward's activations are
taken before the other microbatch's are freed, on a GPU that overlaps them as on a CPU. A weight version is
held from the STEP that creates it until it is no longer current and its last reader has run.

With activation recomputation (``recompute=True`` for every stage, or the stages that recompute:
``--recompute stage`` or ``stage:0,2``) such a stage holds only the *inputs* of a microbatch from
its forward until its backward, which runs the forward again: the whole activations of a
microbatch then live only during its B (or from its I to its W). The recomputation reads the
version the forward read, so under the ``latest`` policy (PB) that version lives until the
backward too. docs/design.md 3.3: ``d`` microbatches in flight hold ``d * A_in + A_tot/d`` instead of
``d * A_tot/d``. Stages that do not recompute are counted as without it, on the same rank too
(an interleaved rank may recompute one of its chunks and not the other).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Sequence

from pipetrain.collector import gc_paused
from pipetrain.schedule.ir import Kind, Schedule, halves
from pipetrain.schedule.pattern import pattern_of
from pipetrain.schedule.recompute_stages import recompute_stages

__all__ = ["StageMemory", "memory_by_rank", "StageSizes", "bytes_by_rank"]


@dataclass
class StageMemory:
    """Peaks on one rank: per stage held, and for the rank as a whole.

    ``peak_activations`` counts microbatches whose whole activations (the autograd graph) are held;
    ``peak_inputs`` those of which only the stage inputs are kept for recomputation (for the
    stages that recompute only)."""

    rank: int
    peak_activations: dict[int, int]
    peak_versions: dict[int, int]
    rank_peak_activations: int
    peak_inputs: dict[int, int] = field(default_factory=dict)


def memory_by_rank(schedule: Schedule, *, recompute: bool | str | Collection[int] = False) -> list[StageMemory]:
    """Peak in-flight microbatches and live weight versions of every rank and stage it holds;
    ``recompute``: the stages with activation recomputation (``True``: every stage; a
    ``--recompute`` text such as ``stage:0,2``; or stage numbers), see the module docstring.

    A long schedule's pattern repeats what is held: its peaks are its check sample's (the head,
    the body met by bodies on both sides, the tail), computed without walking the whole run."""
    pattern = pattern_of(schedule)
    if pattern is not None:
        return memory_by_rank(pattern.check_sample, recompute=recompute)
    again = recompute_stages(recompute, schedule.num_stages)
    with gc_paused():
        return [_rank_memory(rank, program, again) for rank, program in enumerate(schedule.programs)]


@dataclass(frozen=True)
class StageSizes:
    """Bytes of one stage: ``parameters``, its trainable parameters (one weight version, and its
    gradient sums); ``optimizer``, the optimizer's state; ``held``, what a microbatch in flight
    keeps (autograd's saved tensors, the stage's input and output); ``inputs``, what a microbatch
    keeps instead on a stage that recomputes."""

    parameters: int
    optimizer: int
    held: int
    inputs: int = 0
    #: the gradient sums' bytes when not one per parameter (an update made during the backward,
    #: parameter by parameter, holds one parameter's gradient at a time)
    gradients: int | None = None


def bytes_by_rank(schedule: Schedule, sizes: Sequence[StageSizes], *,
                  recompute: bool | str | Collection[int] = False) -> list[dict[str, int]]:
    """Per rank, the bytes training adds to what the rank held before it (its stages' modules:
    weight version 0): ``gradients`` (one sum per trainable parameter), ``optimizer`` (its state),
    ``versions`` (the weight versions held beyond the first), ``activations`` (the peak over the
    program of what the microbatches in flight hold; a split backward keeps a microbatch's graph
    from F until its W) and their ``total``. ``sizes[s]``: stage s's :class:`StageSizes`."""
    if len(sizes) != schedule.num_stages:
        raise ValueError(f"bytes_by_rank: {len(sizes)} stage sizes for {schedule.num_stages} stages")
    pattern = pattern_of(schedule)
    sample = pattern.check_sample if pattern is not None else schedule
    again = recompute_stages(recompute, schedule.num_stages)
    out = []
    for rank, stages in enumerate(schedule.rank_stages()):
        held = set(stages)
        versions = _peak_versions(sample.programs[rank], again)
        parts = {
            "gradients": sum(sizes[s].parameters if sizes[s].gradients is None else sizes[s].gradients for s in held),
            "optimizer": sum(sizes[s].optimizer for s in held),
            "versions": sum((versions.get(s, 1) - 1) * sizes[s].parameters for s in held),
            "activations": _peak_activation_bytes(sample.programs[rank], sizes, again),
        }
        parts["total"] = sum(parts.values())
        out.append(parts)
    return out


def _peak_activation_bytes(program, sizes: Sequence[StageSizes], recompute: frozenset[int]) -> int:
    """The most bytes the program's microbatches in flight hold at once: a microbatch's ``held``
    from its F until its B or W (its inputs alone until the backward on a stage that recomputes,
    which makes the whole again)."""
    F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
    now = peak = 0
    for kind, stage, _, _, _ in _flat(program):
        held, inputs = sizes[stage].held, sizes[stage].inputs
        again = stage in recompute
        if kind is F:
            now += inputs if again else held
        elif kind is I and again:
            now += held - inputs
        elif kind is B and again:
            now += held - inputs
            peak = max(peak, now)
            now -= held
            continue
        elif kind is B or kind is W:
            now -= held
        peak = max(peak, now)
    return peak


def _rank_memory(rank: int, program, recompute: frozenset[int] = frozenset()) -> StageMemory:
    """The peaks of one rank's program. A microbatch holds its whole activations from F to B (or
    I); on the stages ``recompute``, only its inputs from F to B (or I), and its whole activations
    during B and from I to W."""
    F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W
    inputs: dict[int, int] = {}
    input_peak: dict[int, int] = {}
    graphs: dict[int, int] = {}
    peak: dict[int, int] = {}
    total = total_peak = 0

    def rise(counts: dict[int, int], peaks: dict[int, int], stage: int) -> None:
        counts[stage] = counts.get(stage, 0) + 1
        peaks[stage] = max(peaks.get(stage, 0), counts[stage])

    for kind, stage, _, _, _ in _flat(program):
        again = stage in recompute
        if kind is F:
            if again:
                rise(inputs, input_peak, stage)
                continue
            rise(graphs, peak, stage)
            total += 1
            total_peak = max(total_peak, total)
        elif kind is B or kind is I:
            if not again:
                graphs[stage] -= 1
                total -= 1
                continue
            inputs[stage] -= 1
            rise(graphs, peak, stage)  # the forward again, then the backward (I: the graph stays for W)
            total += 1
            total_peak = max(total_peak, total)
            if kind is B:
                graphs[stage] -= 1
                total -= 1
        elif kind is W and again:
            graphs[stage] -= 1
            total -= 1
    return StageMemory(rank, peak, _peak_versions(program, recompute), total_peak, input_peak)


def _peak_versions(program, recompute: frozenset[int] = frozenset()) -> dict[int, int]:
    """Per stage, the most versions alive at once.

    Version v of a stage is born at the STEP that makes it (version 0 before the program) and dies
    at the later of the next version's birth and its last read; on a stage of ``recompute`` the
    backward of a microbatch (B or I) also reads the version its forward read.
    """
    births: dict[int, list[int]] = {}
    last_read: dict[int, dict[int, int]] = {}
    forward_version: dict[tuple[int, int], int] = {}
    STEP, F, B, I = Kind.STEP, Kind.F, Kind.B, Kind.I
    for position, (kind, stage, k, version, _) in _positioned(program):
        if kind is STEP:
            births.setdefault(stage, [-1]).append(position)
        elif version is not None:
            reads = last_read.get(stage)
            if reads is None:
                births.setdefault(stage, [-1])
                reads = last_read[stage] = {}
            reads[version] = position
            if stage in recompute:
                if kind is F:
                    forward_version[(stage, k)] = version
                elif kind is B or kind is I:
                    read = forward_version.pop((stage, k), version)
                    reads[read] = max(reads.get(read, -1), position)
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


def _flat(program):
    """The program with each pair as its two halves: a pair's forward holds its activations before
    its backward runs, on a GPU as on a CPU."""
    FB = Kind.FB
    for action in program:
        if action[0] is FB:
            yield from halves(action)
        else:
            yield action


def _positioned(program):
    """``(position, action)``, a pair's two halves at its one position."""
    FB = Kind.FB
    for position, action in enumerate(program):
        if action[0] is FB:
            for half in halves(action):
                yield position, half
        else:
            yield position, action
