"""What letting stages recompute (`pipetrain plan --recompute auto`) costs the planner: solve time
of the same memory-limited plans with and without it, paired rounds (A B A B), one process.

    PYTHONPATH=src python benchmarks/plan_recompute.py [--rounds 3]

For each profile and worker count the limit is 60 % of the plan's peak without a limit, so some
stages must shed memory; the table shows both solve times, their ratio, and both plans' times.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

from pipetrain.errors import PipetrainError
from pipetrain.plan.graph import build_cuts
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.optimizer import optimize

PROFILES = Path(__file__).resolve().parents[1] / "tests" / "data" / "pipedream-profiles"
CASES = [("vgg16", 16, "pipedream"), ("resnet50", 16, "pipedream"), ("vgg16", 64, "gpipe"), ("vgg16", 256, "1f1b"),
         ("resnet50", 1024, "pipedream")]


def _solve(cuts, workers, schedule, limit, recompute):
    started = time.perf_counter()
    try:
        plan = optimize(cuts, workers, memory_limit=limit, schedule=schedule,
                        microbatches=1 if schedule == "pipedream" else 8, recompute=recompute)
        result = plan.predicted_time_per_minibatch, sum(s.recompute for s in plan.stages)
    except PipetrainError:
        result = float("inf"), 0
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for name, workers, schedule in CASES:
        cuts = build_cuts(parse_graph_txt((PROFILES / f"{name}.txt").read_text()))
        free = optimize(cuts, workers, schedule=schedule, microbatches=1 if schedule == "pipedream" else 8)
        limit = 0.6 * max(s.memory_bytes for s in free.stages)
        times = {False: [], True: []}
        results = {}
        for _ in range(args.rounds):
            for recompute in (False, True):
                seconds, results[recompute] = _solve(cuts, workers, schedule, limit, recompute)
                times[recompute].append(seconds)
        plain, again = (statistics.median(times[r]) for r in (False, True))
        print(f"{name:<11} {workers:>5} workers {schedule:<9} limit {limit / 1e9:7.3f} GB: solve {plain:7.3f} s "
              f"kept, {again:7.3f} s may recompute ({again / plain:5.2f}x); plan time "
              f"{results[False][0]:.6f} s kept, {results[True][0]:.6f} s with {results[True][1]} stage(s) "
              "recomputing")


if __name__ == "__main__":
    main()
