"""Resuming a synchronous run's checkpoint with another cut: other stages, stage count, replicas.

A checkpoint holds one file per rank with the state of its stages under the stages' own names
(:meth:`~pipetrain.runtime.rank_runner.RankRunner.snapshot`). On a synchronous schedule (one weight
version, a flush after every update) a checkpoint lies between two updates: no microbatch is in
flight, no gradient is accumulated, and every stage holds the same version of its part of the
model. That state is a function of the unsplit model's tensors alone, so it can be cut again:
each rank of the resuming run takes, by unsplit name, the weights, buffers and optimizer state of
its new stages from the old ranks' files, and the losses and evaluations recorded so far. The
resumed run then computes what the uninterrupted run computes on the new cut, which on a
synchronous schedule is what it computes on any cut: bitwise the same parameters.

Asynchronous schedules are refused: their checkpoints hold stashed versions and microbatches in
flight whose delays are set by the cut (stage ``s`` of a PipeDream pipeline is ``S - 1 - s``
updates behind), which no other cut has. So are float16 runs (every stage keeps its own loss-scale
history) and ``torch.optim`` optimizers other than pipetrain's own (their state is kept by
parameter position, not name).

What a checkpoint records for this (:func:`layout_of`, the manifest's ``meta["layout"]``): the
version policy, which stages each rank runs, and for every stage the unsplit name of each of its
parameters and buffers. The idea is that of ``torch.distributed.checkpoint``'s resharding (state
saved under global names, loaded into another layout); pipetrain keeps its own per-rank files,
which also hold what only its schedules have (versions in flight, stamps, losses).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

from pipetrain.runtime.checkpoint import check_compatible
from pipetrain.runtime.errors import CheckpointMismatchError
from pipetrain.stages.materialize import first_names

__all__ = ["CUT_KEYS", "rank_file", "layout_of", "recut_needed", "recut_state"]

#: what a synchronous run may change when it resumes: the cut (the schedule stays the same)
CUT_KEYS = frozenset({"stages", "balance", "split_at", "replicas", "chunks", "stage_costs", "workers"})


def rank_file(rank: int) -> str:
    """The file of a rank's state in a checkpoint: ``rank-3.pt``."""
    return f"rank-{rank}.pt"


def _unsplit_names(model, module) -> dict[str, str]:
    """``{name in module: first qualified name in model}`` for ``module``'s parameters and buffers."""
    first = first_names(model)
    names = {}
    for name, value in [*module.named_parameters(), *module.named_buffers()]:
        names[name] = first.get(id(value), name)
    return names


def layout_of(run) -> dict[str, Any]:
    """What a checkpoint of ``run`` records so that another cut can resume it (module docstring)."""
    schedule = run.schedule
    return {
        "policy": schedule.policy,
        "precision": run.config.precision,
        "rank_stages": [list(stages) for stages in schedule.rank_stages()],
        "stage_ranks": [list(ranks) for ranks in schedule.stage_ranks],
        "names": [_unsplit_names(run.model, stage) for stage in run.staged.stages],
    }


def recut_needed(saved: Mapping[str, Any], current: Mapping[str, Any], keys: Iterable[str], run, where: str) -> bool:
    """Whether a checkpoint whose metadata is ``saved`` resumes ``run`` (``current`` metadata,
    compared on ``keys``) on another cut: ``False`` when nothing differs, ``True`` when only the cut does and both runs are
    synchronous; otherwise a :class:`CheckpointMismatchError` that names the differences and,
    where only the cut differs, why this run cannot take it."""
    keys = list(keys)
    try:
        check_compatible(saved, current, keys, where=where)
        return False
    except CheckpointMismatchError as mismatch:
        differing = {key for key in keys if _differs(saved.get(key), current.get(key))}
        if not differing <= CUT_KEYS:
            raise
        layout = saved.get("layout")
        reason = _why_not(layout, run)
        if reason:
            cut = ", ".join(f"{key} {saved.get(key)!r}" for key in sorted(differing))
            raise CheckpointMismatchError(
                f"cannot resume from {where} on another cut ({cut} there): {reason}. Resume with the cut it was "
                f"written with, or start afresh with another checkpoint directory"
            ) from None
        return True if layout is not None else _raise(mismatch)


def _raise(error: Exception) -> bool:
    raise error


def _differs(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str)


