"""Predicted against measured: profile, plan and train real models, stage times side by side.

    PYTHONPATH=src python benchmarks/planner_vs_measured.py                 # all cases, 3 runs
    PYTHONPATH=src python benchmarks/planner_vs_measured.py --cases mlp --repeats 1   # quick

For each case: ``pipetrain profile`` ``--repeats`` times (one process, 1 thread, per-layer medians
over ``--iterations``), combined into one profile by the per-layer median over the runs;
``pipetrain plan`` of it; then, ``--repeats`` times, the stage modules timed in this process and
``pipetrain train --plan`` on the emulator (every stage in one process, one action after the
other) and on the distributed runtime (one process per stage replica over gloo, 1 thread each),
both with ``--report-json`` and ``--trace``. Per stage, medians over the repetitions,
milliseconds per minibatch:

* ``plan``: the plan's ``compute_s`` (forward + backward of the stage's layers, one worker, one
  minibatch: the sum of the profile's per-layer times);
* ``module``: the stage cut from the model, timed in this process as one module (forward +
  backward, 1 thread, median of ``--iterations``); ``module cpu``: the same in thread CPU time
  (what the stage costs when no other process takes the core); ``module/m``: wall time on
  microbatches of batch / m samples, times m (only when the schedule uses m > 1 microbatches);
* ``emulate`` and ``distrib``: the stage's forward and backward actions in the trace of the
  emulator and of the distributed run: the median action times the actions per minibatch on one
  replica (microbatches / replicas), so ``distrib`` compares with ``plan time`` without
  communication, and ``distrib x r`` with ``plan``;
* ``STEP``: the optimizer update, same scaling (not in the profile); ``SYNC`` (replicated plans):
  the all-reduce among a stage's replicas;
* ``plan time``: the plan's ``time_s`` (per minibatch of the pipeline: replicas, all-reduce and
  the cost model's communication);
* ``busy``: the distributed report's ``stage_busy_seconds`` (all F, B and STEP actions, not
  medians) / steps, mean over the stage's replicas;
* ``xfer`` / ``send``: the plan's input transfer (2 bytes / bandwidth of the cut in front of the
  stage) against SEND_F + SEND_B actions per minibatch of the stage that sends across that cut;
* for the whole run: the distributed steady-state time per minibatch (the slope of the last
  stage's STEP end times over the last three quarters of the run) against
  ``predicted_time_per_minibatch`` (with the flush bubble for 1f1b / gpipe / zb-h1), and the
  report's seconds / steps (start, fill and drain included).

Runs wait (up to ``--wait`` seconds) for the 1-minute load average to fall below ``--max-load``;
the machine is shared, so the load at every run is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Case:
    name: str
    model: str
    data: str
    batch_size: int
    plan_args: list[str]
    steps: int = 48
    profile: str = ""       # name of the case whose profile this one reuses ("" = its own)
    note: str = ""


CASES = [
    Case("mlp", "mlp:depth=8,width=512", "digits", 256, ["--workers", "2", "--straight"],
         note="PipeDream schedule (1 minibatch per unit)"),
    Case("mlp-1f1b", "mlp:depth=8,width=512", "digits", 256,
         ["--workers", "2", "--straight", "--schedule", "1f1b", "--microbatches", "4"],
         profile="mlp", note="same cut, 1F1B with 4 microbatches of 64"),
    Case("resnet", "resnet-gn:channels=32", "digits", 128, ["--workers", "2", "--straight"],
         note="PipeDream schedule"),
    Case("resnet-3w", "resnet-gn:channels=32", "digits", 128, ["--workers", "3"],
         profile="resnet", note="3 workers, replication allowed (3 processes on 2 cores)"),
]


# --------------------------------------------------------------------------- running commands

def pipetrain_command() -> list[str]:
    return [sys.executable, "-m", "pipetrain.cli"]


def env() -> dict[str, str]:
    out = dict(os.environ)
    src = str(ROOT / "src")
    out["PYTHONPATH"] = src + (os.pathsep + out["PYTHONPATH"] if out.get("PYTHONPATH") else "")
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def shown(args: list[str]) -> str:
    return "pipetrain " + " ".join(shlex.quote(a) for a in args)


def run_pipetrain(args: list[str], tries: int = 3) -> str:
    """Run ``pipetrain ARGS``; retry a run that failed (e.g. a worker aborting at exit)."""
    last = ""
    for attempt in range(tries):
        done = subprocess.run(pipetrain_command() + args, cwd=ROOT, env=env(), text=True,
                              capture_output=True, check=False)
        if done.returncode == 0:
            return done.stdout
        last = (done.stdout + done.stderr).strip().splitlines()[-1:] or [""]
        last = last[0]
        print(f"    (attempt {attempt + 1} failed, exit {done.returncode}: {last})", flush=True)
    raise SystemExit(f"{shown(args)} failed {tries} times: {last}")


def wait_for_quiet(max_load: float, wait: float) -> float:
    """Sleep until the 1-minute load average is below ``max_load`` (at most ``wait`` s)."""
    deadline = time.monotonic() + wait
    while os.getloadavg()[0] >= max_load and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


# --------------------------------------------------------------------------- measurements

_KIND = re.compile(r"^(\d+)([A-Z_]+)")


def trace_actions(path: Path) -> dict[int, dict[str, list[float]]]:
    """Measured action durations (seconds) per rank and kind, from a ``--trace`` file."""
    data = json.loads(path.read_text())
    measured = {e["pid"] for e in data["traceEvents"]
                if e["ph"] == "M" and e["name"] == "process_name"
                and "measured" in e["args"]["name"]}
    out: dict[int, dict[str, list[float]]] = {}
    stage_of: dict[int, int] = {}
    for event in data["traceEvents"]:
        if event["ph"] != "X" or event["pid"] not in measured:
            continue
        match = _KIND.match(event["name"])
        if not match:
            continue
        rank = event["tid"]
        stage_of[rank] = int(event["args"]["stage"])
        out.setdefault(rank, {}).setdefault(match.group(2), []).append(event["dur"] * 1e-6)
    for rank, kinds in out.items():
        kinds["_stage"] = [float(stage_of[rank])]
    return out


def per_minibatch(kinds: dict[str, list[float]], steps: int, *names: str) -> float:
    """Median action time times the actions per minibatch, summed over ``names``."""
    total = 0.0
    for name in names:
        values = kinds.get(name, [])
        if values:
            total += statistics.median(values) * len(values) / steps
    return total


def stage_figures(report: dict, actions: dict, stages: int) -> list[dict[str, float]]:
    """Per stage (mean over its replicas): F+B, STEP, sends and busy time per minibatch."""
    steps = report["steps"]
    rows: list[dict[str, list[float]]] = [{} for _ in range(stages)]
    for rank, kinds in actions.items():
        row = rows[int(kinds["_stage"][0])]
        row.setdefault("fb", []).append(per_minibatch(kinds, steps, "F", "B", "I", "W"))
        row.setdefault("step", []).append(per_minibatch(kinds, steps, "STEP"))
        row.setdefault("sync", []).append(per_minibatch(kinds, steps, "SYNC"))
        row.setdefault("send_f", []).append(per_minibatch(kinds, steps, "SEND_F"))
        row.setdefault("send_b", []).append(per_minibatch(kinds, steps, "SEND_B"))
        row.setdefault("busy", []).append(report["stage_busy_seconds"][rank] / steps)
    out = [{key: statistics.fmean(v) for key, v in row.items()} for row in rows]
    for s, row in enumerate(out):       # the cut in front of stage s: activations, gradients
        row["send"] = (out[s - 1]["send_f"] + row["send_b"]) if s else 0.0
    return out


def steady_seconds(path: Path, report: dict, last_stage: int) -> float:
    """Time per minibatch from the last stage's STEP end times, last three quarters of the run."""
    data = json.loads(path.read_text())
    measured = {e["pid"] for e in data["traceEvents"]
                if e["ph"] == "M" and e["name"] == "process_name"
                and "measured" in e["args"]["name"]}
    ends = sorted((e["ts"] + e["dur"]) * 1e-6 for e in data["traceEvents"]
                  if e["ph"] == "X" and e["pid"] in measured and e["args"]["stage"] == last_stage
                  and _KIND.match(e["name"]).group(2) == "STEP")
    if len(ends) < 4:
        return report["seconds"] / report["steps"]
    first = len(ends) // 4
    per_event = (ends[-1] - ends[first]) / (len(ends) - 1 - first)
    return per_event * len(ends) / report["steps"]


