"""The ceiling that the stage split sets: each stage's compute alone on a core, against the model's.

`vs_torch_pipelining.py` compares every pipeline with 2R, twice the sequential rate. A 2-stage
pipeline can only reach it if the two stages cost the same and cutting the model costs nothing.
This script measures both on the benchmark's own model, split and batches, with no pipeline and no
communication. Each is timed alone on one core with one thread:

* the whole model as the ``sequential`` contender trains it: forward, loss and backward of each
  microbatch and an SGD step per batch (its time per microbatch is 1/R);
* each stage through :class:`~pipetrain.execution.StageExecutor`, as the runtime computes it,
  with its SGD update per batch as 1F1B and GPipe make it;
* with ``--update``, each stage with an update after every microbatch instead, as PipeDream makes
  one per minibatch (out of place on stage 0, whose stashed version is still read, in place on
  stage 1, as their 2-stage programs allow);
* with ``--nonfinite``, each stage with an update per microbatch also with ``nonfinite="skip"``
  (its gradient tested at every update) and without any test for NaN and infinite values
  (``nonfinite="off"``): what the default tests (``stop``) and those of ``skip`` cost where updates
  are most frequent, as ratios within each round.

The pipeline's rate is bounded by its slower stage, so 1/max(stage) is the most any runtime can
reach on this split, before any message or bubble. The script prints that ceiling as a fraction of
2R and of 2R·m/(m+1). The measurements run in rounds, each measurement once per round, and every
ratio is taken within a round and then its median over the rounds, because the machine's speed
drifts between rounds::

    python benchmarks/stage_costs.py [--configs overhead-bound,compute-bound] [--rounds 9] [--update]
        [--nonfinite] [--first N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` as a package from a checkout

from benchmarks.vs_torch_pipelining import (  # noqa: E402
    CONFIGS, Config, build_model, make_batch, sequential_step, split_model,
)
from pipetrain.execution.stage import StageExecutor  # noqa: E402
from pipetrain.optim import build_stage_optimizer  # noqa: E402


def _whole(cfg: Config) -> Callable[[int], None]:
    """The sequential contender's training, called per microbatch: a batch's step runs at its last
    microbatch (every measurement times whole batches, so the time per microbatch is 1/R)."""
    step = sequential_step(cfg)

    def run(k: int) -> None:
        if k % cfg.microbatches == cfg.microbatches - 1:
            step()

    return run


def _stage(cfg: Config, index: int, every: int, first: int | None = None,
           nonfinite: str = "stop") -> Callable[[int], None]:
    """One microbatch of stage ``index`` through a StageExecutor, as the runtime computes it, with
    an SGD update after every ``every`` microbatches: the batch (1F1B, GPipe) or each microbatch
    (PipeDream). The last stage computes the loss; the first receives its output's gradient."""
    stages = split_model(build_model(cfg), cfg, first)
    module, last = stages[index], index == 1
    optimizer = build_stage_optimizer(f"sgd:lr={cfg.lr}")
    executor = StageExecutor(index, module, optimizer, loss_fn=F.cross_entropy if last else None, policy="stash",
                             nonfinite=nonfinite)
    x, y = make_batch(cfg)
    with torch.no_grad():
        inputs = stages[0](x) if last else x
    xs, ys = inputs.split(cfg.microbatch), y.split(cfg.microbatch)
    grad = torch.ones(cfg.microbatch, cfg.width) / cfg.batch

    def run(k: int) -> None:
        part = k % cfg.microbatches
        version = executor.versions.current
        executor.forward(k, version, xs[part], target=ys[part] if last else None,
                         loss_scale=1 / cfg.microbatches, samples=cfg.microbatch)
        executor.backward(k, version, None if last else (grad,))
        if (k + 1) % every:
            return
        # as the schedules' programs release versions (see version_release_points): PipeDream's
        # stage 0 still reads the version before for its next backward, so it updates out of
        # place; every other update replaces a version that nothing reads any more, in place
        if every == 1 and not last:
            executor.step()
            executor.release(version)
        else:
            executor.step([version])

    run.executor = executor  # type: ignore[attr-defined]  # for the tests
    return run


def _per_microbatch(run: Callable[[int], None], count: int, start: int) -> float:
    began = time.perf_counter()
    for k in range(start, start + count):
        run(k)
    return (time.perf_counter() - began) / count


