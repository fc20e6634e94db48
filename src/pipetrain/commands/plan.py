"""`pipetrain plan PROFILE`: partition a profiled model over workers (PipeDream's optimizer).

Examples::

    pipetrain plan vgg16.txt --workers 16
    pipetrain plan vgg16.txt --workers 16 --topology 4x4 --bandwidth 10e9,1.25e9 --json
    pipetrain plan profile.json --workers 8 --memory 16GB --schedule auto --plot plan.png
    pipetrain plan profile.json --workers 4 --memory 2GB --schedule 1f1b --recompute auto --out plan.json
    pipetrain plan profile.json --workers 2 --schedule auto --costs-file calibration.json
"""

from __future__ import annotations

import argparse
import json
import time

from pipetrain.commands._text import aligned
from pipetrain.errors import ConfigError

__all__ = ["add_arguments", "run", "HELP"]

# Imports inside functions are deliberate here: PyTorch and the library load when the command runs, so
# that `pipetrain --help` and the checks of options and output paths answer without them.

HELP = "partition a profiled model into stages and replicas (PipeDream's optimizer)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("profile", metavar="PROFILE",
                        help="a pipetrain JSON profile (pipetrain profile) or a PipeDream "
                             "graph.txt")
    parser.add_argument("--workers", type=int, default=None,
                        help="number of workers (default: the product of --topology)")
    parser.add_argument("--topology", default=None, metavar="AxB[xC]",
                        help="components per level, innermost first: 4x4 = 4 servers of 4 "
                             "workers; the product must equal --workers (default: one flat level of --workers)")
    parser.add_argument("--bandwidth", default=None, metavar="B1[,B2,...]",
                        help="bytes/s per level, innermost first (default 1e9); one value "
                             "without --topology is one flat level")
    parser.add_argument("--memory", default=None, metavar="BYTES",
                        help="memory per worker, e.g. 16GB or 12GiB (weight versions, optimizer "
                             "state and in-flight activations of the schedule count; default: unlimited)")
    parser.add_argument("--schedule", default="pipedream", metavar="NAME|auto",
                        help="pipedream, 2bw, 1f1b, zb-h1, zb-h2, gpipe; interleaved, bfs, interleaved-zb, zb-v, "
                             "v-half, v-min, dualpipev (2 stages per worker, cut by time); or auto: the fastest "
                             "that fits --memory (default pipedream)")
    parser.add_argument("--recompute", default="none", choices=["none", "auto"],
                        help="auto: under --memory, a stage that would not fit otherwise keeps only its inputs "
                             "and runs its forward again in its backward, its time including that forward "
                             "(one flat level; not under zb-h1); the plan names the stages, and pipetrain train "
                             "--plan recomputes them (default none: every activation kept)")
    parser.add_argument("--microbatches", type=int, default=None,
                        help="microbatches per minibatch for 2bw/1f1b/zb-h1/gpipe "
                             "(default: the worker count)")
    parser.add_argument("--cost-model", default="pipedream-code",
                        choices=["pipedream-code", "paper"],
                        help="pipedream-code: compute + all-reduce added (the public code); "
                             "paper: max of compute and all-reduce (default pipedream-code)")
    parser.add_argument("--costs-file", default=None, metavar="FILE",
                        help="a calibration (pipetrain calibrate): --schedule auto's and the chunked schedules' "
                             "simulations also charge its per-action overhead, message costs and optimizer step "
                             "(default: the profile's compute and the topology's bandwidths only)")
    parser.add_argument("--straight", action="store_true",
                        help="a straight pipeline: no replication of stages")
    parser.add_argument("--fewer-machines", action="store_true",
                        help="allow idle workers when that is faster (more workers never hurt)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the comparison with the baseline partitioners")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object instead of the table")
    parser.add_argument("--out", default=None, metavar="PLAN.json",
                        help="write the plan as JSON, for pipetrain train --plan (default: print only)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw the stages along the layer axis (default: none)")


