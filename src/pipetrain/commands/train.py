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


def _options(text: str) -> dict:
    """``k=v,...`` with values parsed as in specs (true/false/none, numbers, else strings)."""
    from pipetrain.spec import parse_value

    options = {}
    for item in (part for part in text.split(",") if part.strip()):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE,..., e.g. use_cache=false; got {item!r}")
        options[key.strip()] = parse_value(value)
    return options


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
    what.add_argument("--init", choices=["eager", "meta"],
                      help="meta: build the model on PyTorch's meta device (shapes, no memory); each worker "
                           "materialises only its own stages, initialised by each module's reset_parameters() under "
                           "--seed, or from --init-from (default: eager, unless --init-from is given)")
    what.add_argument("--init-from", metavar="DIR",
                      help="start from the weights in DIR (written by --save DIR, or a HuggingFace save_pretrained "
                           "directory): each worker reads only its stages' tensors; implies --init meta unless "
                           "--init eager (default: none)")
    how = parser.add_argument_group("pipeline")
    how.add_argument("--schedule", help="gpipe, 1f1b, interleaved, zb-h1, pipedream, 2bw, pb (default: the "
                     "plan's, else 1f1b)")
    how.add_argument("--stages", type=int, help="number of pipeline stages (ranks for interleaved), cut as "
                     "--balance-by says (default: as many as --balance, --split-at or --replicas give, else "
                     "--workers, else 2)")
    how.add_argument("--balance", type=_int_list, help="modules per stage, e.g. 2,2,1 (default: --stages cut as "
                     "--balance-by says)")
    how.add_argument("--split-at", type=_name_list, help="module names that start a new stage (default: --stages "
                     "cut as --balance-by says)")
    how.add_argument("--balance-by", default="auto", choices=["auto", "time", "params"],
                     help="what --stages S balances: measured time (time), parameter count (params), or auto: "
                          "time on synchronous schedules, where the cut cannot change the result, parameter count "
                          "on asynchronous ones, with dropout or with tied weights (default auto)")
    how.add_argument("--leaf-modules", type=_name_list, metavar="NAMES",
                     help="modules a traced model calls whole, by qualified name or class name (e.g. "
                          "blocks.0.attn or Attention); a stage cannot start inside them (default: none)")
    how.add_argument("--concrete-args", type=_options, metavar="K=V,...",
                     help="values fixed for non-tensor forward arguments when tracing, e.g. use_cache=false "
                          "(default: each argument's own default)")
    how.add_argument("--plan", help="a plan JSON from `pipetrain plan --out`: its stages, replicas, schedule and "
                     "microbatches (default: none)")
    how.add_argument("--replicas", type=_int_list, help="replicas per stage, e.g. 2,1 (default: 1 each)")
    how.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved; default 1)")
    how.add_argument("--policy", help="weight-version policy replacing the schedule's: stash, vsync, latest, "
                     "predict (default: the schedule's own; predict with --compensation lwp)")
    how.add_argument("--microbatches", type=int, help="microbatches per update (default 4; 1 for pipedream and pb)")
    train = parser.add_argument_group("training")
    train.add_argument("--batch-size", type=int, default=32, help="samples per optimizer update (default 32)")
    train.add_argument("--steps", type=int, help="optimizer updates (default: those of --epochs)")
    train.add_argument("--epochs", type=float, help="passes over the training data (default 1 when --steps is absent)")
    train.add_argument("--optimizer", default="sgd:lr=0.02,momentum=0.9",
                       help="sgd:lr=..,momentum=..,nesterov=..,weight_decay=.., adam:lr=..,betas=../.. or adamw:... "
                            "(default sgd:lr=0.02,momentum=0.9)")
    train.add_argument("--lr-schedule", help="constant, step:milestones=a/b,gamma=.., cosine:total=.., "
                       "end:total=..,fraction=.., counted in samples (default: constant)")
    train.add_argument("--compensation", default="none",
                       help="none, sc, lwp, dlr (delay-scaled lr; dlrN: reference delay N), dts (delay time scaling: "
                            "lr and momentum; dtsN), dtsf (dts that follows --lr-schedule; dtsfN), dtt (dts at SGD's temperature "
                            "lr/(1-m); dttN) or a combination such as "
                            "sc+lwp+dlr16 or sc+lwp+dts4, delays "
                            "from the schedule (default none)")
    train.add_argument("--translate-from-batch", type=int, metavar="B",
                       help="treat --optimizer's lr and momentum as tuned for batch B and translate them to --batch-size "
                            "(default: no translation)")
    train.add_argument("--seed", type=int, default=0,
                       help="seed of the model's initial weights, the data order and dropout (default 0)")
    train.add_argument("--no-shuffle", action="store_true", help="update t consumes samples tB..(t+1)B-1 in order")
    train.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                       help="parameters and floating-point inputs (default float32)")
    train.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="where the stages compute: cuda (each worker on GPU LOCAL_RANK, the emulator on one GPU), "
                            "cpu, or auto: CUDA when available (default auto)")
    train.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"],
                       help="bf16 or fp16: each stage's forward under torch.autocast (also on CPU), float32 master "
                            "weights and optimizer state; fp16 with a loss scale every stage agrees on "
                            "(docs/gpu.md) (default fp32)")
    train.add_argument("--loss-scale", default="dynamic", metavar="dynamic|FLOAT",
                       help="--precision fp16: dynamic (halve on overflow, double after --loss-scale-growth clean "
                            "updates) or a fixed power of two (default dynamic)")
    train.add_argument("--loss-scale-init", type=float, default=65536.0, metavar="FLOAT",
                       help="--precision fp16, dynamic scale: the first scale, a power of two (default 65536)")
    train.add_argument("--loss-scale-growth", type=int, default=2000, metavar="N",
                       help="--precision fp16, dynamic scale: clean updates after which the scale doubles "
                            "(default 2000)")
    train.add_argument("--recompute", metavar="none|stage|stage:LIST",
                       help="stage: keep only each stage's inputs between a forward and its backward and run the "
                            "forward again in the backward, on the same weight version and random numbers "
                            "(less activation memory, about one more forward; same results); stage:0,2: on "
                            "those stages only (default: the --plan's choice, else none)")
    train.add_argument("--on-nonfinite", default="stop", choices=["stop", "skip"],
                       help="a NaN or infinite loss or gradient: stop the run naming the step and stage (default "
                            "stop), or skip each update whose gradient is not finite (see docs/optim.md)")
    train.add_argument("--eval-every", type=int, default=0,
                       help="evaluate on held-out data every K updates and at the end, printing each result "
                            "(default 0: at the end only)")
    train.add_argument("--eval-samples", type=int, help="evaluate on the first N held-out samples only (default: all)")
    run_group = parser.add_argument_group("execution")
    run_group.add_argument("--executor", default="distributed", choices=["distributed", "emulate"],
                           help="distributed (one process per stage replica) or emulate (one process) (default distributed)")
    run_group.add_argument("--workers", type=int, help="worker processes (default: one per stage replica)")
    run_group.add_argument("--threads-per-worker", type=int, default=1,
                           help="PyTorch threads of each worker process, and of the emulator (default 1)")
    run_group.add_argument("--receives", default="auto", choices=["auto", "on-demand", "ahead"],
                           help="distributed: post each receive when it is reached (on-demand), keep every channel's "
                                "next receive posted (ahead), or on-demand where provably deadlock-free (auto) (default auto)")
    run_group.add_argument("--timeout", type=float, default=60.0,
                           help="seconds any blocking wait may take, joining the run included (default 60)")
    run_group.add_argument("--max-restarts", type=int, default=0, metavar="N",
                           help="start the workers again after a failure that is not a user error, up to N times; "
                                "they resume from --checkpoint-dir (under torchrun use torchrun's own "
                                "--max-restarts) (default 0)")
    out = parser.add_argument_group("outputs")
    out.add_argument("--save", help="write the trained weights under the unsplit model's names: into a directory "
                     "(a path without a .pt/.pth/.bin/.ckpt suffix) as safetensors shards, each worker its own "
                     "stages, with HuggingFace's index (from_pretrained reads it; pipetrain.load_weights too); or "
                     "into one torch.save file, gathered on rank 0 (default: not saved)")
    out.add_argument("--report-json", help="write a JSON report: samples_per_s, final_loss, steps, ... "
                     "(default: none)")
    out.add_argument("--trace", help="write the measured per-action timeline as a Chrome/Perfetto trace "
                     "(default: none)")
    out.add_argument("--plot", help="draw the measured timeline next to the simulated one, PNG (default: none)")
    out.add_argument("--checkpoint-dir", help="checkpoint the run into this directory, and resume from its newest "
                     "complete checkpoint when it holds one (else start afresh, saying which): one command line "
                     "for the first start and every restart (default: no checkpoints)")
    out.add_argument("--checkpoint-every", type=int, default=0,
                     help="with --checkpoint-dir, checkpoint after every K updates, and after the last (default 0: "
                          "about ten checkpoints per run, every ceil(steps / 10) updates)")
    out.add_argument("--keep", type=int, default=2, metavar="K",
                     help="complete checkpoints kept in --checkpoint-dir, the newest (default 2)")
    out.add_argument("--resume", nargs="?", const=True, default=False, metavar="CHECKPOINT",
                     help="continue from the newest complete checkpoint in --checkpoint-dir, an error if there is "
                          "none, or from the named step directory, refused if it is incomplete or damaged "
                          "(default: --checkpoint-dir's newest if any, else start afresh)")
    out.add_argument("--extend", action="store_true",
                     help="continue a finished (or interrupted) asynchronous run for more updates (a longer --steps "
                          "or --epochs): its pipeline drains where it ended and fills again, so the result is the "
                          "run extended, not the uninterrupted longer run (the data line says so)")
    out.add_argument("--no-progress", action="store_true",
                     help="no progress bar (it is shown only when stderr is a terminal)")
    out.add_argument("--quiet", action="store_true",
                     help="print only the final line: not the chosen stages, nor --eval-every's results as they come")