def _why_not(layout: Mapping[str, Any] | None, run) -> str:
    """Why a checkpoint with ``layout`` cannot be cut again for ``run`` ("" when it can)."""
    if layout is None:
        return "it was written without the record of its stages' tensors that a new cut needs"
    if layout["policy"] != "flush":
        return (f"it was written by an asynchronous schedule (version policy {layout['policy']}), whose stashed "
                f"weight versions and microbatches in flight belong to its cut (each stage's delay is its depth)")
    if run.schedule.policy != "flush":
        return f"this run's schedule {run.schedule.name} is asynchronous; only synchronous ones resume on a new cut"
    if "fp16" in (layout.get("precision"), run.config.precision):
        return "float16 runs keep a loss-scale history per stage, which does not carry over to other stages"
    return ""


def recut_state(checkpoint, run, rank: int) -> dict[str, Any]:
    """This rank's state, as :meth:`RankRunner.snapshot` makes it, built from the old ranks' files
    of ``checkpoint`` for the stages ``rank`` runs in ``run`` (each file is read once)."""
    layout = checkpoint.meta["layout"]
    owners: dict[str, tuple[int, int, str]] = {}  # unsplit name -> (old rank, old stage, old stage's name)
    for old_rank, stages in enumerate(layout["rank_stages"]):
        for stage in stages:
            for name, unsplit in layout["names"][stage].items():
                owners.setdefault(unsplit, (old_rank, stage, name))
    files: dict[int, Any] = {}

    def file(old_rank: int) -> Any:
        if old_rank not in files:
            files[old_rank] = checkpoint.load(rank_file(old_rank))
        return files[old_rank]

    schedule = run.schedule
    stages = {stage: _stage_state(run, stage, owners, file, checkpoint) for stage in schedule.rank_stages()[rank]}
    last, old_last = schedule.num_stages - 1, _ranks_of_last(layout)
    losses: dict[int, float] = {}
    if last in stages:  # the losses of the units whose last stage this rank runs now
        for old_rank in old_last:
            losses.update((k, v) for k, v in file(old_rank)["losses"].items() if schedule.rank_of(last, int(k)) == rank)
    evaluations = file(old_last[0])["evaluations"]  # recorded where the last stage's first replica ran
    return {"stages": stages, "losses": losses, "labels": {}, "evaluations": list(evaluations), "rng": file(0)["rng"]}


def _ranks_of_last(layout: Mapping[str, Any]) -> list[int]:
    """The old ranks that ran a replica of the last stage, the first replica's first."""
    return list(layout["stage_ranks"][-1])


def _stage_state(run, stage: int, owners, file, checkpoint) -> dict[str, Any]:
    """The executor snapshot of new ``stage``: each tensor from the old stage that held it."""
    names = _unsplit_names(run.model, run.staged.stages[stage])
    module = run.staged.stages[stage]
    params = [n for n, _ in module.named_parameters()]
    buffers = [n for n, _ in module.named_buffers()]
    weights, buffer_values, optimizer_state = {}, {}, {}
    first = None
    for name in params + buffers:
        unsplit = names[name]
        if unsplit not in owners:
            raise CheckpointMismatchError(f"checkpoint {checkpoint.path} holds no {unsplit!r}: it was written for "
                                          f"another model")
        old_rank, old_stage, old_name = owners[unsplit]
        old = file(old_rank)["stages"][old_stage]
        first = first or old
        _check_between_updates(old, checkpoint, old_stage)
        if name in buffers and name not in params:
            buffer_values[name] = old["buffers"][old_name]
            continue
        weights[name] = old["versions"][old["current"]][old_name]
        if old["optimizer"] is not None:
            if old["optimizer"].get("torch") is not None:
                raise CheckpointMismatchError(
                    f"cannot resume from checkpoint {checkpoint.path} on another cut: its torch.optim optimizer "
                    f"keeps its state by parameter position, not by name; resume with the cut it was written with")
            if old_name in old["optimizer"]["state"]:
                optimizer_state[name] = old["optimizer"]["state"][old_name]
    assert first is not None
    optimizer = None
    if first["optimizer"] is not None:
        optimizer = {**first["optimizer"], "state": optimizer_state}
    return {
        "versions": {first["current"]: weights}, "current": first["current"], "optimizer": optimizer,
        "samples_seen": first["samples_seen"], "pending_samples": 0, "grads": None, "buffers": buffer_values,
        "in_flight": [], "fp16": None,
    }


def _check_between_updates(old: Mapping[str, Any], checkpoint, stage: int) -> None:
    if old["in_flight"] or old["grads"] is not None or old["pending_samples"]:
        raise CheckpointMismatchError(
            f"checkpoint {checkpoint.path}: stage {stage} holds work of an unfinished update, which only its own "
            f"cut can resume; resume with the cut it was written with")
