"""`pipetrain train`: train a model with any schedule, on the emulator or the distributed runtime."""

from __future__ import annotations

import argparse
import sys

from pipetrain.commands._text import number_list
from pipetrain.errors import ConfigError

__all__ = ["add_arguments", "run", "config_from_args"]

_int_list = number_list(int, "2,2,1")


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("model and data")
    what.add_argument("--model", default="mlp:depth=2,width=128",
                      help="built-in name (mlp, resmlp, resnet-gn, resnet-gn-skip, gpt) or PKG.MOD:FACTORY, "
                           "with optional :k=v,... (default mlp:depth=2,width=128)")
    what.add_argument("--data", default="digits", help="digits, synthetic:features=N,classes=C,samples=K, or "
                      "PKG.MOD:FACTORY (default digits)")
    what.add_argument("--test-data", help="a separate held-out data spec (default: the data's own test split)")
    what.add_argument("--holdout", type=float, metavar="FRACTION",
                      help="hold out this fraction of --data (a fixed split) for evaluation instead (default: none; "
                           "a data factory without split= then has no held-out data)")
    what.add_argument("--data-workers", type=int, metavar="N",
                      help="DataLoader worker processes reading a plain Dataset ahead, 0 for the training thread "
                           "(default 1; two-tensor and batch() data sets are read by index on a thread)")
    what.add_argument("--pin-memory", action="store_true", help="page-locked batches, with an accelerator (default off)")
    how = parser.add_argument_group("pipeline")
    how.add_argument("--schedule", help="gpipe, 1f1b (default), interleaved, zb-h1, pipedream, 2bw, pb")
    how.add_argument("--stages", type=int, help="number of pipeline stages (ranks for interleaved)")
    how.add_argument("--balance", type=_int_list, help="modules per stage, e.g. 2,2,1")
    how.add_argument("--split-at", type=_name_list, help="module names that start a new stage")
    how.add_argument("--plan", help="a plan JSON from `pipetrain plan`")
    how.add_argument("--replicas", type=_int_list, help="replicas per stage, e.g. 2,1")
    how.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved)")
    how.add_argument("--policy", help="weight-version policy replacing the schedule's (stash, vsync, latest, predict)")
    how.add_argument("--microbatches", type=int, help="microbatches per update (default 4; 1 for pipedream and pb)")
    train = parser.add_argument_group("training")
    train.add_argument("--batch-size", type=int, default=32, help="samples per optimizer update (default 32)")
    train.add_argument("--steps", type=int, help="optimizer updates")
    train.add_argument("--epochs", type=float, help="passes over the training data (default 1 when --steps is absent)")
    train.add_argument("--optimizer", default="sgd:lr=0.02,momentum=0.9", help="e.g. sgd:lr=0.1,momentum=0.9 or adam:lr=1e-3")
    train.add_argument("--lr-schedule", help="constant, step:milestones=a/b,gamma=.., cosine:total=.., end:total=..,fraction=..")
    train.add_argument("--compensation", default="none", help="none, sc, lwp or sc+lwp (delays from the schedule)")
    train.add_argument("--translate-from-batch", type=int, metavar="B",
                       help="treat --optimizer's lr and momentum as tuned for batch B and translate them to --batch-size")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--no-shuffle", action="store_true", help="update t consumes samples tB..(t+1)B-1 in order")
    train.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    train.add_argument("--eval-every", type=int, default=0, help="evaluate on held-out data every K updates (and at the end)")
    train.add_argument("--eval-samples", type=int, help="evaluate on the first N held-out samples only (default: all)")
    run_group = parser.add_argument_group("execution")
    run_group.add_argument("--executor", default="distributed", choices=["distributed", "emulate"],
                           help="distributed (one process per stage replica, the default) or emulate (one process)")
    run_group.add_argument("--workers", type=int, help="worker processes (default: one per stage replica)")
    run_group.add_argument("--threads-per-worker", type=int, default=1)
    run_group.add_argument("--receives", default="auto", choices=["auto", "on-demand", "ahead"],
                           help="distributed: post each receive when it is reached (on-demand), keep every channel's "
                                "next receive posted (ahead), or on-demand where provably deadlock-free (auto)")
    run_group.add_argument("--timeout", type=float, default=60.0, help="seconds any blocking wait may take")
    out = parser.add_argument_group("outputs")
    out.add_argument("--save", help="write the trained (unsplit) model's state_dict")
    out.add_argument("--report-json", help="write a JSON report (samples_per_s, final_loss, steps, ...)")
    out.add_argument("--trace", help="write the measured per-action timeline as a Chrome/Perfetto trace")
    out.add_argument("--plot", help="draw the measured timeline next to the simulated one (PNG)")
    out.add_argument("--checkpoint-dir")
    out.add_argument("--checkpoint-every", type=int, default=0)
    out.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                     help="continue from the newest complete checkpoint in --checkpoint-dir, or from the named "
                          "step directory (refused if it is incomplete or damaged)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace):
    from pipetrain.training import TrainConfig

    optimizer = args.optimizer
    if args.translate_from_batch:
        optimizer = _translated(optimizer, args.translate_from_batch, args.batch_size)
    return TrainConfig(
        model=args.model, data=args.data, test_data=args.test_data, holdout=args.holdout,
        data_workers=args.data_workers, pin_memory=args.pin_memory, schedule=args.schedule, stages=args.stages,
        balance=args.balance, split_at=args.split_at, plan=args.plan, replicas=args.replicas, chunks=args.chunks,
        policy=args.policy, microbatches=args.microbatches, batch_size=args.batch_size, steps=args.steps,
        epochs=args.epochs, optimizer=optimizer, lr_schedule=args.lr_schedule, compensation=args.compensation,
        executor=args.executor, workers=args.workers, threads_per_worker=args.threads_per_worker,
        receives=args.receives, timeout=args.timeout, seed=args.seed, shuffle=not args.no_shuffle, dtype=args.dtype,
        eval_every=args.eval_every, eval_samples=args.eval_samples, save=args.save, report_json=args.report_json,
        trace=args.trace, plot=args.plot,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
        progress=not args.no_progress and sys.stderr.isatty(),
    )


