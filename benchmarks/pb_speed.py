"""Speed of per-sample Pipelined Backpropagation against plain batch-size-1 SGD, same process.

Model: resmlp (width 64, GroupNorm, GELU) with depth+2 units, or any ``--model`` spec (e.g. the
convolutional study's ResNet-20, ``resnet-gn:widths=16/32/64,depth=3,units=conv,zero_init=true``),
one thread, float32, digits samples. Measured, each as samples per second (median of --repeats
interleaved runs):

* ``sgd-torch``   plain batch-1 momentum SGD: ``model(x)``, autograd, ``torch.optim.SGD``
* ``pb-ref``      the reference PB (``pipetrain.pb.pb_sequential``, autograd per stage)
* ``pb``          the batched engine, one run, S stages (one unit per stage when S = units)
* ``pb+sc+lwp``   the same with Spike Compensation and Linear Weight Prediction
* ``sgd-engine``  the batched engine with S = 1 (plain batch-1 SGD through the same kernels)
* ``pb xR``       R independent runs in one engine (samples of all runs per second)

Rates are per second of this process's CPU time (``time.process_time``), which stays meaningful
when other processes share the cores; wall-clock rates are printed beside them.

    PYTHONPATH=src python benchmarks/pb_speed.py [--depth 30] [--stages 32] [--samples 3000]
    PYTHONPATH=src python benchmarks/pb_speed.py --model resnet-gn:widths=16/32/64,depth=3,units=conv
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

from pipetrain.data import load_dataset
from pipetrain.models import build_model
from pipetrain.optim import build_stage_optimizers
from pipetrain.pb import pb_sequential
from pipetrain.pb.engine import BatchedPB
from pipetrain.schedule import pb_delays
from pipetrain.stages import split_model

LR, MOMENTUM = 1e-4, 0.997


class Clock:
    """CPU and wall time of a measured section."""

    def __enter__(self) -> "Clock":
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu = time.process_time() - self.cpu
        self.wall = time.perf_counter() - self.wall


def sgd_torch(spec: str, x: torch.Tensor, y: torch.Tensor, order: torch.Tensor) -> float:
    model = build_model(spec, input_shape=(64,), num_classes=10, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = nn.CrossEntropyLoss()
    with Clock() as clock:
        for i in order.tolist():
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x[i : i + 1]), y[i : i + 1]).backward()
            opt.step()
    return len(order) / clock.cpu, len(order) / clock.wall


def pb_reference(spec: str, stages: int, x, y, order) -> float:
    model = build_model(spec, input_shape=(64,), num_classes=10, seed=0)
    staged = split_model(model, stages=stages)
    opts = build_stage_optimizers(f"sgd:lr={LR},momentum={MOMENTUM}", pb_delays(stages))
    samples = [(x[i : i + 1], y[i : i + 1]) for i in order.tolist()]
    with Clock() as clock:
        pb_sequential(staged.stages, opts, samples)
    return len(order) / clock.cpu, len(order) / clock.wall


def engine(spec: str, stages: int, runs: int, compensation: str, x, y, order) -> float:
    run_stages, optimizers = [], []
    for r in range(runs):
        model = build_model(spec, input_shape=(64,), num_classes=10, seed=r)
        run_stages.append(split_model(model, stages=stages).stages)
        optimizers.append(
            build_stage_optimizers(
                f"sgd:lr={LR},momentum={MOMENTUM}", pb_delays(stages), compensation=compensation,
                lr_schedule=f"end:total={len(order)},fraction=0.2",
            )
        )
    pb = BatchedPB(run_stages, optimizers, sample_shape=(64,))
    indices = order.view(-1, 1).expand(-1, runs).contiguous()
    with Clock() as clock:
        pb.train(x, y, indices)
    return runs * len(order) / clock.cpu, runs * len(order) / clock.wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=30, help="resmlp's residual blocks (units = depth + 2)")
    parser.add_argument("--model", default="", help="another model spec instead of resmlp:depth=DEPTH,width=64")
    parser.add_argument("--stages", type=int, default=0, help="pipeline stages (default: one per unit)")
    parser.add_argument("--samples", type=int, default=3000, help="samples per measurement")
    parser.add_argument("--runs", type=int, default=16, help="runs for the stacked measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-reference", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    data = load_dataset("digits")
    x, y = data.features, data.labels
    spec = args.model or f"resmlp:depth={args.depth},width=64"
    units = len(build_model(spec, input_shape=(64,), num_classes=10, seed=0))
    args.stages = args.stages or units
    order = torch.randint(0, len(x), (args.samples,), generator=torch.Generator().manual_seed(0))
    short = order[: max(200, args.samples // 10)]
    measures = {
        "sgd-torch": lambda: sgd_torch(spec, x, y, order),
        "pb": lambda: engine(spec, args.stages, 1, "none", x, y, order),
        "pb+sc+lwp": lambda: engine(spec, args.stages, 1, "sc+lwp", x, y, order),
        "sgd-engine": lambda: engine(spec, 1, 1, "none", x, y, order),
        f"pb x{args.runs}": lambda: engine(spec, args.stages, args.runs, "none", x, y, short),
    }
    if not args.skip_reference:
        measures["pb-ref"] = lambda: pb_reference(spec, args.stages, x, y, short)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in measures}
    for _ in range(args.repeats):
        for name, measure in measures.items():
            results[name].append(measure())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"model {spec} ({units} units), S = {args.stages}, {args.samples} samples, "
          f"float32, 1 thread; torch {torch.__version__}, Python {platform.python_version()}, "
          f"{platform.machine()}, load average {load:.2f}")
    base = statistics.median(v[0] for v in results["sgd-torch"])
    print(f"{'measure':<14} {'samples/s':>10} {'x sgd-torch':>12} {'paired x':>9} {'wall samples/s':>15}   (median of "
          f"{args.repeats}; per CPU second; paired: median of each round's ratio to that round's sgd-torch)")
    for name, values in results.items():
        cpu = statistics.median(v[0] for v in values)
        wall = statistics.median(v[1] for v in values)
        paired = statistics.median(v[0] / b[0] for v, b in zip(values, results["sgd-torch"]))
        print(f"{name:<14} {cpu:>10.0f} {cpu / base:>12.2f} {paired:>9.2f} {wall:>15.0f}   "
              + ", ".join(f"{v[0]:.0f}" for v in values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
