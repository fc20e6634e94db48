"""`pipetrain calibrate`: measure this machine's communication and per-action costs for the simulator.

Examples::

    pipetrain calibrate                          # gloo between 2 pinned CPU workers -> calibration.json
    pipetrain calibrate --device cuda --out gpu.json
    pipetrain train ... --costs-file calibration.json --report-json report.json
    pipetrain schedule --schedule 1f1b --stages 4 --costs-file calibration.json

Two ranks started by pipetrain's launcher, pinned to one core each with one thread as training
workers are, measure messages, all-reduces and the optimizer step through the runtime's own code
(:mod:`pipetrain.runtime.calibrate`); then a short distributed run of a small 2-stage model on
1f1b gives the interpreter's time per action (``overhead``: the median gap between consecutive
actions of its measured timeline). With one rank (``--ranks 1``, or one GPU for ``--device
cuda``) no transport can be measured: the file holds the overhead, measured on the emulator's
interpreter, and the optimizer step, says so in ``measured_on``, and the simulator charges no
communication.
"""

from __future__ import annotations

import argparse
import math

from pipetrain.commands._text import aligned, number_list
from pipetrain.errors import ConfigError

__all__ = ["add_arguments", "run", "HELP", "measure_overhead"]

HELP = "measure message, all-reduce, optimizer-step and per-action costs here (a costs file for the simulator)"

#: the run whose timeline gives the interpreter's time per action: small, so the gaps dominate
OVERHEAD_RUN = dict(model="mlp:depth=2,width=16", data="synthetic:features=16,classes=4,samples=256",
                    batch_size=32, microbatches=4, schedule="1f1b", balance=[2, 1], steps=40)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="calibration.json", metavar="FILE",
                        help="write the costs file here (default calibration.json)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cpu: gloo between CPU workers; cuda: NCCL between GPUs 0 and 1 (default cpu)")
    parser.add_argument("--ranks", type=int, default=2, choices=[1, 2],
                        help="2: measure the transport between two workers; 1: compute-only costs "
                             "(overhead and optimizer step) (default 2)")
    parser.add_argument("--optimizer", default="sgd:lr=0.01,momentum=0.9",
                        help="the optimizer whose step per parameter byte is measured (default "
                             "sgd:lr=0.01,momentum=0.9)")
    parser.add_argument("--sizes", type=number_list(int, "1024,65536,1048576"), default=None, metavar="BYTES,...",
                        help="message sizes measured, in bytes (default 1 KB, 16 KB, 256 KB, 1 MB, 4 MB)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds the measurement may take before it is stopped (default 120)")
    parser.add_argument("--json", action="store_true", help="print the costs file's object, not the table")


def run(args: argparse.Namespace) -> int:
    from pipetrain.optim import parse_optimizer_spec
    from pipetrain.paths import JSON, check_outputs

    check_outputs(files={"--out": args.out}, formats={"--out": JSON})
    parse_optimizer_spec(args.optimizer)
    if args.sizes is not None and (len(args.sizes) < 2 or min(args.sizes) < 4):
        raise ConfigError(f"--sizes needs two or more sizes of at least 4 bytes, got {args.sizes}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be positive seconds, got {args.timeout:g}")
    import torch

    ranks, why = args.ranks, "--ranks 1"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available here; use --device cpu")
        if ranks == 2 and torch.cuda.device_count() < 2:
            ranks, why = 1, f"{torch.cuda.device_count()} GPU here (NCCL needs a GPU per rank)"
    if ranks == 2:
        figures, worker = _measure_transport(args)
    else:
        figures, worker = None, measure_overhead(args.device, distributed=False)
    data = _costs_file(args, figures, worker, None if ranks == 2 else why)
    from pipetrain.training.result import write_json_atomic

    write_json_atomic(args.out, data)
    if args.json:
        import json

        print(json.dumps(data))
        return 0
    if figures is None:
        print(f"one rank ({why}): no transport to measure; wrote compute-only costs (overhead "
              f"{worker[0] * 1e6:.1f} us per action, optimizer step {data['step_per_byte'] * 1e9:.3f} ns per "
              "parameter byte): the simulator charges no communication with them")
    else:
        print(format_figures(figures, data))
    print(f"wrote {args.out}")
    return 0


def _measure_transport(args: argparse.Namespace):
    """The transport's figures and :func:`measure_overhead`'s, from one start of two workers (on
    a GPU the overhead's run, over gloo as training's runtime sends, is started on its own)."""
    from pipetrain.runtime.calibrate import SIZES
    from pipetrain.runtime.errors import LaunchError
    from pipetrain.runtime.launch import launch

    cuda = args.device == "cuda"
    result = launch(_worker, (args.device, tuple(args.sizes or SIZES), args.optimizer, args.timeout, not cuda),
                    2, threads_per_worker=1, timeout=args.timeout, quiet=True)
    if result.returncode != 0 or result.results[0] is None:
        raise LaunchError(f"the calibration's workers failed ({result.message or f'exit status {result.returncode}'})")
    figures, measured = result.results[0]
    return figures, measure_overhead(args.device) if measured is None else measured


