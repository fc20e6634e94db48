"""Does the simulator predict the runtime? Simulated against measured time per update and memory,
per schedule and configuration (issue 36's validation grid).

    PYTHONPATH=src python benchmarks/simulator_grid.py                       # the whole grid, 3 runs a cell
    PYTHONPATH=src python benchmarks/simulator_grid.py --quick               # one run a cell, fewer steps
    PYTHONPATH=src python benchmarks/simulator_grid.py --configs overhead-bound --schedules 1f1b,gpipe

First ``pipetrain calibrate`` measures this machine (or ``--costs-file`` names a calibration). Then
every cell, a schedule on a configuration, is ``pipetrain train`` on the distributed runtime (one
process per rank, each pinned to its core with one thread by pipetrain's launcher) with that
calibration and ``--report-json``; cells run in rounds, the order reversed on odd rounds, and
each figure is the median over the rounds:

* ``measured`` and ``simulated``: the report's ``measured_seconds_per_update`` (the median gap
  between the last stage's update ends after the first fifth of the run) and
  ``simulated_seconds_per_update`` (the run's own schedule and cut, its measured unit times, the
  calibration's messages, overhead and quantum); ``ratio`` = measured / simulated; a cell misses
  the goal when the ratio is outside 1 +- 15 %;
* ``mem MB``: per rank, the worker's peak RSS above its start (``peak_bytes - start_bytes``)
  against ``predicted_bytes`` (gradient sums, optimizer state, weight versions, activations in
  flight, and the calibration's ``worker_bytes``); the worst rank's ratio is shown.

Then, per configuration, ``pipetrain profile`` of the model and ``pipetrain plan --schedule auto
--costs-file`` over the configuration's workers and microbatches: its top choice (among the
grid's schedules), measured in the grid, against the best measured cell (goal: within 5 %).

Configurations (2 workers unless said): ``compute-bound`` 8 x Linear 1024, microbatch 128, m = 8;
``overhead-bound`` 8 x Linear 256, microbatch 32, m = 32; ``four-stage`` 8 x Linear 512, microbatch
64, m = 8 on 4 workers (on a 2-core machine two workers share each core, which the simulator does
not model: expect that cell to miss and say so). Runs wait, up to ``--wait`` seconds, for the
1-minute load average to fall below ``--max-load``; the load at every run is printed.
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
import time

CONFIGS = {
    "compute-bound": dict(model="mlp:depth=8,width=1024", features=1024, microbatch=128, m=8, workers=2, steps=16),
    "overhead-bound": dict(model="mlp:depth=8,width=256", features=256, microbatch=32, m=32, workers=2, steps=40),
    "four-stage": dict(model="mlp:depth=8,width=512", features=512, microbatch=64, m=8, workers=4, steps=16),
}
#: the issue's schedules, then the newer ones
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "pipedream", "2bw", "zb-h2", "zb-v", "dualpipev", "bfs",
             "interleaved-zb")
#: schedules whose ranks hold two stages each: their --stages names the ranks
CHUNKED = {"interleaved", "zb-v", "dualpipev", "bfs", "interleaved-zb", "v-half", "v-min"}
GOAL_TIME, GOAL_MEMORY, GOAL_AUTO = 0.15, 0.15, 0.05


def _wait_for_quiet(max_load: float, wait: float) -> float:
    deadline = time.time() + wait
    while os.getloadavg()[0] > max_load and time.time() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipetrain.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def _train(config: dict, schedule: str, costs: str, tmp: str, steps: int) -> dict:
    report = os.path.join(tmp, f"report-{schedule}.json")
    if os.path.exists(report):
        os.remove(report)
    batch = config["microbatch"] * config["m"]
    ranks = config["workers"]
    args = ["train", "--model", config["model"],
            "--data", f"synthetic:features={config['features']},classes=10,samples={batch * 4}",
            "--batch-size", str(batch), "--microbatches", str(config["m"]), "--schedule", schedule,
            "--stages", str(ranks), "--steps", str(steps), "--costs-file", costs, "--report-json", report,
            "--quiet", "--no-progress", "--eval-samples", "64"]
    done = _cli(*args)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1][:160]}
    data = json.loads(open(report, encoding="utf-8").read())
    memory = []
    for stage in data.get("memory", {}).get("stages", []):
        if stage.get("peak_bytes") is not None and stage.get("predicted_bytes"):
            memory.append((stage["peak_bytes"] - stage["start_bytes"], stage["predicted_bytes"]))
    return {"measured": data.get("measured_seconds_per_update"), "simulated": data.get("simulated_seconds_per_update"),
            "memory": memory}


def _plan_choice(config: dict, costs: str, tmp: str, schedules: list[str]) -> str | None:
    """``pipetrain plan --schedule auto`` on a profile of the configuration's model, restricted to
    its workers and microbatches; None where the plan cannot be made."""
    profile = os.path.join(tmp, "profile.json")
    batch = config["microbatch"] * config["m"]
    done = _cli("profile", "--model", config["model"], "--data",
                f"synthetic:features={config['features']},classes=10,samples={batch}", "--batch-size", str(batch),
                "--out", profile, "--no-progress")
    if done.returncode != 0:
        return None
    done = _cli("plan", profile, "--workers", str(config["workers"]), "--schedule", "auto", "--microbatches",
                str(config["m"]), "--costs-file", costs, "--straight", "--no-baselines", "--json")
    if done.returncode != 0:
        return None
    plan = json.loads(done.stdout)
    tried = [c for c in plan.get("schedule_candidates", []) if c.get("fits") and c["schedule"] in schedules]
    if not tried:
        return None
    return min(tried, key=lambda c: c["simulated_time_per_minibatch"])["schedule"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="one round, half the steps")
    parser.add_argument("--costs-file", default=None, help="a calibration (default: measured first)")
    parser.add_argument("--max-load", type=float, default=1.5)
    parser.add_argument("--wait", type=float, default=60.0)
    parser.add_argument("--json", default=None, metavar="FILE", help="write every run's figures here")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    schedules = [s for s in args.schedules.split(",") if s]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    repeats = 1 if args.quick else args.repeats
    print(f"machine: {platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}")
    tmp = tempfile.mkdtemp(prefix="simgrid-")
    costs = args.costs_file
    if costs is None:
        costs = os.path.join(tmp, "calibration.json")
        done = _cli("calibrate", "--out", costs)
        if done.returncode != 0:
            print(done.stderr)
            return 1
        print(done.stdout.strip().splitlines()[-2])
    runs: dict[tuple[str, str], list[dict]] = {}
    for round_ in range(repeats):
        order = [(c, s) for c in configs for s in schedules]
        for config_name, schedule in (order if round_ % 2 == 0 else order[::-1]):
            config = CONFIGS[config_name]
            steps = max(4, config["steps"] // 2) if args.quick else config["steps"]
            load = _wait_for_quiet(args.max_load, args.wait)
            result = _train(config, schedule, costs, tmp, steps)
            result["load"] = load
            runs.setdefault((config_name, schedule), []).append(result)
            shown = result.get("error") or (f"{result['measured']:.4f} s measured, {result['simulated']:.4f} s "
                                            f"simulated" if result["measured"] and result["simulated"] else "no figures")
            print(f"  round {round_ + 1} {config_name:14s} {schedule:15s} load {load:4.2f}: {shown}", flush=True)
    print()
    header = f"{'configuration':15s} {'schedule':15s} {'measured s':>11s} {'simulated s':>12s} {'ratio':>6s}  " \
             f"{'mem MB meas/pred (worst rank)':>30s}  verdict"
    print(header)
    cells = {}
    for (config_name, schedule), results in runs.items():
        good = [r for r in results if r.get("measured") and r.get("simulated")]
        if not good:
            print(f"{config_name:15s} {schedule:15s} {results[0].get('error', 'no figures')}")
            continue
        measured = statistics.median(r["measured"] for r in good)
        simulated = statistics.median(r["simulated"] for r in good)
        ratio = measured / simulated
        worst = None
        for r in good:
            for used, predicted in r["memory"]:
                off = used / predicted
                if worst is None or abs(off - 1) > abs(worst[2] - 1):
                    worst = (used, predicted, off)
        cells[(config_name, schedule)] = measured
        time_ok = abs(ratio - 1) <= GOAL_TIME
        mem_ok = worst is not None and abs(worst[2] - 1) <= GOAL_MEMORY
        memory = f"{worst[0] / 1e6:7.1f} / {worst[1] / 1e6:7.1f} ({worst[2]:.2f}x)" if worst else "-"
        verdict = "ok" if time_ok and mem_ok else ("time misses" if not time_ok else "") + \
            (" memory misses" if not mem_ok else "")
        print(f"{config_name:15s} {schedule:15s} {measured:11.4f} {simulated:12.4f} {ratio:6.2f}  {memory:>30s}  "
              f"{verdict.strip()}")
    print()
    for config_name in configs:
        measured = {s: cells[(config_name, s)] for s in schedules if (config_name, s) in cells}
        if not measured:
            continue
        best = min(measured, key=measured.get)
        choice = _plan_choice(CONFIGS[config_name], costs, tmp, list(measured))
        if choice is None:
            print(f"{config_name}: plan --schedule auto made no choice among the measured schedules")
            continue
        off = measured[choice] / measured[best] - 1
        print(f"{config_name}: plan --schedule auto chose {choice} ({measured[choice]:.4f} s measured); the best "
              f"measured is {best} ({measured[best]:.4f} s): {off * 100:+.1f} % "
              + ("(within 5 %)" if off <= GOAL_AUTO else "(misses 5 %)"))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({f"{c}/{s}": r for (c, s), r in runs.items()}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