def measure(cfg: Config, rounds: int, update: bool, first: int | None = None,
            nonfinite: bool = False) -> dict[str, list[float]]:
    """Seconds per microbatch of the whole model and of each stage, one figure per round
    (``+update``: PipeDream's update after every microbatch; ``+update unchecked``: the same without
    the non-finite tests); ``first`` hidden layers on stage 0."""
    m = cfg.microbatches
    runs = {"whole": _whole(cfg), "stage 0": _stage(cfg, 0, m, first), "stage 1": _stage(cfg, 1, m, first)}
    for stage in (0, 1) if update or nonfinite else ():
        runs[f"stage {stage}+update"] = _stage(cfg, stage, 1, first)
        if nonfinite:  # next to its checked twin: neighbours share the machine's state of the moment
            runs[f"stage {stage}+update skip"] = _stage(cfg, stage, 1, first, "skip")
            runs[f"stage {stage}+update unchecked"] = _stage(cfg, stage, 1, first, "off")
    for run in runs.values():  # warm-up: allocator, autograd, first calls, one update at least
        _per_microbatch(run, m, 0)
    per_batch = max(1, round(0.3 / (m * _per_microbatch(runs["whole"], m, 0))))
    count = per_batch * m  # whole batches (each with its update), about 0.3 s per measurement
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(rounds):
        order = list(runs) if round_ % 2 == 0 else list(reversed(runs))
        for name in order:
            times[name].append(_per_microbatch(runs[name], count, (round_ + 2) * count))
    return times


def ceilings(times: dict[str, list[float]], suffix: str = "") -> list[float]:
    """Per round: the slower stage's rate over 2R, (1/max(stage)) / (2/whole)."""
    return [whole / (2 * max(s0, s1))
            for whole, s0, s1 in zip(times["whole"], times["stage 0" + suffix], times["stage 1" + suffix])]


def report(name: str, cfg: Config, times: dict[str, list[float]], first: int | None = None) -> None:
    """Medians of the times, and of the ratios taken within each round: the machine drifts between
    rounds, and neighbouring measurements share its speed."""
    def median_us(key: str) -> float:
        return statistics.median(times[key]) * 1e6

    def median_ratio(num: list[float], den: list[float]) -> float:
        return statistics.median(a / b for a, b in zip(num, den))

    m, rounds = cfg.microbatches, len(times["whole"])
    first = cfg.hidden // 2 if first is None else first
    together = [a + b for a, b in zip(times["stage 0"], times["stage 1"])]
    ceiling = statistics.median(ceilings(times))
    print(f"\n{name}: width {cfg.width}, microbatch {cfg.microbatch}, m = {m}, {first} of {cfg.hidden} hidden "
          f"layers on stage 0; medians of {rounds} rounds, microseconds per microbatch")
    print(f"  whole model (1/R)            {median_us('whole'):9.0f}")
    print(f"  stage 0                      {median_us('stage 0'):9.0f}")
    print(f"  stage 1                      {median_us('stage 1'):9.0f}   "
          f"{median_ratio(times['stage 1'], times['stage 0']):.2f}x stage 0")
    print(f"  stages together              {statistics.median(together) * 1e6:9.0f}   "
          f"{median_ratio(together, times['whole']):.2f}x the whole model")
    print(f"  ceiling of any 2-stage pipeline on this split: {ceiling:.2f} of 2R, "
          f"{ceiling * (m + 1) / m:.2f} of 2R·m/(m+1)")
    if "stage 0+update" in times:
        print(f"  with an update per microbatch (PipeDream): stage 0 {median_us('stage 0+update'):.0f}, "
              f"stage 1 {median_us('stage 1+update'):.0f}; "
              f"ceiling {statistics.median(ceilings(times, '+update')):.2f} of 2R")
    if "stage 0+update unchecked" in times:
        for stage in (0, 1):
            unchecked = times[f"stage {stage}+update unchecked"]
            for mode, key in (("stop", f"stage {stage}+update"), ("skip", f"stage {stage}+update skip")):
                ratios = sorted(a / b for a, b in zip(times[key], unchecked))
                quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                print(f"  stage {stage}, an update per microbatch, non-finite tests of {mode} against none: "
                      f"{statistics.median(ratios):.3f}x the time (quartiles {quartiles[0]:.3f}-{quartiles[2]:.3f}; "
                      f"{median_us(key):.0f} against {median_us(f'stage {stage}+update unchecked'):.0f} us)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="overhead-bound,compute-bound")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--update", action="store_true", help="also time PipeDream's update per microbatch")
    parser.add_argument("--nonfinite", action="store_true",
                        help="also time the updates per microbatch without the non-finite tests")
    parser.add_argument("--first", type=int, default=None,
                        help="hidden layers on stage 0 (default: half, the split of vs_torch_pipelining.py)")
    parser.add_argument("--core", type=int, default=os.cpu_count() - 1, help="the core to run on")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    print(f"machine: {os.cpu_count()} CPUs; alone on core {args.core}, 1 thread, no pipeline")
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        report(name, cfg, measure(cfg, args.rounds, args.update, args.first, args.nonfinite), args.first)


if __name__ == "__main__":
    main()