def config_from_args(args: argparse.Namespace):
    from pipetrain.training import TrainConfig

    optimizer = args.optimizer
    if args.translate_from_batch:
        optimizer = _translated(optimizer, args.translate_from_batch, args.batch_size)
    return TrainConfig(
        model=args.model, data=args.data, test_data=args.test_data, holdout=args.holdout,
        data_workers=args.data_workers, pin_memory=args.pin_memory, schedule=args.schedule, stages=args.stages,
        balance=args.balance, split_at=args.split_at, plan=args.plan, balance_by=args.balance_by,
        leaf_modules=args.leaf_modules, concrete_args=args.concrete_args, replicas=args.replicas, chunks=args.chunks,
        policy=args.policy, microbatches=args.microbatches, batch_size=args.batch_size, steps=args.steps,
        epochs=args.epochs, optimizer=optimizer, lr_schedule=args.lr_schedule, compensation=args.compensation,
        executor=args.executor, workers=args.workers, threads_per_worker=args.threads_per_worker,
        receives=args.receives, timeout=args.timeout, seed=args.seed, shuffle=not args.no_shuffle, dtype=args.dtype,
        on_nonfinite=args.on_nonfinite, precision=args.precision, recompute=args.recompute,
        loss_scale=args.loss_scale, loss_scale_init=args.loss_scale_init, loss_scale_growth=args.loss_scale_growth,
        device=args.device, meta=_meta(args), init=args.init_from or ("reset" if _meta(args) else None),
        eval_every=args.eval_every, eval_samples=args.eval_samples, save=args.save, report_json=args.report_json,
        trace=args.trace, plot=args.plot,
        checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every, resume=args.resume,
        keep=args.keep, max_restarts=args.max_restarts, extend=args.extend,
        progress=not args.no_progress and not args.quiet and sys.stderr.isatty(), quiet=args.quiet,
    )


