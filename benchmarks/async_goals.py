"""Every throughput goal of the asynchronous-speed issue from one run: ratios to the split's ceiling,
to torch.distributed.pipelining, and PipeDream against 1F1B at few microbatches per update.

The configurations are those of `vs_torch_pipelining.py` (an MLP of 8 hidden layers split 4 + 4, 2
workers pinned one core and one thread each, SGD), plus the same two at m = 2 (``-m2``: the same
microbatch, 2 per update), where a flushing schedule idles a third of the time. Each round runs,
per configuration and in alternating order:

* ``ceiling``: `stage_costs.py`'s measurement in a process of its own on one core: each stage's
  time per microbatch through the runtime's ``StageExecutor``, with its update per batch (1F1B) and
  per microbatch (PipeDream). 1/max(stage) is the most any 2-stage pipeline reaches on this split;
  times m/(m+1), the most a flushing one does;
* ``ceiling-pair``: the same with both stages timed at once, one per core, no messages: the
  ceiling on two busy cores (this VM's vCPUs slow each other down), beside the first;
* ``sequential`` (R), ``torch-gpipe``, ``torch-1f1b``, ``pipetrain-1f1b``, ``pipetrain-pipedream``.

Every ratio is taken within a round (neighbouring runs share the machine's state of the minute),
and the table gives its median over the rounds and the rounds meeting the goal. After the rounds,
one traced run of pipetrain's 1f1b and pipedream per configuration says where each rank's time
goes, per action kind (share of the rank's wall time, median action)::

    python benchmarks/async_goals.py [--configs compute-bound,overhead-bound,compute-bound-m2,overhead-bound-m2]
        [--rounds 5] [--no-trace] [--with-2bw] [--out /tmp/async_goals]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` as a package from a checkout

from benchmarks import stage_costs  # noqa: E402
from benchmarks.vs_torch_pipelining import (  # noqa: E402
    CONFIGS, CONTENDERS, Config, _run, pipetrain_config, pipetrain_rate,
)

#: the issue's m = 2 case: the same microbatch as its parent configuration, two per update
CONFIGS_M2 = {
    "compute-bound-m2": Config(width=1024, batch=256, microbatches=2, steps=12, warmup=2),
    "overhead-bound-m2": Config(width=256, batch=64, microbatches=2, steps=300, warmup=20),
}
ALL_CONFIGS = {**CONFIGS, **CONFIGS_M2}

CONTENDER_NAMES = ["sequential", "torch-gpipe", "torch-1f1b", "pipetrain-1f1b", "pipetrain-pipedream"]
#: beside the goals, not part of them: PipeDream-2BW (one update per batch, as 1F1B, and no flush)
EXTRA_NAMES = ["pipetrain-2bw"]

#: (label, configurations, ratio name, at least)
GOALS = [
    ("pipetrain 1f1b / the split's 1F1B ceiling", ("compute-bound",), "1f1b/ceiling", 0.95),
    ("pipetrain 1f1b / the split's 1F1B ceiling", ("overhead-bound",), "1f1b/ceiling", 0.90),
    ("pipetrain 1f1b / torch's best schedule", ("compute-bound", "overhead-bound"), "1f1b/torch", 1.0),
    ("pipetrain pipedream / the split's PipeDream ceiling", ("compute-bound", "overhead-bound"), "pd/ceiling", 0.90),
    ("pipetrain pipedream / pipetrain 1f1b, m = 2", ("compute-bound-m2", "overhead-bound-m2"), "pd/1f1b", 1.3),
    ("pipetrain pipedream / torch's best schedule, m = 2", ("compute-bound-m2", "overhead-bound-m2"), "pd/torch", 1.3),
]


def _ceiling_worker(cfg: Config) -> dict[str, float]:
    """Seconds per microbatch of the whole model and of each stage (with and without PipeDream's
    update per microbatch), one round of `stage_costs.measure`, on this worker's one core."""
    times = stage_costs.measure(cfg, rounds=1, update=True)
    return {name: values[0] for name, values in times.items()}


