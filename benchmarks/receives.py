"""Receives posted on demand against posted ahead, schedule by schedule, and what ``--receives auto`` picks.

    PYTHONPATH=src python benchmarks/receives.py                       # every flushing and async schedule
    PYTHONPATH=src python benchmarks/receives.py --schedules zb-h1,1f1b --rounds 5 --config compute-bound

Each schedule trains one of the simulator grid's configurations at 2 workers
(benchmarks/simulator_grid.py): ``overhead-bound`` (the default: ``mlp:depth=8,width=256`` on 256
synthetic features, 32 microbatches of 32 samples, 40 updates) or ``compute-bound``
(``mlp:depth=8,width=1024``, 8 microbatches of 128, 16 updates), with ``--receives on-demand`` and ``--receives ahead`` in turn, ``--rounds`` times, then
once with ``--receives auto`` to read which mode it chose (the report's ``receives``). Printed per
schedule: the median measured seconds per update of each mode, the median of the per-round ratios
ahead / on-demand (below 1: ahead is faster), the rounds ahead won, and auto's pick.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

SCHEDULES = ("1f1b", "gpipe", "interleaved", "bfs", "zb-h1", "zb-h2", "interleaved-zb", "zb-v", "v-half",
             "dualpipev", "pipedream", "2bw")
CONFIGS = {"overhead-bound": dict(width=256, microbatch=32, m=32, steps=40),
           "compute-bound": dict(width=1024, microbatch=128, m=8, steps=16)}


def _run(schedule: str, receives: str, tmp: str, config: dict) -> tuple[float, list[str]]:
    """``(measured seconds per update, each rank's receive mode)`` of one run."""
    report = os.path.join(tmp, f"{schedule}-{receives}.json")
    batch, width = config["microbatch"] * config["m"], config["width"]
    subprocess.run([sys.executable, "-m", "pipetrain.cli", "train", "--model", f"mlp:depth=8,width={width}",
                    "--data", f"synthetic:features={width},classes=10,samples={batch * 4}", "--batch-size", str(batch),
                    "--microbatches", str(config["m"]), "--schedule", schedule, "--stages", "2",
                    "--steps", str(config["steps"]),
                    "--receives", receives, "--report-json", report, "--quiet", "--no-progress",
                    "--eval-samples", "64"], cwd=tmp, check=True, capture_output=True)
    with open(report, encoding="utf-8") as f:
        data = json.load(f)
    return data["measured_seconds_per_update"], data["receives"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds per schedule (default 3)")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="overhead-bound")
    args = parser.parse_args()
    config = CONFIGS[args.config]
    print(f"# {platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{args.rounds} paired rounds, {args.config} configuration")
    print(f"{'schedule':<15} {'on-demand s':>11} {'ahead s':>9} {'ahead/on-demand':>16} {'ahead won':>10}  auto picks")
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules.split(","):
            on_demand, ahead = [], []
            for _ in range(args.rounds):
                on_demand.append(_run(schedule, "on-demand", tmp, config)[0])
                ahead.append(_run(schedule, "ahead", tmp, config)[0])
            ratios = [a / b for a, b in zip(ahead, on_demand)]
            picked = ",".join(sorted(set(_run(schedule, "auto", tmp, config)[1])))
            print(f"{schedule:<15} {statistics.median(on_demand):11.4f} {statistics.median(ahead):9.4f} "
                  f"{statistics.median(ratios):9.3f} ({min(ratios):.2f}-{max(ratios):.2f}) "
                  f"{sum(r < 1 for r in ratios):>4d} of {len(ratios)}  {picked}", flush=True)


if __name__ == "__main__":
    main()