def _translated(spec_text: str, reference_batch: int, batch_size: int) -> str:
    """Rewrite an SGD spec tuned at ``reference_batch`` for ``batch_size`` (DESIGN.md 3.5)."""
    from pipetrain.optim import parse_optimizer_spec, translate_hyperparameters

    spec = parse_optimizer_spec(spec_text)
    if spec.name != "sgd":
        raise ConfigError("--translate-from-batch translates SGD hyper-parameters; use an sgd:... --optimizer")
    options = dict(spec.options)
    if batch_size != 1:
        raise ConfigError("--translate-from-batch translates to batch size 1: use it with --batch-size 1")
    translated = translate_hyperparameters(
        reference_batch, float(options.get("lr", 1e-3)), float(options.get("momentum", 0.0)),
        float(options.get("weight_decay", 0.0)),
    )
    options.update(lr=translated.lr, momentum=translated.momentum)
    return "sgd:" + ",".join(f"{k}={v}" for k, v in options.items())


def run(args: argparse.Namespace) -> int:
    from pipetrain.training.train import train

    config = config_from_args(args)
    result = train(config)
    if result is None:  # a worker process of the distributed runtime: rank 0 reports
        _finish_if_worker()
        return 0
    if result.extra.get("data"):
        print(result.extra["data"])
    line = (
        f"{result.schedule}: {result.updates} steps on {result.workers} "
        f"{'workers' if result.executor == 'distributed' else 'emulated ranks'}, "
        f"{result.samples_per_s:.0f} samples/s, final loss {result.final_loss:.4f}"
    )
    if result.evaluations:
        final = result.evaluations[-1]
        line += f", test loss {final['loss']:.4f}, test accuracy {100 * final['accuracy']:.2f} %"
    print(line)
    for flag, path in (("model", config.save), ("report", config.report_json), ("trace", config.trace),
                       ("plot", config.plot)):
        if path:
            print(f"wrote {flag}: {path}")
    _finish_if_worker()
    return 0


def _finish_if_worker() -> None:
    """A worker started by torchrun leaves the process group and exits here (see
    :func:`pipetrain.runtime.launch.finish_worker`)."""
    if config_is_worker():
        from pipetrain.runtime.launch import finish_worker

        finish_worker()


def config_is_worker() -> bool:
    import os

    return "TORCHELASTIC_RUN_ID" in os.environ