def ceiling_rates(cfg: Config) -> dict[str, float]:
    """samples/s: the split's 1F1B ceiling (1/max(stage) * m/(m+1)) and PipeDream's (1/max(stage+update))."""
    m, b = cfg.microbatches, cfg.microbatch
    rates = {}
    for suffix, worker, nprocs in (("", _ceiling_worker, 1), ("-pair", _pair_ceiling_worker, 2)):
        t = _run(worker, cfg, nprocs=nprocs, convert=dict)
        rates[f"ceiling-1f1b{suffix}"] = b / max(t["stage 0"], t["stage 1"]) * m / (m + 1)
        rates[f"ceiling-pipedream{suffix}"] = b / max(t["stage 0+update"], t["stage 1+update"])
    return rates


def _pair_ceiling_worker(cfg: Config, seconds: float = 0.4) -> dict[str, float]:
    """Each rank times its own stage (update per batch, then per microbatch) while the other rank
    times its own at the same moment, with no messages between them: the split's ceiling on two
    cores that are both busy, as they are in a pipeline (on this VM's vCPUs each computes slower
    when the other one does)."""
    import torch
    import torch.distributed as dist

    from pipetrain.runtime.launch import init_distributed

    env = init_distributed("gloo", timeout=600)
    out = torch.zeros(2, 2, dtype=torch.float64)
    for column, every in enumerate((cfg.microbatches, 1)):
        run = stage_costs._stage(cfg, env.rank, every)
        for k in range(cfg.microbatches):  # warm-up, one update at least
            run(k)
        dist.barrier()
        began, k = time.perf_counter(), cfg.microbatches
        while k % cfg.microbatches or time.perf_counter() - began < seconds:
            run(k)
            k += 1
        out[env.rank, column] = (time.perf_counter() - began) / (k - cfg.microbatches)
        dist.barrier()
    dist.all_reduce(out)  # each rank filled its own row
    return {"stage 0": float(out[0, 0]), "stage 1": float(out[1, 0]),
            "stage 0+update": float(out[0, 1]), "stage 1+update": float(out[1, 1])}


def one_round(cfg: Config, order: list[str]) -> dict[str, float]:
    """samples/s of every contender and the ceilings, in ``order`` ("ceiling" among the names)."""
    rates: dict[str, float] = {}
    for name in order:
        if name == "ceiling":
            rates.update(ceiling_rates(cfg))
        else:
            rates[name] = CONTENDERS[name][1](cfg, cfg.steps, cfg.warmup)
    return rates


def ratios(rates: dict[str, float]) -> dict[str, float]:
    torch_best = max(rates["torch-gpipe"], rates["torch-1f1b"])
    one, pd = rates["pipetrain-1f1b"], rates["pipetrain-pipedream"]
    extra = {}
    if "pipetrain-2bw" in rates:
        extra = {"2bw/1f1b": rates["pipetrain-2bw"] / one, "2bw/torch": rates["pipetrain-2bw"] / torch_best}
    return {
        **extra,
        "1f1b/ceiling": one / rates["ceiling-1f1b"],
        "pd/ceiling": pd / rates["ceiling-pipedream"],
        "1f1b/ceiling-pair": one / rates["ceiling-1f1b-pair"],
        "pd/ceiling-pair": pd / rates["ceiling-pipedream-pair"],
        "1f1b/torch": one / torch_best,
        "pd/torch": pd / torch_best,
        "pd/1f1b": pd / one,
        "1f1b/R": one / rates["sequential"],
        "pd/R": pd / rates["sequential"],
        "torch-1f1b/torch-gpipe": rates["torch-1f1b"] / rates["torch-gpipe"],
    }


