"""A split backward's cost (I then W) against a full backward, per quarter stage of the zero-bubble GPT.

The quarters of :mod:`benchmarks.zero_bubble`'s model (its ``full`` setup unless ``--quick``), one
microbatch each, at one thread on one core. Stage 0 is timed from its embedding's output, as
``measure_costs`` there does (in training stage 0 has no input gradient: its W is its whole backward).
Each repeat runs a fresh forward and then one of:

* ``full``: one backward from the stage's output (or loss) to inputs and weights;
* ``old``: I = ``autograd.grad`` to the inputs keeping the graph, W = a second backward from the
  output to the weights (pipetrain before issue 35);
* ``new``: :func:`pipetrain.execution.split_backward.input_half`, then its ``WeightHalf.run``.

A round runs the three once each per stage, in an order that rotates; the figures are the medians
over rounds of the per-round ratios (I + W) / full, and of ``new``'s W alone over the ideal W,
full minus ``old``'s I (a plain ``autograd.grad`` to the inputs).

Usage::

    PYTHONPATH=src python benchmarks/split_backward.py [--quick] [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zero_bubble import SETUPS, _stages, gpt, loss_fn, make_batch  # noqa: E402

from pipetrain.execution.split_backward import input_half  # noqa: E402

__all__ = ["main"]


def _once(kind: str, body, inp: torch.Tensor, target, last: bool, params: list) -> tuple[float, float]:
    """Seconds of (I, W) for ``kind`` (``full``: (backward, 0))."""
    x = inp.clone().requires_grad_(True)
    out = body(x)
    roots = [loss_fn(out, target)] if last else [out]
    grads = None if last else [torch.ones_like(out)]
    t0 = time.perf_counter()
    if kind == "full":
        torch.autograd.backward(roots, grads)
        t1 = t2 = time.perf_counter()
    elif kind == "old":
        torch.autograd.grad(roots, [x], grads, retain_graph=True)
        t1 = time.perf_counter()
        torch.autograd.backward(roots, grads, inputs=params)
        t2 = time.perf_counter()
    else:
        _, half = input_half(roots, grads, [x], params)
        t1 = time.perf_counter()
        assert half is not None, "the new path fell back on this stage"
        del roots, out
        half.run()
        t2 = time.perf_counter()
    for p in params:
        p.grad = None
    return t1 - t0, t2 - t1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny setup (a check)")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)
    setup = SETUPS["quick" if args.quick else "full"]
    quarters = _stages(gpt(setup), setup, 4)
    x, y = make_batch(setup)
    x, y = x[: setup.microbatch], y[: setup.microbatch]
    bodies = [quarters[0][1:], *quarters[1:]]
    with torch.no_grad():
        inputs = [quarters[0][0](x)]
        for body in bodies[:-1]:
            inputs.append(body(inputs[-1]))
    kinds = ("full", "old", "new")
    print(f"setup {'quick' if args.quick else 'full'}: {setup}; {args.rounds} rounds, 1 thread, pid {os.getpid()}")
    print("stage  full ms  old I+W ms  new I+W ms  old/full  new/full  new/old  newW/(full-I)")
    for s, (q, body) in enumerate(zip(quarters, bodies)):
        params = [p for p in q.parameters() if p.requires_grad]
        for kind in kinds:  # warm-up
            _once(kind, body, inputs[s], y, s == 3, params)
        samples: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
        for r in range(args.rounds):
            for kind in kinds[r % 3:] + kinds[: r % 3]:
                samples[kind].append(_once(kind, body, inputs[s], y, s == 3, params))

        def total(kind: str, r: int) -> float:
            return sum(samples[kind][r])

        rounds = range(args.rounds)
        old = statistics.median(total("old", r) / total("full", r) for r in rounds)
        new = statistics.median(total("new", r) / total("full", r) for r in rounds)
        new_old = statistics.median(total("new", r) / total("old", r) for r in rounds)
        ideal = statistics.median(samples["new"][r][1] / max(total("full", r) - samples["old"][r][0], 1e-9)
                                  for r in rounds)
        ms = {k: 1e3 * statistics.median(sum(t) for t in samples[k]) for k in kinds}
        print(f"{s:5d}  {ms['full']:7.1f}  {ms['old']:10.1f}  {ms['new']:10.1f}  {old:8.2f}  {new:8.2f}  "
              f"{new_old:7.2f}  {ideal:13.2f}")


if __name__ == "__main__":
    main()