def run(args: argparse.Namespace) -> int:
    from pipetrain.plan.graph import build_cuts
    from pipetrain.plan.stage_memory import parse_bytes
    from pipetrain.plan.planner import compare_baselines, make_plan, training_hints
    from pipetrain.plan.profile_files import load_profile
    from pipetrain.plan.topology import Topology

    from pipetrain.paths import IMAGE, JSON, check_outputs

    check_outputs(files={"--out": args.out, "--plot": args.plot},
                  formats={"--out": JSON, "--plot": IMAGE})  # before solving
    if args.microbatches is not None and args.microbatches < 1:
        raise ConfigError(f"--microbatches must be >= 1, got {args.microbatches}")
    topology = Topology.parse(args.workers, args.topology, args.bandwidth)
    memory = parse_bytes(args.memory) if args.memory is not None else None
    if args.recompute == "auto" and memory is None:
        raise ConfigError("--recompute auto lets stages that would not fit --memory recompute their activations: "
                          "give --memory BYTES too")
    if args.recompute == "auto" and topology.levels > 1:
        raise ConfigError("--recompute auto is planned on one flat level of workers, where --memory is exact: drop "
                          "--topology (one --bandwidth) or --recompute")
    if args.recompute == "auto" and args.schedule == "zb-h1":
        raise ConfigError("--recompute auto is not planned under zb-h1 (its split backward keeps each recomputed "
                          "graph until the weight gradient; docs/planner.md): use another --schedule, or auto")
    calibration = None
    if args.costs_file:
        from pipetrain.schedule.costs import load_calibration

        calibration = load_calibration(args.costs_file)
    profile = load_profile(args.profile)
    started = time.perf_counter()
    cuts = build_cuts(profile)
    plan = make_plan(cuts, topology, schedule=args.schedule, cost_model=args.cost_model,
                     straight=args.straight, fewer_machines=args.fewer_machines,
                     memory_limit=memory, microbatches=args.microbatches, progress=True,
                     recompute=args.recompute == "auto", calibration=calibration)
    plan.solve_seconds = time.perf_counter() - started
    baselines = [] if args.no_baselines else compare_baselines(  # straight pipelines: 1f1b's memory for chunked
        cuts, topology, cost_model=args.cost_model, schedule="1f1b" if plan.chunks > 1 else plan.schedule,
        microbatches=plan.microbatches)
    data = plan.to_json()
    data["profile"] = str(args.profile)
    if calibration is not None:
        data["calibration"] = {"file": args.costs_file, "measured_on": calibration.measured_on}
    data.update(training_hints(plan, profile))
    data["baselines"] = [{"method": b.method, "predicted_time_per_minibatch":
                          b.predicted_time_per_minibatch, "replicas": b.replicas,
                          "peak_memory_bytes": max(s.memory_bytes or 0.0 for s in b.stages),
                          "fits_memory": memory is None or
                          max(s.memory_bytes or 0.0 for s in b.stages) <= memory}
                         for b in baselines]
    if args.out:
        from pipetrain.training.result import write_json_atomic

        write_json_atomic(args.out, data)
    if args.plot:
        from pipetrain.plan.plot import plot_plan

        plot_plan(plan, profile, args.plot, baselines)
    if args.json:
        print(json.dumps(data))
    else:
        print(format_table(plan, baselines, str(args.profile)))
        for path, what in ((args.out, "plan"), (args.plot, "picture")):
            if path:
                print(f"wrote {what} to {path}")
    return 0


def _span(names: list[str]) -> str:
    if len(names) == 1:
        return names[0]
    return f"{names[0]}..{names[-1]} ({len(names)})"


