"""`pipetrain profile`: measure a model layer by layer for the planner.

Examples::

    pipetrain profile --model mlp:depth=8,width=1024 --data digits --batch-size 64 --out mlp.json
    pipetrain plan mlp.json --workers 4
"""

from __future__ import annotations

import argparse
import json

from pipetrain.commands._text import aligned
from pipetrain.errors import ConfigError

__all__ = ["add_arguments", "run", "HELP"]

# Imports inside functions are deliberate here: PyTorch and the library load when the command runs, so
# that `pipetrain --help` and the checks of options and output paths answer without them.

HELP = "measure per-layer times and sizes of a model (input to pipetrain plan)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="mlp",
                        help="built-in name (mlp, resmlp, resnet-gn, ...) or PKG.MOD:FACTORY (default mlp)")
    parser.add_argument("--data", default="digits",
                        help="digits, synthetic:features=N,classes=C,samples=K, or PKG.MOD:FACTORY (default digits)")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per minibatch (default 32)")
    parser.add_argument("--out", default=None, metavar="PROFILE.json",
                        help="write the profile, pipetrain's JSON profile format (default: print only)")
    parser.add_argument("--iterations", type=int, default=10,
                        help="measured iterations (default 10)")
    parser.add_argument("--statistic", default="median", choices=["median", "mean"],
                        help="how each layer's times over the iterations are summarised "
                             "(default median: robust on a shared machine)")
    parser.add_argument("--warmup", type=int, default=3, help="iterations before measuring (default 3)")
    parser.add_argument("--optimizer-states", type=float, default=1.0,
                        help="optimizer state per parameter, in parameter sizes (0 SGD, "
                             "1 momentum, 2 Adam; default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model's weights (default 0)")
    parser.add_argument("--init", choices=["eager", "meta"],
                        help="meta: build the model on the meta device and profile it by pipeline unit, each "
                             "materialised alone (reset_parameters() under --seed, or --init-from), never whole "
                             "(default: eager, unless --init-from is given)")
    parser.add_argument("--init-from", metavar="DIR", help="the weights of a meta-built model (a --save DIR) "
                        "(default: none: a meta-built model's units start from reset_parameters() under --seed)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads while measuring (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    parser.add_argument("--calibrate", default=None, metavar="FILE",
                        help="also measure this machine's message and per-action costs (pipetrain calibrate, "
                             "about 10 s) into FILE, for pipetrain plan --costs-file (default: not measured)")
    parser.add_argument("--json", action="store_true", help="print the profile as one JSON object")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from pipetrain.paths import JSON, check_outputs

    check_outputs(files={"--out": args.out, "--calibrate": args.calibrate},
                  formats={"--out": JSON, "--calibrate": JSON})  # before PyTorch and the measurement
    import torch

    from pipetrain.data import dataset_info, get_batch, load_dataset
    from pipetrain.initialiser import init_from_flags
    from pipetrain.models import build_model
    from pipetrain.plan.profile_files import save_profile
    from pipetrain.plan.profiler import profile_model

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {args.threads}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {args.device}: CUDA is not available here; use --device cpu")
    torch.set_num_threads(args.threads)
    dataset = load_dataset(args.data)
    info = dataset_info(dataset)
    init = init_from_flags(args.init, args.init_from)  # as `pipetrain train` reads them
    meta = init is not None and init.on_meta
    model = build_model(args.model, input_shape=info.input_shape, num_classes=info.num_classes,
                        seed=args.seed, meta=meta)
    count = len(dataset)
    indices = [i % count for i in range(args.batch_size)]
    batch = get_batch(dataset, indices)
    described = {"model_spec": args.model, "data_spec": args.data, "seed": args.seed}
    if meta:
        from pipetrain.models.loss import loss_for
        from pipetrain.plan.profiler import profile_by_unit
        from pipetrain.stages.materialize import opened

        if args.device != "cpu":
            raise ConfigError("--init meta profiles on the CPU (each unit materialised there): drop --device")
        profile = profile_by_unit(model, batch, loss_for(model), init=opened(init),
                                  seed=args.seed, iterations=args.iterations, warmup=args.warmup,
                                  optimizer_states=args.optimizer_states, statistic=args.statistic, meta=described)
    else:
        profile = profile_model(model, batch, iterations=args.iterations, warmup=args.warmup,
                                optimizer_states=args.optimizer_states, device=args.device,
                                progress=not (args.no_progress or args.json),
                                statistic=args.statistic, meta=described)
    if args.out:
        save_profile(profile, args.out)
    if args.calibrate:
        from pipetrain.training.calibration import calibrate
        from pipetrain.training.result import write_json_atomic

        write_json_atomic(args.calibrate, calibrate("cuda" if args.device.startswith("cuda") else "cpu")[0])
    if args.json:
        print(json.dumps(profile.to_json()))
        return 0
    print(format_profile(profile))
    for path, what in ((args.out, "profile"), (args.calibrate, "calibration")):
        if path:
            print(f"wrote {what} to {path}")
    return 0


def format_profile(profile) -> str:
    rows = [("layer", "kind", "fwd ms", "bwd ms", "activation B", "params B")]
    for layer in profile.layers:
        kind = layer.kind if len(layer.kind) <= 40 else layer.kind[:37] + "..."
        rows.append((layer.name, kind, f"{layer.forward_s * 1e3:.4f}",
                     f"{layer.backward_s * 1e3:.4f}", f"{layer.activation_bytes:.0f}",
                     f"{layer.parameter_bytes:.0f}"))
    lines = aligned(rows)
    meta = profile.meta
    lines.append(f"{len(profile.layers)} layers, {len(profile.edge_list())} edges, batch "
                 f"{profile.batch_size}, forward+backward {profile.total_compute_s * 1e3:.3f} ms "
                 f"per minibatch ({meta.get('statistic', 'mean')} of {meta.get('iterations')} iterations after "
                 f"{meta.get('warmup')} warm-up, {meta.get('device')}, "
                 f"{meta.get('threads')} thread(s))")
    return "\n".join(lines)
