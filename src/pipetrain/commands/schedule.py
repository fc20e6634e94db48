"""`pipetrain schedule`: generate (or load), validate, simulate and draw schedules."""

from __future__ import annotations

import argparse
import json
import sys

from pipetrain.commands._text import number_list
from pipetrain.errors import ScheduleError

__all__ = ["add_arguments", "run"]

# Imports inside functions are deliberate here: PyTorch and the library load when the command runs, so
# that `pipetrain --help` and the checks of options and output paths answer without them.

_int_list = number_list(int, "3,1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?",
                        help="schedule: gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v, v-half, v-min, zb-auto, bfs, "
                             "interleaved-zb, dualpipev, pipedream, 2bw, pb, or torch's name of one (GPipe, 1F1B, "
                             "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)")
    parser.add_argument("--stages", type=int,
                        help="pipeline stages S (ranks for the looped schedules interleaved, bfs, interleaved-zb "
                             "and the V schedules zb-v, v-half, v-min, dualpipev: 2 chunks each); default 4")
    parser.add_argument("--microbatches", type=int, default=8,
                        help="microbatches per step; for pipedream and pb the number of units, each its own update "
                             "(default 8)")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps (synchronous schedules and 2bw; default 1)")
    parser.add_argument("--chunks", type=int, default=1,
                        help="model chunks per rank (interleaved, bfs, interleaved-zb; default 1, 2 for those in "
                             "--compare; dualpipev always holds 2)")
    parser.add_argument("--replicas", type=_int_list, help="replicas per stage, e.g. 3,1 (gpipe, 1f1b, pipedream, 2bw; default 1 each)")
    parser.add_argument("--policy", help="weight-version policy replacing the preset's: stash, vsync, latest, predict (default: the preset's)")
    parser.add_argument("--memory-limit", type=int,
                        help="zb-auto: peak activations per rank, in microbatches of one stage (1f1b holds S on rank 0; "
                             "default S); the search orders for --costs / --costs-file")
    parser.add_argument("--update-every", type=int, default=1, help="pipedream/pb: units accumulated per update (default 1)")
    parser.add_argument("--costs", default="",
                        help="F=1,B=2,W=0[,latency=..,bandwidth=..,bytes=..,step=..,sync=..] (default: F=1,B=2, "
                             "W=0, free communication)")
    parser.add_argument("--costs-file", help='JSON with per-stage lists, e.g. {"F": [1, 1, 2, 1], "B": [2, 2, 4, 2]} (default: --costs)')
    parser.add_argument("--load", metavar="FILE",
                        help="read the schedule from a file instead of generating it: pipetrain's text form or torch's "
                             "CSV (compute_only or compute_comms, as torch's _dump_csv writes it) (default: generate "
                             "NAME)")
    parser.add_argument("--compare", help="comma-separated schedules to simulate and draw one under another (default: NAME only)")
    parser.add_argument("--recompute", default="none",
                        help="memory with activation recomputation: none, stage (every stage keeps only its inputs) "
                             "or stage:LIST (those stages, e.g. stage:0,2) (default none)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="write a Gantt chart, the comparison with --compare (default: none)")
    parser.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace (default: none)")
    parser.add_argument("--csv", metavar="FILE", help="write the schedule's programs as CSV text (default: none)")
    parser.add_argument("--format", choices=("pipetrain", "torch"), default="pipetrain",
                        help="the --csv file's form: pipetrain's (versions, communication, updates) or torch's "
                             "compute_only CSV, which _PipelineScheduleRuntime._load_csv reads (default pipetrain)")
    parser.add_argument("--programs", metavar="FILE.json", help="write the programs as JSON, one list of actions per rank (default: none)")
    parser.add_argument("--show", action="store_true", help="print every rank's program")


def _costs(args: argparse.Namespace):
    from pipetrain.schedule import load_costs, parse_costs

    if args.costs_file and args.costs:
        raise ScheduleError("give either --costs or --costs-file, not both")
    if args.costs_file:
        return load_costs(args.costs_file)
    return parse_costs(args.costs)


def _stages(args: argparse.Namespace) -> int:
    if args.stages is not None:
        return args.stages
    return len(args.replicas) if args.replicas else 4


def _generate(name: str, args: argparse.Namespace, costs=None, *, comparing: bool = False):
    from pipetrain.schedule import ASYNCHRONOUS, build, resolve_name
    from pipetrain.schedule.presets import LOOPED

    name = resolve_name(name)
    chunks = args.chunks if name in LOOPED or not comparing else 1  # build refuses chunks elsewhere
    if comparing and name in LOOPED and chunks == 1:
        chunks = 2
    microbatches, steps = args.microbatches, args.steps
    if name in ASYNCHRONOUS and name != "2bw":
        microbatches, steps = microbatches * steps, 1
    replicas = args.replicas if name in ("gpipe", "1f1b", "pipedream", "2bw") or not comparing else None
    auto = name == "zb-auto"
    if args.memory_limit is not None and not auto and not comparing:  # said here: `plan` names the field --memory
        raise ScheduleError(f"--memory-limit applies to zb-auto only, not to {name}")
    return build(
        name, _stages(args), microbatches, steps=steps, chunks=chunks, replicas=replicas,
        policy=args.policy if not comparing else None,
        update_every=args.update_every if name in ("pipedream", "pb") else 1,
        costs=costs if auto else None, memory_limit=args.memory_limit if auto else None,
    )


def run(args: argparse.Namespace) -> int:
    from pipetrain.collector import gc_paused

    with gc_paused():  # a command over 10^5..10^6 small tuples that cannot form cycles
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from pipetrain.schedule import check, dump, simulate
    from pipetrain.schedule import torch_csv
    from pipetrain.paths import IMAGE, JSON, TEXT, check_outputs
    from pipetrain.schedule.summary import format_summary, summarize

    check_outputs(files={"--plot": args.plot, "--trace": args.trace, "--csv": args.csv, "--programs": args.programs},
                  formats={"--plot": IMAGE, "--trace": JSON, "--csv": TEXT, "--programs": JSON})

    if args.format == "torch" and not args.csv:
        raise ScheduleError("--format torch says how --csv writes the schedule; add --csv FILE.csv")
    costs = _costs(args)
    if args.compare:
        if args.name or args.load:
            raise ScheduleError("--compare takes the schedule names itself; drop the NAME argument / --load")
        names = [n.strip() for n in args.compare.split(",") if n.strip()]
        if not names:
            raise ScheduleError("--compare needs schedule names, e.g. --compare gpipe,1f1b,zb-h1,pipedream")
        schedules = [_generate(n, args, costs, comparing=True) for n in names]
    elif args.load:
        schedules = [torch_csv.read(args.load)]
    elif args.name:
        schedules = [_generate(args.name, args, costs)]
    else:
        raise ScheduleError("name a schedule (e.g. pipetrain schedule 1f1b), or use --compare or --load FILE")

    timelines, summaries = [], []
    for schedule in schedules:
        check(schedule, deadlock=False)
        timeline = simulate(schedule, costs)  # also the dry run: raises DeadlockError if stuck
        timelines.append(timeline)
        summaries.append(summarize(timeline, include_versions=args.json, recompute=args.recompute))

    if args.csv or args.programs:
        if len(schedules) != 1:
            raise ScheduleError("--csv and --programs write one schedule; drop --compare")
        if args.csv:
            (torch_csv.dump if args.format == "torch" else dump)(schedules[0], args.csv)
        if args.programs:
            _write_programs(schedules[0], args.programs)
    if args.trace:
        from pipetrain.schedule.chrome_trace import write_trace

        write_trace(args.trace, *timelines, names=[s.name for s in schedules])
    if args.plot:
        from pipetrain.schedule.plot import plot_comparison, plot_timeline

        titles = [_title(s) for s in summaries]
        if len(timelines) == 1:
            plot_timeline(timelines[0], args.plot, title=titles[0])
        else:
            plot_comparison(timelines, titles, args.plot)

    if args.json:
        payload = summaries[0] if len(summaries) == 1 else {"schedules": summaries}
        sys.stdout.write(json.dumps(payload) + "\n")
        return 0
    for index, (schedule, summary) in enumerate(zip(schedules, summaries)):
        if index:
            print()
        print(format_summary(summary))
        if args.show:
            print()
            for rank, program in enumerate(schedule.programs):
                print(f"  rank {rank}: " + " ".join(str(a) for a in program))
    for flag, path in (("plot", args.plot), ("trace", args.trace), ("csv", args.csv), ("programs", args.programs)):
        if path:
            print(f"wrote {flag}: {path}")
    return 0


def _write_programs(schedule, path: str) -> None:
    from pipetrain.training.result import write_json_atomic

    write_json_atomic(path, {
        "name": schedule.name, "policy": schedule.policy, "microbatches": schedule.microbatches,
        "steps": schedule.steps, "chunks": schedule.chunks, "placement": schedule.stage_ranks,
        "programs": [[str(action) for action in program] for program in schedule.programs],
    })


def _title(summary: dict) -> str:
    peak_act = f"{summary['peak_activation_memory']:g}"
    peak_ver = max(s["peak_versions"] for s in summary["stages"])
    return (
        f"{summary['schedule']}  (policy {summary['policy']}):  makespan {summary['makespan']:.4g},  "
        f"bubble {100 * summary['bubble_fraction']:.1f} %,  peak activations {peak_act},  peak versions {peak_ver}"
    )

