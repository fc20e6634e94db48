"""Generate, validate and simulate every schedule at S=64 stages and m=1024 microbatches.

Times the whole `pipetrain schedule NAME --stages 64 --microbatches 1024 --json` command (process
start, import, generation, validation, dry run, simulation, JSON output) and, in-process, each
phase. Goal: under 2 s per schedule for the whole command.

    python benchmarks/schedules.py [--stages 64] [--microbatches 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw", "pb"]


def command_seconds(name: str, stages: int, microbatches: int, repeat: int) -> float:
    argv = [sys.executable, "-m", "pipetrain.cli", "schedule", name, "--stages", str(stages),
            "--microbatches", str(microbatches), "--json"]
    if name == "interleaved":
        argv += ["--chunks", "2"]
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return min(times)


def phases(name: str, stages: int, microbatches: int) -> dict[str, float]:
    from pipetrain.schedule import Costs, build, problems, simulate
    from pipetrain.schedule.summary import summarize

    start = time.perf_counter()
    schedule = build(name, stages, microbatches, chunks=2 if name == "interleaved" else 1)
    built = time.perf_counter()
    assert not problems(schedule)
    checked = time.perf_counter()
    timeline = simulate(schedule, Costs(F=1, B=2, W=1))
    simulated = time.perf_counter()
    summarize(timeline)
    summarized = time.perf_counter()
    return {
        "actions": sum(len(p) for p in schedule.programs),
        "build": built - start,
        "validate": checked - built,
        "simulate": simulated - checked,
        "summarize": summarized - simulated,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {platform.python_version()}")
    print(f"S={args.stages}, m={args.microbatches} (interleaved: 2 chunks per rank)")
    print(f"{'schedule':<12} {'actions':>9} {'build':>7} {'validate':>9} {'simulate':>9} {'summary':>8} {'command':>8}")
    worst = 0.0
    for name in SCHEDULES:
        times = phases(name, args.stages, args.microbatches)
        whole = command_seconds(name, args.stages, args.microbatches, args.repeat)
        worst = max(worst, whole)
        print(f"{name:<12} {times['actions']:>9} {times['build']:>6.2f}s {times['validate']:>8.2f}s "
              f"{times['simulate']:>8.2f}s {times['summarize']:>7.2f}s {whole:>7.2f}s")
    print(f"slowest whole command: {worst:.2f} s (goal: under 2 s)")


if __name__ == "__main__":
    main()
