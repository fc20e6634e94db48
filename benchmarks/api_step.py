"""The per-step entry against fit: a user's own loop feeding `Pipeline.step` one batch at a time
must train as fast as `Pipeline.fit` reading the same data itself.

Both train PipeDream on the overhead-bound configuration of ``vs_torch_pipelining.py`` (MLP of 8
hidden layers of width 256, minibatches of 32, one SGD update per minibatch, 2 workers pinned one
core and one thread each) on the same two in-memory tensors, in the same order:

* ``fit``   ``pipe.fit(TensorDataset(x, y), batch_size=32, steps=N, shuffle=False)``;
* ``step``  ``pipe.start(...)``, then a loop of ``pipe.step(x[i:i + 32], y[i:i + 32])`` (the rank of
  stage 0 slices the batch, the other passes nothing), then ``pipe.finish()``.

Each contender is this script run again as a user's script (``python benchmarks/api_step.py
--contender fit``), which starts its own 2 workers through the Python API. The rate is taken from
the last stage's update times after the warm-up updates, the same way for both. Rounds alternate
the order (A B, B A, ...); the ratio step/fit is taken within each round, and the median reported.

Usage::

    python benchmarks/api_step.py [--rounds 6] [--steps 20] [--warmup 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def contender(name: str, steps: int, warmup: int, out: str) -> None:
    """One training run as a user's script would write it (runs on every worker)."""
    sys.path.insert(0, HERE)
    import torch
    from torch.utils.data import TensorDataset

    from pipetrain import Pipeline
    from vs_torch_pipelining import CONFIGS, build_model, make_batch

    cfg = CONFIGS["overhead-bound"]
    x, y = make_batch(cfg)
    model = build_model(cfg)
    size = cfg.microbatch
    updates = (warmup + steps) * cfg.microbatches
    pipe = Pipeline(model, balance=[2 * (cfg.hidden // 2), 2 * (cfg.hidden - cfg.hidden // 2) + 1],
                    schedule="pipedream", optimizer=torch.optim.SGD, optimizer_options=dict(lr=cfg.lr), timeout=600)
    if name == "fit":
        result = pipe.fit(TensorDataset(x, y), batch_size=size, steps=updates, shuffle=False, progress=False)
    else:
        pipe.start(steps=updates, batch_size=size)
        feeds = pipe.reads_data
        for update in range(updates):
            start = update * size % cfg.batch
            if feeds:
                pipe.step(x[start:start + size], y[start:start + size])
            else:
                pipe.step()
        result = pipe.finish()
    if pipe.is_main:
        times = result.extra["update_seconds"]
        skip = warmup * cfg.microbatches
        rate = (len(times) - skip) * size / (times[-1] - times[skip - 1])
        with open(out, "w") as handle:
            json.dump({"samples_per_s": rate}, handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="timed passes over the 1024-sample batch")
    parser.add_argument("--warmup", type=int, default=3, help="untimed passes first")
    parser.add_argument("--contender", choices=["fit", "step"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        contender(args.contender, args.steps, args.warmup, args.out)
        return
    print(f"machine: {os.cpu_count()} CPUs; 2 workers, each pinned to its own core, 1 thread")
    rates: dict[str, list[float]] = {"fit": [], "step": []}
    ratios = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            order = ["fit", "step"] if index % 2 == 0 else ["step", "fit"]
            got = {}
            for name in order:
                out = os.path.join(scratch, f"{name}-{index}.json")
                command = [sys.executable, os.path.abspath(__file__), "--contender", name, "--out", out,
                           "--steps", str(args.steps), "--warmup", str(args.warmup)]
                subprocess.run(command, check=True)
                with open(out) as handle:
                    got[name] = json.load(handle)["samples_per_s"]
                rates[name].append(got[name])
            ratios.append(got["step"] / got["fit"])
            print(f"round {index + 1}: fit {got['fit']:8.0f}  step {got['step']:8.0f} samples/s  "
                  f"step/fit {ratios[-1]:.3f}", flush=True)
    print(f"\nmedian of {args.rounds} rounds: fit {statistics.median(rates['fit']):.0f}, "
          f"step {statistics.median(rates['step']):.0f} samples/s; step/fit {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
