"""A stage's state for a checkpoint, and its restore: everything needed to continue exactly.

The state holds the weight versions, the optimizer, the counters, the accumulated gradients, the
buffers, float16's loss-scale state and the microbatches in flight: for each, the inputs and
target of its forward and, under ``predict``, the weights that forward read. A restore loads them
and runs those forwards again, so that their backwards find a graph; the replay runs on copies of
the buffers (loaded first), because the running statistics already count those microbatches and
the graphs it records must save no buffer that a later in-place write would invalidate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from pipetrain.execution.device import to_device
from pipetrain.execution.inflight import InFlight
from pipetrain.execution.version_store import VersionStore
from pipetrain.structure import Structure

if TYPE_CHECKING:
    from pipetrain.execution.stage import StageExecutor

__all__ = ["stage_snapshot", "restore_stage", "in_flight_state", "replay_arguments"]


def in_flight_state(microbatch: int, record: InFlight, with_params: bool) -> dict[str, Any]:
    """What a checkpoint keeps of a microbatch in flight, to run its forward again; ``with_params``:
    the weights it read too (a prediction, which no version holds)."""
    return {
        "microbatch": microbatch,
        "version": record.version,
        "samples": record.samples,
        "inputs": tuple(x.detach() if isinstance(x, Tensor) else x for x in record.inputs),
        "structure": None if record.structure is None else record.structure.text,
        "constants": sum(1 << i for i, x in enumerate(record.inputs) if isinstance(x, Tensor)
                         and x.is_floating_point() and not x.requires_grad and i < 62),
        "target": record.target,
        "loss_scale": record.loss_scale,
        "scale": record.scale,
        "params": {n: t.detach() for n, t in record.leaves.items()} if with_params else None,
    }


def replay_arguments(state: dict[str, Any], versions: VersionStore, stamped: bool) -> tuple[tuple, dict[str, Any]]:
    """The positional and keyword arguments of :meth:`StageExecutor.forward` that run the forward of
    :func:`in_flight_state` ``state`` again; ``stamped``: with its float16 stamp."""
    params = None
    if state["params"] is not None:
        params = {**versions[state["version"]], **state["params"]}
    inputs = state["inputs"]
    if state.get("structure") is not None:
        inputs = Structure.parse(state["structure"]).unflatten(inputs)
    return (state["microbatch"], state["version"], inputs), dict(
        target=state["target"], samples=state["samples"], params=params, loss_scale=state["loss_scale"],
        stamp=state.get("scale") if stamped else None, constants=state.get("constants", 0))


def stage_snapshot(executor: StageExecutor) -> dict[str, Any]:
    """:meth:`StageExecutor.snapshot`: weights that are not finite are refused."""
    executor.check_weights("no checkpoint was written")
    grads = executor.grads
    return {
        "versions": {v: dict(p) for v, p in executor.versions.state().items()},
        "current": executor.versions.current,
        "optimizer": executor.optimizer.state_dict() if executor.optimizer is not None else None,
        "samples_seen": executor.samples_seen,
        "pending_samples": executor.pending_samples,
        "grads": None if grads is None else {n: g.clone() for n, g in grads.items()},
        "buffers": {n: b.clone() for n, b in executor.buffers.items()},
        "in_flight": [in_flight_state(k, r, executor.policy == "predict") for k, r in executor.in_flight.items()],
        "fp16": None if executor.scaling is None else executor.scaling.state_dict(),
    }


def restore_stage(executor: StageExecutor, state: dict[str, Any]) -> list[tuple[int, Any, int]]:
    """:meth:`StageExecutor.restore`: ``[(microbatch, outputs, constants)]`` of the forwards run
    again, in their original order."""
    state = to_device(state, executor.device)
    executor.versions = VersionStore.from_state(state["versions"], state["current"], recycle=not executor.recompute)
    executor.leaves.by_version.clear()
    if executor.optimizer is not None and state["optimizer"] is not None:
        executor.optimizer.load_state_dict(state["optimizer"])
    executor.samples_seen = state["samples_seen"]
    executor.pending_samples = state["pending_samples"]
    executor.grads = state["grads"]
    executor.in_flight.clear()
    if executor.scaling is not None and state.get("fp16") is not None:
        executor.scaling.load_state_dict(state["fp16"])
    with torch.no_grad():
        for name, buffer in executor.buffers.items():
            buffer.copy_(state["buffers"][name])
    replayed = []
    with executor.recomputation.buffer_copies():
        for record in state["in_flight"]:
            args, kwargs = replay_arguments(record, executor.versions, executor.scaler is not None)
            out = executor.forward(*args, **kwargs)
            replayed.append((record["microbatch"], out, executor.last_constants))
    return replayed