def time_stages_in_process(case: Case, balance: list[int], iterations: int,
                           microbatches: int = 1) -> tuple[list[float], list[float]]:
    """Forward + backward of each stage module in this process (1 thread), median wall and thread
    CPU seconds per minibatch; with ``microbatches`` > 1, on batch / m samples, times m."""
    import torch

    from pipetrain.data import dataset_info, get_batch, load_dataset
    from pipetrain.models import build_model
    from pipetrain.stages import split_model
    from pipetrain.stages.staged import call_stage

    torch.set_num_threads(1)
    dataset = load_dataset(case.data)
    info = dataset_info(dataset)
    model = build_model(case.model, input_shape=info.input_shape, num_classes=info.num_classes,
                        seed=0)
    size = case.batch_size // microbatches
    x, y = get_batch(dataset, [i % len(dataset) for i in range(size)])
    stages = split_model(model, balance=balance).stages
    inputs = [x]
    with torch.no_grad():
        for stage in stages[:-1]:
            inputs.append(call_stage(stage, inputs[-1]))
    wall, cpu = [], []
    for s, stage in enumerate(stages):
        last = s == len(stages) - 1
        times, cpus = [], []
        for it in range(iterations + 3):
            for p in stage.parameters():
                p.grad = None
            given = inputs[s].detach().requires_grad_(s > 0)
            started, started_cpu = time.perf_counter(), time.thread_time()
            out = call_stage(stage, given)
            if last:
                torch.nn.functional.cross_entropy(out, y).backward()
            else:
                out.backward(torch.ones_like(out))
            if it >= 3:
                times.append(time.perf_counter() - started)
                cpus.append(time.thread_time() - started_cpu)
        wall.append(statistics.median(times) * microbatches)
        cpu.append(statistics.median(cpus) * microbatches)
    return wall, cpu


