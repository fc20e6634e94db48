"""Planner benchmark: reference predictions, solve time on large profiles, a 1,000-layer chain.

    PYTHONPATH=src python benchmarks/planner.py            # everything (about a minute)
    PYTHONPATH=src python benchmarks/planner.py --quick    # skip the slower extra topologies

Prints (1) PipeDream's published predictions next to ours under both cost models, (2) solve
seconds (reading excluded, best of 3) for resnet50 on 16 workers and gnmt_large on 4, against a
0.3 s budget, (3) solve seconds for a 1,000-layer chain on 1,024 workers over 3-level topologies,
against a 10 s budget (and two 2-level topologies). Ratios below 1 meet the budget.
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
from pipetrain.plan.pipedream import optimize
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, numpy {np.__version__}, load average "
          f"{os.getloadavg()[0]:.1f} (wall seconds grow with load; CPU seconds much less)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
