"""The stages' own arithmetic inside each contender: CPU time per ``StageExecutor`` call.

pipetrain's runtime and the hand loops of `vs_torch_pipelining.py` (``loop-1f1b-executors``, and
``loop-1f1b-updating`` which also updates the weights) compute through the same
``StageExecutor.forward`` and ``.backward``. This script runs them in paired rounds (alternating
order) with ``benchmarks/cpu_probe`` in every worker, which sums each call's thread CPU time, wall
time, minor page faults and involuntary context switches (the warm-up steps' calls included). Equal code costing more CPU in one
contender than in another points at what surrounds the calls there (cache, memory, threads), not
at the transport or the runner: benchmarks/RESULTS.md, section 16::

    python benchmarks/stage_cpu.py [--config overhead-bound] [--rounds 5] [--steps 40]
        [--contenders pipetrain-1f1b,loop-1f1b-executors,loop-1f1b-updating]

Per round it prints each contender's rate and, per rank, microseconds of CPU per forward and
backward; then the median over the rounds of each contender's CPU per call against the first
contender's in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from unittest import mock
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # `benchmarks` as a package from a checkout

from benchmarks.vs_torch_pipelining import CONFIGS, CONTENDERS  # noqa: E402

PROBE = HERE / "cpu_probe"  # its sitecustomize wraps StageExecutor.forward/backward in every worker
METHODS = ("forward", "backward")


def read_probe(directory: Path) -> dict[int, dict[str, dict[str, float]]]:
    """``{rank: {method: {"calls", "cpu_us", "wall_us", "faults", "switches"}}}`` per call, from the
    probe's files (processes without a RANK, such as a launcher, are left out)."""
    ranks: dict[int, dict[str, dict[str, float]]] = {}
    for path in sorted(directory.glob("*.json")):
        record = json.loads(path.read_text())
        if record["rank"] is None:
            continue
        per = ranks.setdefault(int(record["rank"]), {})
        for method, total in record["methods"].items():
            calls = total["calls"]
            per[method] = {
                "calls": calls,
                "cpu_us": total["cpu_ns"] / calls / 1e3,
                "wall_us": total["wall_ns"] / calls / 1e3,
                "faults": total["minor_faults"] / calls,
                "switches": total["involuntary_switches"] / calls,
            }
    return ranks


def probed(name: str, cfg, steps: int, warmup: int, directory: Path) -> float:
    """Run contender ``name`` with the probe in its workers; its samples/s."""
    inherited = os.environ.get("PYTHONPATH")
    path = os.pathsep.join([str(PROBE), str(HERE.parent / "src")] + ([inherited] if inherited else []))
    with mock.patch.dict(os.environ, PIPETRAIN_CPU_PROBE=str(directory), PYTHONPATH=path):
        return CONTENDERS[name][1](cfg, steps, warmup)


def ratios_to_first(rounds: list[dict[str, dict]], names: list[str]) -> dict[tuple[str, int, str], float]:
    """Per (contender, rank, method) after the first: the median over the rounds of its CPU per call
    over the first contender's in the same round."""
    out = {}
    first = names[0]
    for name in names[1:]:
        for rank in sorted(rounds[0][first]["ranks"]):
            for method in METHODS:
                values = [r[name]["ranks"][rank][method]["cpu_us"] / r[first]["ranks"][rank][method]["cpu_us"]
                          for r in rounds if method in r[name]["ranks"].get(rank, {})]
                if values:
                    out[(name, rank, method)] = statistics.median(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="overhead-bound", choices=sorted(CONFIGS))
    parser.add_argument("--contenders", default="pipetrain-1f1b,loop-1f1b-executors,loop-1f1b-updating")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run")
    args = parser.parse_args()
    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    cfg = CONFIGS[args.config]
    print(f"{args.config}: {args.rounds} paired rounds of {', '.join(names)}, {args.steps} timed steps each")
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(args.rounds):
            order = names if index % 2 == 0 else names[::-1]
            results: dict[str, dict] = {}
            for name in order:
                directory = Path(scratch) / f"{index}-{name}"
                directory.mkdir()
                rate = probed(name, cfg, args.steps, cfg.warmup, directory)
                results[name] = {"rate": rate, "ranks": read_probe(directory)}
            rounds.append(results)
            for name in names:
                cells = "  ".join(
                    f"rank {rank}: " + ", ".join(f"{m} {calls[m]['cpu_us']:.0f} us" for m in METHODS if m in calls)
                    for rank, calls in sorted(results[name]["ranks"].items())
                )
                print(f"  round {index + 1}  {name:28s} {results[name]['rate']:8.0f} samples/s  CPU per call: {cells}")
    print(f"median over the rounds of the CPU per call against {names[0]} in the same round:")
    for (name, rank, method), value in ratios_to_first(rounds, names).items():
        print(f"  {name:28s} rank {rank} {method:8s} {value:.3f}x")


if __name__ == "__main__":
    main()