def _worker(device: str, sizes: tuple[int, ...], optimizer: str, timeout: float, overhead: bool):
    """One of the two calibration workers: the transport, then (``overhead``) the short training
    run of :data:`OVERHEAD_RUN` in the same process group; rank 0 returns both."""
    from pipetrain.runtime.calibrate import measure_transport

    figures = measure_transport(device, sizes, optimizer, timeout)
    measured = None
    if overhead:
        from pipetrain.training.config import TrainConfig
        from pipetrain.training.distributed import worker
        from pipetrain.training.timelines import action_overhead

        result = worker(TrainConfig(**OVERHEAD_RUN, quiet=True, progress=False, seed=0, timeout=timeout))
        if figures is None:
            return None
        measured = action_overhead(result.timeline), worker_bytes(result)
    return figures, measured


def worker_bytes(result) -> int | None:
    """What a worker of the small run added above its start beyond the memory model's prediction
    (the libraries' and transport's first-use buffers): the median over its stages."""
    import statistics

    stages = (result.extra.get("memory") or {}).get("stages") or []
    extra = [s["peak_bytes"] - s["start_bytes"] - s.get("predicted_bytes", 0) for s in stages
             if s.get("peak_bytes") is not None and s.get("start_bytes") is not None]
    return max(int(statistics.median(extra)), 0) if extra else None


def measure_overhead(device: str = "cpu", distributed: bool = True) -> tuple[float, int | None]:
    """The interpreter's time per action, from a short run of :data:`OVERHEAD_RUN` on the runtime
    (``distributed``) or the emulator: the median gap between consecutive actions; and the memory a
    worker adds whatever the model (:func:`worker_bytes`)."""
    from pipetrain.training.config import TrainConfig
    from pipetrain.training.timelines import action_overhead
    from pipetrain.training.train import train

    config = TrainConfig(**OVERHEAD_RUN, executor="distributed" if distributed else "emulate", device=device,
                         quiet=True, progress=False, seed=0)
    result = train(config)
    if result is None or result.timeline is None:
        raise ConfigError("the calibration's short training run returned no timeline")
    return action_overhead(result.timeline), worker_bytes(result)


def _costs_file(args: argparse.Namespace, figures, worker: tuple[float, int | None], one_rank: str | None) -> dict:
    """The JSON object: scalar costs (seconds, bytes) and where they were measured; ``worker``: the
    interpreter's time per action and a worker's own memory (:func:`measure_overhead`)."""
    from pipetrain.runtime.calibrate import measure_step
    from pipetrain.schedule.costs import machine_facts

    data: dict = {}
    if figures is not None:
        costs = figures.costs()
        if math.isinf(costs["bandwidth"]):
            del costs["bandwidth"]  # no time per byte left in flight: the default, unlimited
        data.update(costs)
        transport = figures.transport
    else:

        data["step_per_byte"] = measure_step(args.optimizer, "cuda" if args.device == "cuda" else "cpu").slope
        transport = "none"
    data["overhead"], memory = worker
    if memory is not None:
        data["worker_bytes"] = memory
    about: dict = {**machine_facts(), "transport": transport, "device": args.device, "optimizer": args.optimizer}
    if one_rank is not None:
        about["note"] = (f"one rank ({one_rank}): no transport measured; compute-only costs (communication "
                         "charged nothing)")
    data["measured_on"] = about
    return data


def format_figures(figures, data: dict) -> str:
    """The medians per size and the fitted scalars, as a table."""
    rows = [("bytes", "one-way us", "sender busy us", "receiver busy us", "all-reduce us")]
    for (size, one_way), (_, sent), (_, received), (_, reduced) in zip(
            figures.one_way.points, figures.sender.points, figures.receiver.points, figures.all_reduce.points):
        rows.append((f"{size}", f"{one_way * 1e6:.1f}", f"{sent * 1e6:.1f}", f"{received * 1e6:.1f}",
                     f"{reduced * 1e6:.1f}"))
    bandwidth = data.get("bandwidth")
    lines = [f"{figures.transport} between 2 workers, one core and one thread each (medians):", *aligned(rows), ""]
    lines.append(f"sender busy {data['send'] * 1e6:.1f} us + {data['send_per_byte'] * 1e9:.3f} ns/B; receiver busy "
                 f"{data['recv'] * 1e6:.1f} us + {data['recv_per_byte'] * 1e9:.3f} ns/B; in flight "
                 f"{data['latency'] * 1e6:.1f} us + bytes / "
                 + (f"{bandwidth / 1e9:.2f} GB/s" if bandwidth else "unlimited"))
    lines.append(f"all-reduce {data['sync'] * 1e6:.1f} us + {data['sync_per_byte'] * 1e9:.3f} ns/B; optimizer step "
                 f"{data['step_per_byte'] * 1e9:.3f} ns per parameter byte; interpreter {data['overhead'] * 1e6:.1f} us "
                 "per action" + (f"; a worker's own memory {data['worker_bytes'] / 1e6:.1f} MB" if "worker_bytes" in data
                                 else ""))
    return "\n".join(lines)
