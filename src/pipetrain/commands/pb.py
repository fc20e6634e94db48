"""`pipetrain pb`: the Pipelined Backpropagation study (PB, SC, LWP against batch-1 SGD)."""

from __future__ import annotations

import argparse
import json
import sys

from pipetrain.commands._text import number_list
from pipetrain.errors import ConfigError

__all__ = ["add_arguments", "run"]

# Imports inside functions are deliberate here: PyTorch and the library load when the command runs, so
# that `pipetrain --help` and the checks of options and output paths answer without them.

_floats = number_list(float, "0.5,1,2")
_ints = number_list(int, "4,8,16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="resmlp", help="model spec cut into stages (default resmlp: 18 units)")
    parser.add_argument("--data", default="digits", help="training data spec (default digits)")
    parser.add_argument("--test-data", metavar="SPEC",
                        help="separate test set (default: --data's own test split, else a fixed 20 %% of it)")
    parser.add_argument("--stages", type=_ints, default=[4, 8, 16], metavar="S[,S...]",
                        help="pipeline stage counts (default 4,8,16; at most the model's units)")
    parser.add_argument("--methods", default="sgd-batch,sgd,pb,pb+sc,pb+lwp,pb+sc+lwp",
                        help="sgd-batch, sgd, pb, pb+sc, pb+lwp, pb+sc+lwp, scaled compensation "
                             "such as pb+sc0.5+lwp0.5, and +dlr or +dlrN (delay-scaled lr, reference delay N) or +dts "
                             "or +dtsN (delay time scaling: lr and momentum) or +dtsf or +dtsfN (delay time scaling that follows the lr "
                             "schedule) or +dtt or +dttN (delay time scaling at SGD's temperature lr/(1-m)), e.g. pb+sc0.5+lwp+dlr16, "
                             "pb+sc+lwp+dtt4 (default sgd-batch,sgd,pb,pb+sc,pb+lwp,pb+sc+lwp)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds 0..N-1 per cell (default 2)")
    parser.add_argument("--epochs", type=float, default=5.0, help="passes over the training data (default 5)")
    parser.add_argument("--reference-batch", type=int, default=32, help="reference batch size B (default 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="reference learning rate at batch B (default 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="reference momentum at batch B (default 0.9)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="weight decay (default 0)")
    parser.add_argument("--lr-scale", type=_floats, default=[1.0], metavar="X[,X...]",
                        help="multiples of the (translated) learning rate, e.g. 0.3,0.5,1,2 (default 1.0)")
    parser.add_argument("--delay-scale", type=_floats, default=[1.0], metavar="X[,X...]",
                        help="SC delay / LWP horizon as multiples of D_s, a sweep (default 1.0)")
    parser.add_argument("--decay-fraction", type=float, default=0.2,
                        help="the lr decays linearly to 0 over this last fraction of the samples (default 0.2)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="default float32")
    parser.add_argument("--max-runs", type=int, default=0,
                        help="runs trained together in one batched engine (default 0: 16 for S <= 4, "
                             "8 for S = 8, 4 for longer pipelines)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes training in parallel, one thread each (default 1)")
    parser.add_argument("--out", metavar="DIR", help="write results.md, summary.csv, runs.csv, results.json and plots, and keep every finished run in "
                             "DIR/runs.jsonl: the same command again resumes an interrupted study (default: print only)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--from-json", metavar="FILE",
                        help="redraw tables and plots of an earlier study's results.json, no training (default: train)")


def run(args: argparse.Namespace) -> int:
    from pipetrain.paths import check_outputs

    check_outputs(directories={"--out": args.out})  # before PyTorch and the study
    import torch

    from pipetrain.pb.methods import parse_methods
    from pipetrain.pb.study import StudyConfig, run_study

    if args.from_json:
        from pipetrain.pb.report import load_results

        try:
            result = load_results(args.from_json)
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"--from-json {args.from_json}: not a results.json of pipetrain pb ({error})") from None
        return _show(args, result)
    if args.seeds < 1:
        raise ConfigError(f"--seeds must be at least 1, got {args.seeds}")
    torch.set_num_threads(1)
    config = StudyConfig(
        model=args.model, data=args.data, test_data=args.test_data, stages=tuple(args.stages),
        methods=tuple(parse_methods(args.methods)), seeds=tuple(range(args.seeds)), epochs=args.epochs,
        reference_batch=args.reference_batch, lr=args.lr, momentum=args.momentum,
        weight_decay=args.weight_decay, lr_scales=tuple(args.lr_scale), delay_scales=tuple(args.delay_scale),
        decay_fraction=args.decay_fraction, dtype=args.dtype, max_runs=args.max_runs, workers=args.workers,
    )
    bar = None
    progress = on_start = None
    if not args.no_progress:
        from tqdm import tqdm

        def on_start(total: int) -> None:
            nonlocal bar
            bar = tqdm(total=total, unit="sample", unit_scale=True, desc="pb study", file=sys.stderr,
                       dynamic_ncols=True, mininterval=1.0)

        def progress(count: int) -> None:
            if bar is not None:
                bar.update(count)

    journal = None
    if args.out:
        from pipetrain.pb.journal import StudyJournal

        journal = StudyJournal(args.out, config)

    def on_resume(held: int, total: int) -> None:
        if held:
            print(f"resuming the study in {journal.path}: {held} of {total} runs already trained", file=sys.stderr)

    try:
        result = run_study(config, progress=progress, on_start=on_start, journal=journal, on_resume=on_resume)
    finally:
        if bar is not None:
            bar.close()
    return _show(args, result)


def _show(args: argparse.Namespace, result) -> int:
    from pipetrain.pb.report import markdown_tables, study_json, write_outputs

    config = result.config
    written = []
    if args.out:
        written = write_outputs(result, args.out)
    if args.json:
        json.dump(study_json(result), sys.stdout)
        sys.stdout.write("\n")
        return 0
    hyper = result.hyperparameters
    from pipetrain.pb.study import untrained_text

    for entry in hyper.get("untrained_reference", []):
        print(untrained_text(entry), file=sys.stderr)
    ref, tr = hyper["reference"], hyper["translated"]
    print(f"{config.model} on {config.data} ({result.train_samples} train / {result.test_samples} test samples, "
          f"{hyper['units']} units), {config.epochs:g} epochs, seeds {len(config.seeds)}, {result.seconds:.0f} s")
    print(f"reference batch {ref['batch_size']}: lr {ref['lr']:g}, momentum {ref['momentum']:g} -> batch 1: "
          f"lr {tr['lr']:.4g}, momentum {tr['momentum']:.6g}; lr decays to 0 over the last "
          f"{100 * config.decay_fraction:g} % of samples")
    print("cells: test accuracy % (mean ± std over seeds) · median final training loss [· diverged runs]")
    print()
    print(markdown_tables(result))
    if args.out:
        for path in written:
            print(f"wrote {path}")
    return 0