# --------------------------------------------------------------------------- one case

@dataclass
class Outcome:
    case: Case
    plan: dict
    module: list[list[float]] = field(default_factory=list)        # per repeat, per stage
    module_cpu: list[list[float]] = field(default_factory=list)
    module_micro: list[list[float]] = field(default_factory=list)
    profile_totals: list[float] = field(default_factory=list)
    emulated: list[list[dict[str, float]]] = field(default_factory=list)
    runs: list[tuple[dict, list[dict[str, float]], float]] = field(default_factory=list)
    loads: list[float] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)


def profile_command(case: Case, path: Path, iterations: int) -> list[str]:
    return ["profile", "--model", case.model, "--data", case.data, "--batch-size",
            str(case.batch_size), "--iterations", str(iterations), "--warmup", "5",
            "--threads", "1", "--out", str(path), "--no-progress"]


def median_profile(case: Case, workdir: Path, args: argparse.Namespace,
                   commands: list[str]) -> tuple[Path, list[float]]:
    """``pipetrain profile`` ``--repeats`` times; the per-layer median of the runs, written."""
    from pipetrain.plan.profile_files import load_profile, save_profile

    runs = []
    for repeat in range(args.repeats):
        path = workdir / f"{case.name}-profile-{repeat}.json"
        cmd = profile_command(case, path, args.iterations)
        load = wait_for_quiet(args.max_load, args.wait)
        print(f"  [{case.name}] profile {repeat + 1}/{args.repeats}, load {load:.1f}: "
              f"{shown(cmd)}", flush=True)
        run_pipetrain(cmd)
        if repeat == 0:
            commands.append(shown(cmd) + f"  (x{args.repeats}, per-layer median)")
        runs.append(load_profile(path))
    combined = runs[0]
    combined.layers = [
        replace(layer, forward_s=statistics.median(r.layers[i].forward_s for r in runs),
                backward_s=statistics.median(r.layers[i].backward_s for r in runs))
        for i, layer in enumerate(combined.layers)]
    combined.meta["combined_runs"] = len(runs)
    path = workdir / f"{case.name}-profile.json"
    save_profile(combined, path)
    return path, [r.total_compute_s for r in runs]