def _meta(args: argparse.Namespace) -> bool:
    """Whether the model is built on the meta device: ``--init meta``, or ``--init-from`` without ``--init eager``."""
    return args.init == "meta" or (args.init is None and args.init_from is not None)


def _translated(spec_text: str, reference_batch: int, batch_size: int) -> str:
    """Rewrite an SGD spec tuned at ``reference_batch`` for ``batch_size`` (docs/design.md 3.5)."""
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
    from pipetrain.training.validate import check_config

    config = config_from_args(args)
    check_config(config)  # choices, specs, plan and output paths, before PyTorch is imported
    from pipetrain.training.train import train

    result = train(config)
    if result is None or not result.is_main:  # a worker process of the distributed runtime: rank 0 reports
        _finish_if_worker()
        return 0
    line = (
        f"{result.schedule}: {result.updates} steps on {result.workers} "
        f"{'workers' if result.executor == 'distributed' else 'emulated ranks'}, "
        f"{result.samples_per_s:.0f} samples/s, final loss {result.final_loss:.4f}"
    )
    if result.evaluations:
        final = result.evaluations[-1]
        line += f", test loss {final['loss']:.4f}, test accuracy {100 * final['accuracy']:.2f} %"
    print(line)
    scale = result.extra.get("loss_scale")
    if scale is not None:
        skips = scale["per_stage"][0]["skipped"] if scale["per_stage"] else []
        print(f"fp16 loss scale: {scale['final']:g} at the end; updates skipped on overflow: "
              + (_ranges(skips) if skips else "none")
              + ("" if scale["stages_agree"] else " on stage 0 (" + "; ".join(
                  f"stage {s}: {_ranges(p['skipped']) if p['skipped'] else 'none'}" for s, p in enumerate(scale["per_stage"])) + ")"))
    skipped = result.extra.get("skipped_updates") or []
    if any(skipped):
        print("skipped updates whose gradient was not finite (--on-nonfinite skip): "
              + "; ".join(f"stage {stage}: {_ranges(steps)}" for stage, steps in enumerate(skipped) if steps))
    for flag, path in (("model", config.save), ("report", config.report_json), ("trace", config.trace),
                       ("plot", config.plot)):
        if path:
            print(f"wrote {flag}: {path}")
    _finish_if_worker()
    return 0


def _ranges(steps: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"steps 3-5, 9"``."""
    parts: list[list[int]] = []
    for step in steps:
        if parts and step == parts[-1][1] + 1:
            parts[-1][1] = step
        else:
            parts.append([step, step])
    return "step" + ("s " if len(steps) > 1 else " ") + ", ".join(
        str(a) if a == b else f"{a}-{b}" for a, b in parts)


def _finish_if_worker() -> None:
    """A worker started by torchrun leaves the process group and exits here (see
    :func:`pipetrain.runtime.launch.finish_worker`)."""
    if config_is_worker():
        from pipetrain.runtime.launch import finish_worker

        finish_worker()


def config_is_worker() -> bool:
    import os

    return "TORCHELASTIC_RUN_ID" in os.environ
