"""Measuring the transport a run will use: what the simulator's communication costs are here.

The timeline simulator charges a message ``send + bytes * send_per_byte`` on its sender, then
``latency + bytes / bandwidth`` in flight, then ``recv + bytes * recv_per_byte`` on its receiver
(:mod:`pipetrain.schedule.costs`). Those figures depend on the machine, the transport (gloo on
CPU, NCCL on GPU) and how workers are placed, so they are measured where the runs happen: two
ranks started by pipetrain's launcher, each pinned to one core with one thread as training
workers are, exchange messages through the runtime's own :class:`~pipetrain.runtime.p2p.Messenger`.

* **Ping-pong** over a few sizes (1 KB .. 4 MB), the receiver waiting: the one-way time is half
  the median round trip; the sender's busy time is the median time the ``isend`` call keeps it
  (packing the message, handing it to the transport: the span of a SEND action).
* **Late receives**: the sender sends at once and the receiver posts its receive 2 ms later, as a
  receive posted on demand (the runtime's usual way) often is; the median time that receive takes
  is the receiver's busy time after arrival. On gloo it is no copy alone: the data moves only once
  both sides have posted, so it holds a rendezvous between the two processes' transport threads.
  Each figure is fitted as ``a + b * bytes`` (:func:`fit_line`); what the sender and the receiver
  are busy is taken out of the one-way time and the rest is in flight: ``latency = a_oneway -
  send - recv``, ``1 / bandwidth = b_oneway - send_per_byte - recv_per_byte`` (clamped at 0 and
  infinity). A receiver already waiting when the message comes is charged the same ``recv``: an
  over-estimate where receives are posted ahead.
* **All-reduce** of a replicated stage's flat gradient over the same sizes (``sync`` +
  ``sync_per_byte``), as the runtime's SYNC runs it.
* **Optimizer step** per parameter byte (``step_per_byte``), on rank 0, with the given spec.

The interpreter's cost per action (``overhead``) needs a whole training run; ``pipetrain
calibrate`` measures it above this layer and adds it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from pipetrain.optim.spec import build_stage_optimizer
from pipetrain.runtime.launch import init_distributed
from pipetrain.runtime.p2p import Messenger

__all__ = ["SIZES", "Fit", "TransportFigures", "fit_line", "measure_transport", "measure_step"]

#: message sizes measured (bytes): 1 KB .. 4 MB
SIZES = (1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20)

#: how long the receiver of a late receive waits before posting it (seconds): the sender's
#: announcement has long arrived
LATE = 0.002


@dataclass(frozen=True)
class Fit:
    """``intercept + slope * bytes`` seconds, fitted to the medians ``points`` (bytes, seconds)."""

    intercept: float
    slope: float
    points: tuple[tuple[int, float], ...] = ()


def fit_line(points: Sequence[tuple[float, float]]) -> Fit:
    """The line through ``points`` with the least squared relative error (small messages count as
    much as large ones: a plain least-squares fit is all large messages); a negative intercept or
    slope (noise on a loaded machine) is refitted with it held at 0, so every figure is a
    non-negative time."""
    pts = [(float(x), float(y)) for x, y in points]
    kept = tuple((int(x), y) for x, y in pts)
    weights = [1.0 / (y * y) if y > 0 else 0.0 for _, y in pts]
    s0 = sum(weights)
    if s0 == 0:
        return Fit(0.0, 0.0, kept)
    s1 = sum(w * x for w, (x, _) in zip(weights, pts))
    s2 = sum(w * x * x for w, (x, _) in zip(weights, pts))
    t0 = sum(w * y for w, (_, y) in zip(weights, pts))
    t1 = sum(w * x * y for w, (x, y) in zip(weights, pts))
    det = s0 * s2 - s1 * s1
    intercept, slope = ((t0 * s2 - t1 * s1) / det, (s0 * t1 - s1 * t0) / det) if det > 0 else (t0 / s0, 0.0)
    if slope < 0:
        intercept, slope = t0 / s0, 0.0
    elif intercept < 0:
        intercept, slope = 0.0, (t1 / s2 if s2 > 0 else 0.0)
    return Fit(max(intercept, 0.0), max(slope, 0.0), kept)


@dataclass
class TransportFigures:
    """What :func:`measure_transport` found (rank 0's view; seconds and bytes)."""

    transport: str
    one_way: Fit
    sender: Fit
    receiver: Fit
    all_reduce: Fit
    step: Fit | None = None

    def costs(self) -> dict[str, float]:
        """The simulator's scalars: sender and receiver busy times, and the rest in flight."""
        latency = max(self.one_way.intercept - self.sender.intercept - self.receiver.intercept, 0.0)
        per_byte = self.one_way.slope - self.sender.slope - self.receiver.slope
        out = {
            "send": self.sender.intercept,
            "send_per_byte": self.sender.slope,
            "recv": self.receiver.intercept,
            "recv_per_byte": self.receiver.slope,
            "latency": latency,
            "bandwidth": 1.0 / per_byte if per_byte > 0 else float("inf"),
            "sync": self.all_reduce.intercept,
            "sync_per_byte": self.all_reduce.slope,
        }
        if self.step is not None:
            out["step_per_byte"] = self.step.slope
        return out


def _iterations(nbytes: int) -> int:
    """Round trips per size: many for small messages, fewer for large ones (under a second each)."""
    return max(20, min(100, (64 << 20) // max(nbytes, 1) // 4))


def measure_transport(device: str = "cpu", sizes: Sequence[int] = SIZES, optimizer: str = "sgd:lr=0.01,momentum=0.9",
                      timeout: float = 60.0) -> TransportFigures | None:
    """The worker of a 2-rank calibration (started by :func:`~pipetrain.runtime.launch.launch`):
    ping-pong, all-reduce, and on rank 0 the optimizer step. Rank 0 returns the figures, rank 1
    None."""
    cuda = device.startswith("cuda")
    env = init_distributed("nccl" if cuda else "gloo", timeout=timeout)
    where = torch.device("cuda", env.local_rank) if cuda else torch.device("cpu")
    rank, peer = env.rank, 1 - env.rank
    messenger = Messenger(timeout=timeout, device=where)
    wait_device = torch.cuda.synchronize if cuda else (lambda: None)
    wall = time.perf_counter
    one_way, sender, receiver, reduce = [], [], [], []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32, device=where)
        count = _iterations(nbytes)
        trips, sends = [], []
        for i in range(count + 3):  # the first message of a size announces it: 3 to warm up
            t0 = wall()
            if rank == 0:
                handle = messenger.isend(x, peer, "calibrate")
                sent = wall() - t0
                handle.wait()
                messenger.recv(peer, "calibrate")
            else:
                messenger.recv(peer, "calibrate")
                wait_device()
                messenger.send(x, peer, "calibrate")
            wait_device()
            if i >= 3 and rank == 0:
                trips.append(wall() - t0)
                sends.append(sent)
        # a receive of a message sent before it was posted (as receives posted on demand often are):
        # rank 0 sends at once, rank 1 posts its receive LATE seconds later and times it
        takes = []
        for i in range(min(count, 30) + 3):
            if rank == 0:
                handle = messenger.isend(x, peer, "late")
                messenger.recv(peer, "ack")
                handle.wait()
            else:
                time.sleep(LATE)
                t0 = wall()
                messenger.recv(peer, "late")
                wait_device()
                if i >= 3:
                    takes.append(wall() - t0)
                messenger.send(torch.zeros(1, device=where), peer, "ack")
        flat = torch.ones(nbytes // 4, dtype=torch.float32, device=where)
        times = []
        for i in range(min(count, 30) + 3):
            t0 = wall()
            work = dist.all_reduce(flat, async_op=True)
            messenger.guard(work, "calibration all-reduce")
            wait_device()
            if i >= 3:
                times.append(wall() - t0)
        if rank == 0:
            one_way.append((nbytes, statistics.median(trips) / 2))
            sender.append((nbytes, statistics.median(sends)))
            reduce.append((nbytes, statistics.median(times)))
        else:
            receiver.append((nbytes, statistics.median(takes)))
    taken = [None, None]
    dist.all_gather_object(taken, receiver)
    if rank != 0:
        return None
    return TransportFigures(
        transport="nccl" if cuda else "gloo",
        one_way=fit_line(one_way),
        sender=fit_line(sender),
        receiver=fit_line(taken[1]),
        all_reduce=fit_line(reduce),
        step=measure_step(optimizer, where),
    )


def measure_step(optimizer: str = "sgd:lr=0.01,momentum=0.9", device: Any = "cpu",
                 sizes: Sequence[int] = (64 << 10, 1 << 20, 4 << 20)) -> Fit:
    """Seconds of one optimizer update of a stage holding ``bytes`` of float32 parameters, fitted
    over ``sizes``: the slope is the step per parameter byte."""
    cuda = str(device).startswith("cuda")
    points = []
    for nbytes in sizes:
        params = {"weight": torch.ones(nbytes // 4, device=device)}
        grads = {"weight": torch.full_like(params["weight"], 1e-3)}
        stepper = build_stage_optimizer(optimizer)
        times = []
        for i in range(13):
            t0 = time.perf_counter()
            params = stepper.step(params, grads, i, out=params)
            if cuda:
                torch.cuda.synchronize()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        points.append((nbytes, statistics.median(times)))
    return fit_line(points)
