"""Emulator overhead: 1F1B (m microbatches) on an 8-layer MLP against plain PyTorch training.

Both run in this process on one thread, on the same model and batches; the emulator executes the
whole schedule (versions, messages through its mailbox, functional stage calls). Prints the time
per update of each and the ratio (goal: emulator at most 1.3x plain training).

    python benchmarks/emulator.py [--width 1024] [--batch 1024] [--microbatches 8] [--stages 2]
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch
import torch.nn as nn


def make_model(width: int, depth: int = 8, classes: int = 10) -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth)]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def plain(model, batches, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, foreach=False)
    start = time.perf_counter()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - start) / len(batches)


def emulated(model, batches, lr, stages, microbatches, schedule):
    from pipetrain import Pipeline

    pipe = Pipeline(model, executor="emulate", stages=stages, schedule=schedule, microbatches=microbatches,
                    optimizer=f"sgd:lr={lr},momentum=0.9")
    start = time.perf_counter()
    pipe.train(batches)
    return (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--updates", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    generator = torch.Generator().manual_seed(0)
    batches = [(torch.randn(args.batch, args.width, generator=generator),
                torch.randint(0, 10, (args.batch,), generator=generator)) for _ in range(args.updates)]
    base = make_model(args.width)
    plain(copy.deepcopy(base), batches[:2], 0.01)  # warm-up
    emulated(copy.deepcopy(base), batches[:2], 0.01, args.stages, args.microbatches, args.schedule)
    plain_times, emulated_times = [], []
    for _ in range(args.repeat):
        plain_times.append(plain(copy.deepcopy(base), batches, 0.01))
        emulated_times.append(emulated(copy.deepcopy(base), batches, 0.01, args.stages, args.microbatches,
                                       args.schedule))
    p, e = statistics.median(plain_times), statistics.median(emulated_times)
    print(f"machine: {platform.machine()}, torch {torch.__version__}, 1 thread")
    print(f"8 x Linear({args.width}) + ReLU, head to 10 classes; batch {args.batch}; "
          f"{args.schedule} with {args.microbatches} microbatches on {args.stages} stages")
    print(f"plain PyTorch: {1e3 * p:.1f} ms per update")
    print(f"emulator:      {1e3 * e:.1f} ms per update")
    print(f"ratio emulator / plain: {e / p:.3f} (goal <= 1.3)")


if __name__ == "__main__":
    main()