def run_case(case: Case, workdir: Path, args: argparse.Namespace,
             profiles: dict[str, tuple[Path, list[float]]]) -> Outcome:
    commands: list[str] = []
    if case.profile:
        profile, totals = profiles[case.profile]
    else:
        profile, totals = profiles[case.name] = median_profile(case, workdir, args, commands)
    plan_path = workdir / f"{case.name}-plan.json"
    cmd = ["plan", str(profile), *case.plan_args, "--no-baselines", "--out", str(plan_path)]
    run_pipetrain(cmd)
    commands.append(shown(cmd))
    plan = json.loads(plan_path.read_text())
    m = int(plan["microbatches"])
    outcome = Outcome(case, plan, profile_totals=totals, commands=commands)
    stages = plan["num_stages"]
    for repeat in range(args.repeats):
        wall, cpu = time_stages_in_process(case, plan["balance"], args.iterations)
        outcome.module.append(wall)
        outcome.module_cpu.append(cpu)
        if m > 1:
            outcome.module_micro.append(
                time_stages_in_process(case, plan["balance"], args.iterations, m)[0])
        for executor in ("emulate", "distributed"):
            report_path = workdir / f"{case.name}-{executor}-report-{repeat}.json"
            trace_path = workdir / f"{case.name}-{executor}-trace-{repeat}.json"
            cmd = ["train", "--model", case.model, "--data", case.data, "--batch-size",
                   str(case.batch_size), "--plan", str(plan_path), "--steps", str(case.steps),
                   "--executor", executor, "--threads-per-worker", "1", "--report-json",
                   str(report_path), "--trace", str(trace_path), "--no-progress"]
            load = wait_for_quiet(args.max_load, args.wait)
            print(f"  [{case.name}] run {repeat + 1}/{args.repeats}, load {load:.1f}: "
                  f"{shown(cmd)}", flush=True)
            run_pipetrain(cmd)
            if repeat == 0:
                outcome.commands.append(shown(cmd))
            report = json.loads(report_path.read_text())
            figures = stage_figures(report, trace_actions(trace_path), stages)
            if executor == "emulate":
                outcome.emulated.append(figures)
            else:
                outcome.loads.append(load)
                outcome.runs.append((report, figures,
                                     steady_seconds(trace_path, report, stages - 1)))
    return outcome


