"""`pipetrain calibrate`: measure this machine's communication and per-action costs for the simulator.

Examples::

    pipetrain calibrate                          # gloo between 2 pinned CPU workers -> calibration.json
    pipetrain calibrate --device cuda --out gpu.json
    pipetrain train ... --costs-file calibration.json --report-json report.json
    pipetrain schedule --schedule 1f1b --stages 4 --costs-file calibration.json

What is measured and how: :mod:`pipetrain.training.calibration`. With one rank (``--ranks 1``,
or one GPU for ``--device cuda``) no transport can be measured: the file holds the overhead and
the optimizer step, says so in ``measured_on``, and the simulator charges no communication.
"""

from __future__ import annotations

import argparse

from pipetrain.commands._text import aligned, number_list
from pipetrain.errors import ConfigError

__all__ = ["add_arguments", "run", "HELP", "format_figures"]

# Imports inside functions are deliberate here: PyTorch and the library load when the command runs, so
# that `pipetrain --help` and the checks of options and output paths answer without them.

HELP = "measure message, all-reduce, optimizer-step and per-action costs here (a costs file for the simulator)"


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

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available here; use --device cpu")
    from pipetrain.training.calibration import calibrate

    data, figures = calibrate(args.device, args.ranks, args.optimizer, args.sizes, args.timeout)
    from pipetrain.training.result import write_json_atomic

    write_json_atomic(args.out, data)
    if args.json:
        import json

        print(json.dumps(data))
        return 0
    if figures is None:
        why = "one rank (--ranks 1)" if args.ranks == 1 else data["measured_on"]["note"].split(":")[0]
        print(f"{why}: no transport to measure; wrote compute-only costs (overhead "
              f"{data['overhead'] * 1e6:.1f} us per action, optimizer step {data['step_per_byte'] * 1e9:.3f} ns per "
              "parameter byte): the simulator charges no communication with them")
    else:
        print(format_figures(figures, data))
    print(f"wrote {args.out}")
    return 0


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
