"""Calibrating the simulator where runs happen: the costs file of ``pipetrain calibrate``, also
made at the start of a run or a profile that asks for it (``--calibrate``).

Two workers started by pipetrain's launcher, pinned to one core each with one thread as training
workers are, measure the transport (:func:`pipetrain.runtime.calibrate.measure_transport`:
messages, all-reduces, the optimizer step), then train a small 2-stage model on 1f1b
(:data:`OVERHEAD_RUN`) in the same process group, whose measured timeline gives the interpreter's
time per action (``overhead``) and whose memory report what a worker adds above its start whatever
the model (``worker_bytes``). With one rank no transport can be measured: the file holds the
overhead (on the emulator's interpreter) and the optimizer step, says so in ``measured_on``, and
the simulator charges no communication. About ten seconds on a CPU.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import torch

from pipetrain.errors import ConfigError
from pipetrain.runtime.calibrate import SIZES, measure_step, measure_transport
from pipetrain.runtime.errors import LaunchError
from pipetrain.runtime.launch import launch
from pipetrain.schedule.costs import machine_facts
from pipetrain.training.config import TrainConfig
from pipetrain.training.distributed import train_distributed, worker
from pipetrain.training.emulated import train_emulated
from pipetrain.training.setup import prepare
from pipetrain.training.timelines import action_overhead

__all__ = ["OVERHEAD_RUN", "calibrate", "measure_overhead", "worker_bytes"]

#: the run whose timeline gives the interpreter's time per action: small, so the gaps dominate
OVERHEAD_RUN = dict(model="mlp:depth=2,width=16", data="synthetic:features=16,classes=4,samples=256",
                    batch_size=32, microbatches=4, schedule="1f1b", balance=[2, 1], steps=40)


def calibrate(device: str = "cpu", ranks: int = 2, optimizer: str = "sgd:lr=0.01,momentum=0.9",
              sizes: tuple[int, ...] | None = None, timeout: float = 120.0) -> tuple[dict, Any]:
    """The costs file's object, and the transport's figures (None with one rank). ``ranks`` 2 on a
    machine with fewer GPUs than that (``device="cuda"``) falls back to one rank, saying why."""
    why = "asked for"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("calibrating on cuda: CUDA is not available here; calibrate on the cpu")
        if ranks == 2 and torch.cuda.device_count() < 2:
            ranks, why = 1, f"{torch.cuda.device_count()} GPU here (NCCL needs a GPU per rank)"
    if ranks == 2:
        figures, worker = _measure_transport(device, sizes, optimizer, timeout)
    else:
        figures, worker = None, measure_overhead(device, distributed=False)
    return _costs_file(device, optimizer, figures, worker, None if ranks == 2 else why), figures


def _measure_transport(device: str, sizes: tuple[int, ...] | None, optimizer: str, timeout: float):
    """The transport's figures and :func:`measure_overhead`'s, from one start of two workers (on
    a GPU the overhead's run, over gloo as training's runtime sends, is started on its own)."""

    cuda = device == "cuda"
    result = launch(_worker, (device, tuple(sizes or SIZES), optimizer, timeout, not cuda),
                    2, threads_per_worker=1, timeout=timeout, quiet=True)
    if result.returncode != 0 or result.results[0] is None:
        raise LaunchError(f"the calibration's workers failed ({result.message or f'exit status {result.returncode}'})")
    figures, measured = result.results[0]
    return figures, measure_overhead(device) if measured is None else measured


def _worker(device: str, sizes: tuple[int, ...], optimizer: str, timeout: float, overhead: bool):
    """One of the two calibration workers: (``overhead``) the short training run of
    :data:`OVERHEAD_RUN`, first, so that its memory holds what a fresh worker adds on first use
    (the transport's connections and buffers), then the transport in the same process group;
    rank 0 returns both."""

    measured = None
    if overhead:
        result = worker(TrainConfig(**OVERHEAD_RUN, quiet=True, progress=False, seed=0, timeout=timeout))
        if result is not None and result.timeline is not None:  # rank 0's
            measured = action_overhead(result.timeline), worker_bytes(result)
    figures = measure_transport(device, sizes, optimizer, timeout)
    return None if figures is None else (figures, measured)


def worker_bytes(result: Any) -> int | None:
    """What a worker of the small run added above its start beyond the memory model's prediction
    (the libraries' and transport's first-use buffers): the median over its stages."""
    stages = (result.extra.get("memory") or {}).get("stages") or []
    extra = [s["peak_bytes"] - s["start_bytes"] - s.get("predicted_bytes", 0) for s in stages
             if s.get("peak_bytes") is not None and s.get("start_bytes") is not None]
    return max(int(statistics.median(extra)), 0) if extra else None


def measure_overhead(device: str = "cpu", distributed: bool = True) -> tuple[float, int | None]:
    """The interpreter's time per action, from a short run of :data:`OVERHEAD_RUN` on the runtime
    (``distributed``) or the emulator: the median gap between consecutive actions; and the memory a
    worker adds whatever the model (:func:`worker_bytes`)."""

    config = TrainConfig(**OVERHEAD_RUN, executor="distributed" if distributed else "emulate", device=device,
                         quiet=True, progress=False, seed=0)
    result = train_distributed(config) if distributed else train_emulated(prepare(config))
    if result is None or result.timeline is None:
        raise ConfigError("the calibration's short training run returned no timeline")
    return action_overhead(result.timeline), worker_bytes(result)


def _costs_file(device: str, optimizer: str, figures: Any, worker: tuple[float, int | None],
                one_rank: str | None) -> dict:
    """The JSON object: scalar costs (seconds, bytes) and where they were measured; ``worker``: the
    interpreter's time per action and a worker's own memory (:func:`measure_overhead`)."""

    data: dict = {}
    if figures is not None:
        costs = figures.costs()
        if math.isinf(costs["bandwidth"]):
            del costs["bandwidth"]  # no time per byte left in flight: the default, unlimited
        data.update(costs)
        transport = figures.transport
    else:
        data["step_per_byte"] = measure_step(optimizer, "cuda" if device == "cuda" else "cpu").slope
        transport = "none"
    data["overhead"], memory = worker
    if memory is not None:
        data["worker_bytes"] = memory
    about: dict = {**machine_facts(), "transport": transport, "device": device, "optimizer": optimizer}
    if one_rank is not None:
        about["note"] = (f"one rank ({one_rank}): no transport measured; compute-only costs (communication "
                         "charged nothing)")
    data["measured_on"] = about
    return data