def print_outcome(outcome: Outcome) -> None:
    plan, case = outcome.plan, outcome.case
    ms = 1e3

    def med(key: str, s: int, runs=None) -> float:
        if runs is None:
            return statistics.median(figures[s][key] for _, figures, _ in outcome.runs)
        return statistics.median(figures[s][key] for figures in runs)

    print(f"\n== {case.name}: {case.model} on {case.data}, batch {case.batch_size}, "
          f"{case.steps} steps; {case.note}")
    for command in outcome.commands:
        print(f"   {command}")
    print(f"   plan: replicas {'-'.join(map(str, plan['replicas']))}, balance "
          f"{plan['balance']}, schedule {plan['schedule']}, {plan['microbatches']} "
          f"microbatch(es); {len(outcome.runs)} distributed run(s) at load "
          f"{', '.join(f'{x:.1f}' for x in outcome.loads)}; medians over runs; "
          "ms per minibatch")
    def over_repeats(values: list[list[float]], s: int) -> float:
        return statistics.median(v[s] for v in values)

    header = ["stage", "layers", "r", "plan", "module", "module cpu"]
    if outcome.module_micro:
        header.append("module/m")
    replicated = any(stage["replicas"] > 1 for stage in plan["stages"])
    header += ["emulate", "distrib", "STEP"] + (["SYNC"] if replicated else []) + \
        ["plan time", "busy", "busy/plan time", "xfer", "send"]
    rows = [header]
    for s, stage in enumerate(plan["stages"]):
        names = [n for n in stage["layers"] if n not in ("input", "x")]
        layers = f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]
        row = [str(s), layers, str(stage["replicas"]), f"{stage['compute_s'] * ms:.2f}",
               f"{over_repeats(outcome.module, s) * ms:.2f}",
               f"{over_repeats(outcome.module_cpu, s) * ms:.2f}"]
        if outcome.module_micro:
            row.append(f"{over_repeats(outcome.module_micro, s) * ms:.2f}")
        busy = med("busy", s)
        row += [f"{med('fb', s, outcome.emulated) * ms:.2f}", f"{med('fb', s) * ms:.2f}",
                f"{med('step', s) * ms:.2f}"]
        if replicated:
            row.append(f"{med('sync', s) * ms:.2f}")
        row += [f"{stage['time_s'] * ms:.2f}", f"{busy * ms:.2f}",
                f"{busy / stage['time_s']:.2f}", f"{stage['input_transfer_s'] * ms:.3f}",
                f"{med('send', s) * ms:.3f}" if s else "-"]
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("   " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)))
    steady = statistics.median(seconds for _, _, seconds in outcome.runs)
    whole = statistics.median(report["seconds"] / report["steps"] for report, _, _ in outcome.runs)
    predicted = plan["predicted_time_per_minibatch"]
    label = f"{predicted * ms:.2f} ms"
    if plan["schedule"] in ("1f1b", "gpipe", "zb-h1"):
        label = (f"{plan['time_per_minibatch_with_bubble'] * ms:.2f} ms with the flush bubble "
                 f"({label} without)")
        predicted = plan["time_per_minibatch_with_bubble"]
    model = statistics.median(sum(v) for v in outcome.module)
    print(f"   whole run: steady state {steady * ms:.2f} ms per minibatch vs predicted {label}: "
          f"ratio {steady / predicted:.2f}; report seconds / steps {whole * ms:.2f} ms")
    print(f"   whole model, one process: profile {plan['single_worker_time'] * ms:.2f} ms "
          f"(runs: {', '.join(f'{t * ms:.1f}' for t in outcome.profile_totals)}), stage modules "
          f"{model * ms:.2f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(c.name for c in CASES),
                        help="comma-separated case names: " + ", ".join(c.name for c in CASES))
    parser.add_argument("--repeats", type=int, default=3,
                        help="profiles, stage timings and training runs per case")
    parser.add_argument("--iterations", type=int, default=30,
                        help="profiling iterations (and in-process stage timings)")
    parser.add_argument("--max-load", type=float, default=2.5,
                        help="wait for the 1-minute load average to fall below this")
    parser.add_argument("--wait", type=float, default=45.0,
                        help="longest wait for a quiet machine, seconds, per run")
    parser.add_argument("--keep", help="directory for profiles, plans, reports and traces")
    args = parser.parse_args()
    chosen = [name.strip() for name in args.cases.split(",") if name.strip()]
    known = {case.name: case for case in CASES}
    unknown = [name for name in chosen if name not in known]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    cases = [known[name] for name in chosen]
    # a case reusing another's profile needs that case's profile first
    needed = [known[c.profile] for c in cases if c.profile and c.profile not in chosen]
    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, torch {torch.__version__}; load average at start "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pvm-"))
    workdir.mkdir(parents=True, exist_ok=True)
    profiles: dict[str, tuple[Path, list[float]]] = {}
    for case in needed:
        if case.name not in profiles:
            profiles[case.name] = median_profile(case, workdir, args, [])
    outcomes = []
    for case in cases:
        outcomes.append(run_case(case, workdir, args, profiles))
        print_outcome(outcomes[-1])
    print(f"\nload average at end {' '.join(f'{x:.1f}' for x in os.getloadavg())}; files in "
          f"{workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
