"""Planner benchmark: reference predictions, solve time on large profiles, the planner at scale.

    PYTHONPATH=src python benchmarks/planner.py            # everything (a few minutes)
    PYTHONPATH=src python benchmarks/planner.py --quick    # skip the slower extra topologies
    PYTHONPATH=src python benchmarks/planner.py --scale-only --before /tmp/old/src
    PYTHONPATH=src python benchmarks/planner.py --scale-only --before /tmp/old/src --agree 600

Prints (1) PipeDream's published predictions next to ours under both cost models, (2) solve
seconds (reading excluded, best of 3) for resnet50 on 16 workers and gnmt_large on 4, against a
0.3 s budget, (3) solve seconds for a 1,000-layer chain on 1,024 workers over 3-level topologies,
against a 10 s budget (and two 2-level topologies), (4) the planner at scale: seconds per
(profile, workers, topology) for 200-layer profiles on 1,024 workers (budget 2 s) and 4,096
(budget 10 s), flat and hierarchical, each case in a fresh process (one thread), best of
``--rounds``; with ``--before SRC`` the same cases also run on another source tree (an older
pipetrain, e.g. ``git archive fdb67d3 src | tar -x -C /tmp/old``), alternating with this one
(after, before, after, ...), each before-run cut at ``--timeout`` seconds. Ratios below 1 meet the
budget. ``--agree N`` (with ``--before``) also plans N random small cases with both trees and
counts those whose plans differ.

The 200-layer profiles are synthetic and deterministic (``synthetic_chain``,
``synthetic_residual`` below) besides PipeDream's published resnet50 (177 layers, 240 cuts).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from pipetrain.plan.graph import build_cuts
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.optimizer import optimize
from pipetrain.plan.profile import LayerProfile, Profile
from pipetrain.plan.topology import Topology

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "tests" / "data" / "pipedream-profiles"

# profile, machines per level, bandwidths, straight, README replicas, README prediction (s)
REFERENCE = [
    ("vgg16", (2,), None, False, "1-1", 0.411041792),
    ("vgg16", (4,), None, False, "3-1", 0.205520896),
    ("vgg16", (8,), None, False, "7-1", 0.103833170),
    ("vgg16", (16,), None, False, "13-2-1", 0.056529767),
    ("vgg16", (4,), None, True, "1-1-1-1", 0.411041792),
    ("alexnet", (4,), None, False, "3-1", 0.034217141),
    ("gnmt", (4,), None, False, "1-1-1-1", 0.025868),
    ("vgg16", (4, 4), (10e9, 1.25e9), False, "(hierarchical)", 0.067133997),
]


def load(name: str) -> Profile:
    return parse_graph_txt((PROFILES / f"{name}.txt").read_text(), where=name)


def reference_table() -> None:
    print("== PipeDream's published predictions (README table) vs pipetrain")
    print(f"{'profile':8} {'workers':22} {'README s':>12} {'pipedream-code s':>17} "
          f"{'rel err':>8} {'replicas':>10}   {'paper s':>11} {'replicas':>9}")
    for name, machines, bws, straight, replicas, expected in REFERENCE:
        topology = Topology(machines, bws or (1e9,) * len(machines))
        code = optimize(load(name), topology, straight=straight)
        paper = optimize(load(name), topology, straight=straight, cost_model="paper")
        label = "x".join(map(str, machines)) + (" straight" if straight else "") + \
            (" @" + ",".join(f"{b:.3g}" for b in bws) if bws else "")
        err = abs(code.predicted_time_per_minibatch - expected) / expected
        print(f"{name:8} {label:22} {expected:12.9f} {code.predicted_time_per_minibatch:17.9f} "
              f"{err:8.1e} {'-'.join(map(str, code.replicas)):>10}   "
              f"{paper.predicted_time_per_minibatch:11.9f} "
              f"{'-'.join(map(str, paper.replicas)):>9}   (README replicas {replicas})")


def best_of(fn, repeat: int = 3) -> tuple[float, float, object]:
    """Best wall seconds, best CPU seconds of this process, last result."""
    times, cpus, result = [], [], None
    for _ in range(repeat):
        started, cpu = time.perf_counter(), time.process_time()
        result = fn()
        times.append(time.perf_counter() - started)
        cpus.append(time.process_time() - cpu)
    return min(times), min(cpus), result


def gnmt_speed() -> None:
    profile = load("gnmt_large")
    seconds, cpu, plan = best_of(lambda: optimize(profile, 4))
    print(f"gnmt_large   4 workers: {seconds:.3f} s ({cpu:.3f} s CPU), "
          f"{build_cuts(profile).num_states - 1} cut "
          f"states, predicted {plan.predicted_time_per_minibatch:.9f} s, replicas "
          f"{'-'.join(map(str, plan.replicas))}; ratio to budget {seconds / 0.3:.2f}")


def long_chain(layers: int = 1000, seed: int = 0) -> Profile:
    rng = np.random.default_rng(seed)
    return Profile([LayerProfile(f"l{i}", forward_s=float(rng.uniform(1e-3, 1e-2)) / 3,
                                 backward_s=2 * float(rng.uniform(1e-3, 1e-2)) / 3,
                                 parameter_bytes=float(rng.uniform(0, 5e7)),
                                 activation_bytes=float(rng.uniform(0, 5e6)))
                    for i in range(layers)])


def chain_speed(quick: bool) -> None:
    print("\n== 1,000-layer chain (random layers, seed 0), 1,024 workers, budget 10 s")
    profile = long_chain()
    cases = [((4, 4, 64), (10e9, 1e9, 1e8), False), ((4, 4, 64), (10e9, 1e9, 1e8), True),
             ((4, 4, 64), (100e9, 10e9, 1e9), False)]
    if not quick:
        cases += [((8, 8, 16), (10e9, 1e9, 1e8), False), ((2, 8, 64), (10e9, 1e9, 1e8), False),
                  ((16, 64), (10e9, 1e8), False), ((8, 128), (10e9, 1e8), False)]
    for machines, bws, fewer in cases:
        topology = Topology(machines, bws)
        cpu = time.process_time()
        plan = optimize(profile, topology, fewer_machines=fewer)
        cpu = time.process_time() - cpu
        print(f"topology {'x'.join(map(str, machines)):8} @ {','.join(f'{b:.3g}' for b in bws):14}"
              f"{' fewer-machines' if fewer else '':15}: solve {plan.solve_seconds:6.2f} s "
              f"({cpu:5.2f} s CPU), "
              f"predicted {plan.predicted_time_per_minibatch * 1e3:.4f} ms "
              f"(compute / 1024 = {profile.total_compute_s / 1024 * 1e3:.4f} ms), "
              f"{len(plan.stages)} stages; ratio to budget {plan.solve_seconds / 10:.2f}")


def synthetic_chain(layers: int = 200, seed: int = 0) -> Profile:
    """A chain like ``long_chain``: forward 1-10 ms / 3, backward twice that, 0-50 MB of
    parameters and 0-5 MB of activations per layer (uniform, numpy seed ``seed``)."""
    return long_chain(layers, seed)


def synthetic_residual(layers: int = 200, seed: int = 0) -> Profile:
    """A residual network of ``layers`` layers (rounded up to blocks of 3): per block two layers
    (forward 1-10 ms / 3, backward twice that, 0-20 MB of parameters, 0.1-5 MB of activations)
    and an add of 20 us that also takes the block's input; an input layer in front."""
    rng = np.random.default_rng(seed)
    out, edges, before = [LayerProfile("input", input=True)], [], "input"
    for block in range((layers + 2) // 3):
        a, b, add = f"b{block}a", f"b{block}b", f"b{block}add"
        for name in (a, b):
            out.append(LayerProfile(name, forward_s=float(rng.uniform(1e-3, 1e-2)) / 3,
                                    backward_s=2 * float(rng.uniform(1e-3, 1e-2)) / 3,
                                    parameter_bytes=float(rng.uniform(0, 2e7)),
                                    activation_bytes=float(rng.uniform(1e5, 5e6))))
        out.append(LayerProfile(add, forward_s=1e-5, backward_s=1e-5,
                                activation_bytes=float(rng.uniform(1e5, 5e6))))
        edges += [(before, a), (a, b), (b, add), (before, add)]
        before = add
    return Profile(out, edges=edges)


# profile, machines per level, bandwidths, options, budget (s)
SCALE = [
    (name, machines, bandwidths, options, budget)
    for name in ("chain200", "residual200", "resnet50")
    for machines, bandwidths, budget in (((1024,), (1e9,), 2.0), ((32, 32), (10e9, 1e9), 2.0),
                                         ((4096,), (1e9,), 10.0),
                                         ((64, 64), (10e9, 1e9), 10.0))
    for options in ({},)
] + [
    ("resnet50", (1024,), (1e9,), {"cost_model": "paper"}, 2.0),
    ("resnet50", (1024,), (1e9,), {"fewer_machines": True}, 2.0),
    ("resnet50", (1024,), (1e9,), {"memory_limit": 16e9}, 2.0),
    ("resnet50", (1024,), (1e9,), {"memory_limit": 16e9, "fewer_machines": True}, 2.0),
    ("resnet50", (4096,), (1e9,), {"memory_limit": 16e9}, 10.0),
    ("chain200", (4, 16, 64), (100e9, 10e9, 1e9), {}, 10.0),
    ("vgg16", (1024,), (1e9,), {}, 2.0),
]


def scale_profile(name: str) -> Profile:
    if name == "chain200":
        return synthetic_chain()
    if name == "residual200":
        return synthetic_residual()
    return load(name)


def _child(spec: str) -> None:
    """Run one case in this process and print one JSON line (``--child``)."""
    import json

    name, machines, bandwidths, options = json.loads(spec)
    profile = scale_profile(name)
    cuts = build_cuts(profile)
    started, cpu = time.perf_counter(), time.process_time()
    plan = optimize(cuts, Topology(tuple(machines), tuple(bandwidths)), **options)
    print(json.dumps({"wall": time.perf_counter() - started, "cpu": time.process_time() - cpu,
                      "predicted": plan.predicted_time_per_minibatch,
                      "replicas": plan.replicas, "cuts": cuts.num_states}))


def _run_case(src: Path, case: tuple, timeout: float) -> dict | None:
    """One case in a fresh process on source tree ``src``; None if it ran past ``timeout``."""
    import json
    import subprocess

    name, machines, bandwidths, options, _ = case
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    spec = json.dumps([name, list(machines), list(bandwidths), options])
    try:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    if done.returncode != 0:
        raise RuntimeError(f"case {case} failed on {src}:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def scale(before: Path | None, rounds: int, timeout: float) -> None:
    if rounds < 1:
        return
    print("\n== the planner at scale: solve seconds per case, fresh process, one thread, best "
          f"of {rounds} (before: one run, cut at {timeout:.0f} s)")
    print(f"{'profile':12} {'cuts':>4} {'topology':28} {'options':36} {'after wall':>10} "
          f"{'after CPU':>9} {'before wall':>11} {'budget':>6} {'ratio':>5} {'load':>4}  plan")
    after_src = ROOT / "src"
    for case in SCALE:
        name, machines, bandwidths, options, budget = case
        results, old = [], None
        for index in range(rounds):
            results.append(_run_case(after_src, case, 10 * timeout))
            if before is not None and index == 0:
                old = _run_case(before, case, timeout)
        best = min(results, key=lambda r: r["wall"])
        label = "x".join(map(str, machines)) + " @ " + ",".join(f"{b:.3g}" for b in bandwidths)
        opts = ",".join(f"{k}={v:.3g}" if isinstance(v, float) else
                        (k if v is True else f"{k}={v}") for k, v in options.items()) or "-"
        was = "-" if before is None else (f">{timeout:.0f}" if old is None else
                                          f"{old['wall']:.2f}")
        same = "" if old is None else ("" if old["predicted"] == best["predicted"] and
                                       old["replicas"] == best["replicas"] else "  DIFFERS")
        print(f"{name:12} {best['cuts'] - 1:4} {label:28} {opts:36} {best['wall']:10.2f} "
              f"{best['cpu']:9.2f} {was:>11} {budget:6.0f} {best['wall'] / budget:5.2f} "
              f"{os.getloadavg()[0]:4.1f}  {best['predicted']:.6g} s, "
              f"{len(best['replicas'])} stages{same}", flush=True)


def _agree_child(first: int, last: int) -> None:
    """Plans of random cases ``first..last - 1`` as JSON lines (``--agree-child``)."""
    import json

    from pipetrain.errors import PipetrainError

    for seed in range(first, last):
        rng = np.random.default_rng(seed)
        if seed % 4 == 3:
            profile = synthetic_residual(int(rng.integers(3, 40)), seed)
        else:
            layers, spread = int(rng.integers(2, 40)), (1, 10, 1000)[seed % 3]
            profile = Profile([LayerProfile(
                f"l{i}", forward_s=float(rng.uniform(1e-3, 1e-3 * spread)),
                parameter_bytes=float(rng.uniform(0, 5e7)) * (rng.random() < 0.7),
                activation_bytes=float(rng.uniform(0, 5e6)),
                optimizer_bytes=float(rng.uniform(0, 5e7))) for i in range(layers)])
        machines = [(int(rng.integers(2, 300)),),
                    (int(rng.integers(1, 6)), int(rng.integers(1, 40))),
                    (2, int(rng.integers(1, 4)), int(rng.integers(1, 20)))][seed % 3]
        bandwidths = (1e10, 1e9, 1e8)[-len(machines):] if len(machines) > 1 else \
            ((1e8, 1e9, 1e10)[seed % 3],)
        fewer, straight = bool(rng.random() < 0.4), bool(rng.random() < 0.2)
        memory = None
        if len(machines) == 1 and rng.random() < 0.4:
            memory = float(rng.uniform(0.5e9, 8e9))
            fewer = fewer and machines[0] <= 40
        schedule = ("pipedream", "2bw", "1f1b")[seed % 3]
        try:
            plan = optimize(profile, Topology(machines, bandwidths),
                            cost_model=("pipedream-code", "paper")[seed % 2], straight=straight,
                            fewer_machines=fewer, memory_limit=memory, schedule=schedule,
                            microbatches=1 if schedule == "pipedream" else 4)
            result = [plan.predicted_time_per_minibatch, plan.replicas,
                      [s.layers for s in plan.stages],
                      [list(s.replicas_per_level) for s in plan.stages]]
        except PipetrainError as error:
            result = str(error)
        print(json.dumps([seed, result]), flush=True)


def agree(before: Path, cases: int) -> None:
    """Random small cases (chains and residual DAGs; 1 to 3 levels; both cost models; idle
    workers, straight pipelines, memory limits, schedules) planned by both source trees: the
    number whose plans differ in time, replicas, layers per stage, replicas per level or error."""
    import json
    import subprocess

    def plans(src: Path) -> list:
        env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS="1")
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--agree-child",
                               f"0,{cases}"], env=env, capture_output=True, text=True,
                              check=True)
        return [json.loads(line) for line in done.stdout.splitlines()]

    after, old = plans(ROOT / "src"), plans(before)
    differ = [a[0] for a, b in zip(after, old) if a != b]
    print(f"\n== {cases} random cases planned by this tree and by {before}: "
          f"{len(differ)} differ{(' (seeds ' + ', '.join(map(str, differ[:10])) + ')') if differ else ''}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--scale-only", action="store_true", help="only the planner at scale")
    parser.add_argument("--before", type=Path, help="an older source tree to run beside")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--agree", type=int, default=0, metavar="N",
                        help="with --before: plan N random small cases with both trees")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--agree-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child)
        return 0
    if args.agree_child:
        _agree_child(*map(int, args.agree_child.split(",")))
        return 0
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, numpy {np.__version__}, load average "
          f"{os.getloadavg()[0]:.1f} (wall seconds grow with load; CPU seconds much less)")
    if args.agree and args.before is not None:
        agree(args.before, args.agree)
    if args.scale_only:
        scale(args.before, args.rounds, args.timeout)
        return 0
    reference_table()
    print("\n== solve seconds on the large DAG profiles (reading excluded, best of 3), "
          "budget 0.3 s")
    profile = load("resnet50")
    seconds, cpu, plan = best_of(lambda: optimize(profile, 16))
    print(f"resnet50    16 workers: {seconds:.3f} s ({cpu:.3f} s CPU), "
          f"{build_cuts(profile).num_states - 1} cut "
          f"states, predicted {plan.predicted_time_per_minibatch:.9f} s, replicas "
          f"{'-'.join(map(str, plan.replicas))}; ratio to budget {seconds / 0.3:.2f}")
    gnmt_speed()
    chain_speed(args.quick)
    scale(args.before, args.rounds, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