def format_table(plan, baselines, source: str) -> str:
    from pipetrain.plan.stage_memory import format_bytes

    lines = [f"plan for {source}: {plan.topology}, cost model {plan.cost_model}, "
             f"schedule {plan.schedule}"
             + (f" ({plan.microbatches} microbatches)" if plan.schedule != "pipedream" else "")
             + (f", {plan.chunks} stages per worker (memory: the worker's)" if plan.chunks > 1 else "")]
    header = ("stage", "layers", "replicas", "compute s", "time s", "input xfer s", "memory")
    rows = [header]
    for s, stage in enumerate(plan.stages):
        rows.append((str(s), _span(stage.layers), str(stage.replicas),
                     f"{stage.compute_s:.6f}", f"{stage.time_s:.6f}",
                     f"{stage.input_transfer_s:.6f}",
                     format_bytes(stage.memory_bytes or 0.0)
                     + (f", recomputing (+{stage.recompute_s:.6f} s)" if stage.recompute else "")))
    lines.extend(aligned(rows))
    t = plan.predicted_time_per_minibatch
    ratio = (lambda a: f"{a / t:.3f}x") if t > 0 else (lambda a: "-")
    lines.append(f"predicted time per minibatch: {t:.9f} s (slowest stage, communication "
                 f"included); replicas {'-'.join(map(str, plan.replicas))}; NOAM {plan.noam}; "
                 f"workers used {plan.workers_used} of {plan.workers}")
    if plan.time_per_minibatch_with_bubble != t:
        lines.append(f"with the pipeline bubble of {plan.schedule}: "
                     f"{plan.time_per_minibatch_with_bubble:.9f} s per minibatch")
    lines.append(f"speedup: {ratio(plan.single_worker_time)} vs 1 worker "
                 f"({plan.single_worker_time:.6f} s), "
                 f"{ratio(plan.data_parallel_time)} vs {plan.workers}-way data parallelism "
                 f"({plan.data_parallel_time:.6f} s); solved in {plan.solve_seconds:.3f} s")
    candidates = plan.extra.get("schedule_candidates")
    if candidates:
        lines.append(f"schedule chosen by simulation: {plan.schedule} with {plan.microbatches} "
                     f"microbatch(es), {plan.extra['simulated_time_per_minibatch']:.6f} s per "
                     f"minibatch simulated (bubble "
                     f"{plan.extra['simulated_bubble_fraction'] * 100:.1f} %)")
        table = [("schedule", "m", "replicas", "simulated s", "peak memory", "fits")]
        for c in candidates:
            if "error" in c:
                from pipetrain.plan.stage_memory import smallest_fitting

                need = smallest_fitting([c["error"]])
                why = f"no (needs {need[1]})" if need else "no: " + c["error"].split(";")[0][:60]
                table.append((c["schedule"], str(c["microbatches"]), "-", "-", "-", why))
            else:
                table.append((c["schedule"], str(c["microbatches"]),
                              _replicas_text(c["replicas"]) if c.get("chunks", 1) == 1 else
                              f"{len(c['replicas'])} stages, {c['chunks']} per worker",
                              f"{c['simulated_time_per_minibatch']:.6f}",
                              format_bytes(c["peak_memory_bytes"]),
                              "yes" if c["fits"] else "no"))
        lines.extend(aligned(table, indent="  "))
    if baselines:
        lines.append("")
        lines.append("comparison, same cost model (baselines: straight pipelines, slowest "
                     "bandwidth)")
        table = [("method", "time/minibatch s", "vs this plan", "replicas")]
        for p in [plan] + list(baselines):
            table.append((f"this plan ({p.method})" if p is plan else p.method,
                          f"{p.predicted_time_per_minibatch:.6f}",
                          ratio(p.predicted_time_per_minibatch),
                          _replicas_text(p.replicas)))
        table.append((f"data parallel ({plan.workers})", f"{plan.data_parallel_time:.6f}",
                      ratio(plan.data_parallel_time), str(plan.workers)))
        lines.extend(aligned(table))
    return "\n".join(lines)


def _replicas_text(replicas: list[int], shown: int = 16) -> str:
    """``3-1`` for a few stages; a long straight pipeline as ``1-1-1-...-1 (177 stages)``."""
    if len(replicas) <= shown:
        return "-".join(map(str, replicas))
    head, tail = "-".join(map(str, replicas[:shown - 2])), "-".join(map(str, replicas[-2:]))
    return f"{head}-...-{tail} ({len(replicas)} stages)"
