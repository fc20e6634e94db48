"""Runs of any length in flat memory: peak RSS per worker and start-up time against ``--steps``.

The run: PipeDream on 2 workers, a tiny MLP (2 hidden layers of width 16) on synthetic data,
batches of 4 samples, one update per batch, for 1,000 and for 100,000 updates (``--steps``). Each
run is ``pipetrain train`` in a process of its own (which spawns the 2 workers, one core and one
thread each), and is measured from the outside:

* peak RSS per worker: the largest peak resident set size of the spawned workers
  (``getrusage(RUSAGE_CHILDREN)`` of the launching process once they ended); the launcher's own
  peak (it prepares the run too, to check it before any worker starts) is printed beside it, and
  each worker's own (``getrusage(RUSAGE_SELF)`` as it ends, printed by the probe in
  ``benchmarks/rss_probe``), to see which rank reaches the peak;
* start-up and wind-down: the command's wall time less the training time the report gives
  (``seconds``: from the start barrier to the last action): importing, preparing the run (the
  schedule of every update), joining, then gathering and writing the results. The schedule-building
  part alone is printed too: :func:`pipetrain.training.prepare` timed in a fresh process.

``--src`` names one or more source trees (comma-separated, e.g. main's and a branch's) measured
side by side; rounds alternate their order (A B, B A, ...).

Usage::

    python benchmarks/long_run.py [--steps 1000,100000] [--rounds 1] [--src SRC1,SRC2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
PROBE = os.path.join(HERE, "rss_probe")  # each process's own peak as it ends (its sitecustomize)
OPTIONS = ["--schedule", "pipedream", "--stages", "2", "--model", "mlp:depth=2,width=16",
           "--data", "synthetic:features=8,classes=2,samples=256", "--batch-size", "4", "--no-progress",
           "--quiet", "--timeout", "120"]

_TRAIN = """
import json, resource, sys, time
started = time.perf_counter()
from pipetrain.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
wall = time.perf_counter() - started
children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print("LONGRUN " + json.dumps({"code": code, "wall": wall, "worker_kb": children, "launcher_kb": me}))
"""

_PREPARE = """
import sys, time
from pipetrain.training import TrainConfig, prepare
config = TrainConfig(schedule="pipedream", stages=2, model="mlp:depth=2,width=16",
                     data="synthetic:features=8,classes=2,samples=256", batch_size=4, steps=int(sys.argv[1]),
                     progress=False, quiet=True)
started = time.perf_counter()
run = prepare(config)
run.messages
print("PREPARE", time.perf_counter() - started)
"""


def _env(src: str) -> dict[str, str]:
    path = os.pathsep.join([src, PROBE] + ([os.environ["PYTHONPATH"]] if "PYTHONPATH" in os.environ else []))
    return dict(os.environ, PYTHONPATH=path, PIPETRAIN_RSS_PROBE="1")


def measure(src: str, steps: int) -> dict:
    """One run of ``steps`` updates with the sources at ``src``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        out = subprocess.run([sys.executable, "-c", _TRAIN, "train", *OPTIONS, "--steps", str(steps),
                              "--report-json", report], env=_env(src), capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("LONGRUN ")), None)
        if line is None or not os.path.exists(report):
            raise SystemExit(f"the run of {steps} steps failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
        result = json.loads(line[len("LONGRUN "):])
        probed = [json.loads(l[len("RSSPROBE "):]) for l in out.stderr.splitlines() if l.startswith("RSSPROBE ")]
        result["rank_kb"] = {p["rank"]: p["peak_kb"] for p in probed if p["rank"] is not None}
        with open(report) as handle:
            result["train"] = json.load(handle)["seconds"]
    prepared = subprocess.run([sys.executable, "-c", _PREPARE, str(steps)], env=_env(src), capture_output=True,
                              text=True, check=True)
    result["prepare"] = float(prepared.stdout.split()[-1])
    result["overhead"] = result["wall"] - result["train"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", default="1000,100000")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--src", default=SRC, help="source trees to compare, comma-separated")
    args = parser.parse_args()
    sources = args.src.split(",")
    counts = [int(n) for n in args.steps.split(",")]
    found: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        order = sources if round_ % 2 == 0 else sources[::-1]
        for steps in counts:
            for src in order:
                started = time.perf_counter()
                result = measure(src, steps)
                found.setdefault((src, steps), []).append(result)
                ranks = ", ".join(f"rank {r} {kb / 1024:.0f}" for r, kb in sorted(result["rank_kb"].items()))
                print(f"round {round_ + 1} {src} --steps {steps}: peak RSS per worker {result['worker_kb'] / 1024:.0f} MB "
                      f"({ranks}; launcher {result['launcher_kb'] / 1024:.0f} MB), wall {result['wall']:.1f} s, training "
                      f"{result['train']:.1f} s, start-up and wind-down {result['overhead']:.1f} s, prepare "
                      f"{result['prepare']:.2f} s ({time.perf_counter() - started:.0f} s in all)", flush=True)
    for src in sources:
        rss = {steps: statistics.median(r["worker_kb"] for r in found[(src, steps)]) / 1024 for steps in counts}
        overhead = {steps: statistics.median(r["overhead"] for r in found[(src, steps)]) for steps in counts}
        prepare = {steps: statistics.median(r["prepare"] for r in found[(src, steps)]) for steps in counts}
        first, last = counts[0], counts[-1]
        print(f"{src}: peak RSS per worker " + ", ".join(f"{rss[n]:.0f} MB at {n:,}" for n in counts)
              + f" ({(rss[last] / rss[first] - 1) * 100:+.1f} %); start-up and wind-down "
              + ", ".join(f"{overhead[n]:.1f} s" for n in counts) + "; prepare "
              + ", ".join(f"{prepare[n]:.2f} s" for n in counts))


if __name__ == "__main__":
    main()