def trace_shares(trace: Path) -> dict[int, dict[str, tuple[float, float, int]]]:
    """rank -> kind -> (share of the rank's span, median us, count), after the first fifth of its actions."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
    ranks: dict[int, list] = defaultdict(list)
    for event in events:
        ranks[event["tid"]].append(event)
    out: dict[int, dict[str, tuple[float, float, int]]] = {}
    for rank, actions in sorted(ranks.items()):
        actions.sort(key=lambda e: e["ts"])
        actions = actions[len(actions) // 5:]
        span = actions[-1]["ts"] + actions[-1]["dur"] - actions[0]["ts"]
        kinds: dict[str, list[float]] = defaultdict(list)
        for action in actions:
            kinds[re.match(r"\d*([A-Z_]+)", action["name"]).group(1)].append(action["dur"])
        shares = {kind: (sum(d) / span, statistics.median(d), len(d)) for kind, d in sorted(kinds.items())}
        shares["(between actions)"] = (1 - sum(s for s, _, _ in shares.values()), 0.0, 0)
        out[rank] = shares
    return out


def traced(cfg: Config, schedule: str, out: Path) -> tuple[float, dict]:
    path = out / f"{cfg.width}-{cfg.microbatches}-{schedule}.trace.json"
    config = pipetrain_config(cfg, cfg.steps, cfg.warmup, schedule, trace=str(path))
    rate = pipetrain_rate(config, cfg, cfg.warmup)
    return rate, trace_shares(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-trace", action="store_true", help="skip the traced runs after the rounds")
    parser.add_argument("--with-2bw", action="store_true",
                        help="also run pipetrain's 2bw in every round (its ratios to 1f1b and torch; not a goal)")
    parser.add_argument("--out", default="/tmp/async_goals", help="traces and every round's rates (rounds.json)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.configs.split(",")
    print(f"machine: {os.cpu_count()} CPUs; every process pinned to its own core, 1 thread; "
          f"load average {os.getloadavg()[0]:.2f}")
    contenders = ["ceiling", *CONTENDER_NAMES, *(EXTRA_NAMES if args.with_2bw else [])]
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for round_ in range(args.rounds):
        for i, name in enumerate(names):
            order = contenders if (round_ + i) % 2 == 0 else contenders[::-1]
            rounds[name].append(one_round(ALL_CONFIGS[name], order))
        (out / "rounds.json").write_text(json.dumps(rounds, indent=1))
        print(f"  round {round_ + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)

    per_round_ratios: dict[str, list[dict[str, float]]] = {}
    for name in names:
        cfg = ALL_CONFIGS[name]
        print(f"\n{name}: width {cfg.width}, batch {cfg.batch} = {cfg.microbatches} x {cfg.microbatch}, "
              f"{cfg.steps} timed steps after {cfg.warmup}; medians of {args.rounds} rounds")
        for key in ["sequential", "torch-gpipe", "torch-1f1b", "pipetrain-1f1b", "pipetrain-pipedream",
                    "ceiling-1f1b", "ceiling-pipedream", "ceiling-1f1b-pair", "ceiling-pipedream-pair",
                    *EXTRA_NAMES]:
            if key not in rounds[name][0]:
                continue
            values = [r[key] for r in rounds[name]]
            print(f"  {key:22s} {statistics.median(values):9.0f} samples/s   rounds "
                  + ", ".join(f"{v:.0f}" for v in values))
        per_round = per_round_ratios[name] = [ratios(r) for r in rounds[name]]
        for key in per_round[0]:
            values = [r[key] for r in per_round]
            print(f"  {key:22s} {statistics.median(values):9.3f}   rounds " + ", ".join(f"{v:.2f}" for v in values))

    print("\ngoal                                                 configuration        median  rounds met  met")
    for label, configs, key, least in GOALS:
        for name in configs:
            if name not in rounds:
                continue
            values = [r[key] for r in per_round_ratios[name]]
            median = statistics.median(values)
            met = sum(v >= least for v in values)
            print(f"{label + f' >= {least}':52s} {name:18s} {median:8.3f}  {met:3d}/{len(values):<3d}    "
                  f"{'yes' if median >= least else 'NO'}")

    if args.no_trace:
        return
    print("\nwhere the time goes (one traced run each): share of each rank's span, median us per action, count")
    for name in names:
        cfg = ALL_CONFIGS[name]
        for schedule in ("1f1b", "pipedream"):
            rate, shares = traced(cfg, schedule, out)
            print(f"\n  {name}, pipetrain {schedule} traced: {rate:.0f} samples/s")
            for rank, kinds in shares.items():
                cells = ", ".join(f"{kind} {share:.0%} ({median:.0f} us x {count})" if count else
                                  f"{kind} {share:.0%}" for kind, (share, median, count) in kinds.items())
                print(f"    rank {rank}: {cells}")


if __name__ == "__main__":
    main()
