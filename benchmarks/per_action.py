"""Where an asynchronous schedule's time goes, action by action, against another source tree.

Runs ``pipetrain train --trace`` on the overhead-bound configuration of
`benchmarks/vs_torch_pipelining.py` (the same model, split, optimizer and data: MLP of 8 hidden
256-wide layers split 4 + 4, 2 workers, SGD, no shuffling), PipeDream by default with one update per
32-sample minibatch, once per source tree and round, in paired rounds (A B, then B A). For each
tree it prints the steady rate (``steady_samples_per_s``) of every round and its median ratio to the
first tree's rate of the same round, then, per rank and action kind, the median over the runs of
each run's median (and mean) action time, and the median gap between two actions (the runner's
own time), from the measured traces. The trees are directories holding ``src/pipetrain`` (for
example ``git archive main src benchmarks | tar -x -C /tmp/main``)::

    python benchmarks/per_action.py --trees main=/tmp/main,branch=. [--rounds 10] [--steps 600]
        [--schedule pipedream] [--out /tmp/per_action]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def train(tree: Path, schedule: str, steps: int, report: Path, trace: Path) -> float:
    """One run in ``tree``; returns its steady samples/s."""
    flushing = schedule != "pipedream"
    command = [
        sys.executable, "-m", "pipetrain.cli", "train",
        "--model", "benchmarks.vs_torch_pipelining:pipetrain_model:width=256,hidden=8,classes=10",
        "--data", "benchmarks.vs_torch_pipelining:pipetrain_data:width=256,batch=1024,classes=10",
        "--schedule", schedule, "--balance", "8,9", "--batch-size", "1024" if flushing else "32",
        "--microbatches", "32" if flushing else "1", "--steps", str(steps), "--optimizer", "sgd:lr=0.01",
        "--no-shuffle", "--workers", "2", "--eval-samples", "0", "--quiet", "--no-progress",
        "--report-json", str(report), "--trace", str(trace),
    ]
    # the tree's benchmarks/ supplies the model and data factories (ours, when it has none)
    path = os.pathsep.join([str(tree / "src"), str(tree if (tree / "benchmarks").is_dir() else ROOT)])
    subprocess.run(command, env=dict(os.environ, PYTHONPATH=path), cwd=tree, check=True, stdout=subprocess.DEVNULL)
    return float(json.loads(report.read_text())["steady_samples_per_s"])


def action_times(trace: Path) -> dict[tuple[int, str], tuple[float, float, float]]:
    """(rank, kind) -> (median, mean, median gap before) in us, after the first fifth of each rank's actions."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    ranks: dict[int, list] = defaultdict(list)
    for event in events:
        ranks[event["tid"]].append(event)
    out = {}
    for rank, actions in ranks.items():
        actions.sort(key=lambda e: e["ts"])
        durations, gaps = defaultdict(list), defaultdict(list)
        first = max(len(actions) // 5, 1)
        for before, action in zip(actions[first - 1:], actions[first:]):
            kind = re.match(r"\d*([A-Z_]+)", action["name"]).group(1)
            durations[kind].append(action["dur"])
            gaps[kind].append(action["ts"] - before["ts"] - before["dur"])
        for kind, values in durations.items():
            out[(rank, kind)] = (statistics.median(values), statistics.mean(values), statistics.median(gaps[kind]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", required=True, help="name=path,... (the first is the reference)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--schedule", default="pipedream")
    parser.add_argument("--out", default="/tmp/per_action")
    args = parser.parse_args()
    trees = [(name, Path(path).resolve()) for name, path in (item.split("=", 1) for item in args.trees.split(","))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; {args.schedule}, "
          f"{args.steps} updates, {args.rounds} paired rounds")
    rates: dict[str, list[float]] = {name: [] for name, _ in trees}
    times: dict[str, list] = {name: [] for name, _ in trees}
    for round_ in range(args.rounds):
        for name, tree in trees if round_ % 2 == 0 else trees[::-1]:
            stem = out / f"{name}-{round_}"
            rates[name].append(train(tree, args.schedule, args.steps, stem.with_suffix(".json"),
                                     stem.with_suffix(".trace.json")))
            times[name].append(action_times(stem.with_suffix(".trace.json")))
    print(f"load average at the end {os.getloadavg()[0]:.2f}\n")
    reference = trees[0][0]
    for name, _ in trees:
        ratios = [a / b for a, b in zip(rates[name], rates[reference])]
        print(f"{name:10s} median {statistics.median(rates[name]):7.0f} samples/s, / {reference} "
              f"{statistics.median(ratios):.3f}, faster in {sum(r > 1 for r in ratios)}/{len(ratios)}; rounds "
              + ", ".join(f"{r:.0f}" for r in rates[name]))
    keys = sorted({key for runs in times.values() for run in runs for key in run})
    print("\nus per action: median over runs of each run's median (mean), and of the gap before it\n")
    print("rank action  " + "".join(f"{name:>30s}" for name, _ in trees))
    for rank, kind in keys:
        cells = []
        for name, _ in trees:
            values = [run[(rank, kind)] for run in times[name] if (rank, kind) in run]
            median, mean, gap = (statistics.median(v[i] for v in values) for i in range(3))
            cells.append(f"{median:8.0f} ({mean:6.0f}) gap {gap:4.1f}")
        print(f"{rank:4d} {kind:7s}" + "".join(f"{cell:>30s}" for cell in cells))


if __name__ == "__main__":
    main()
