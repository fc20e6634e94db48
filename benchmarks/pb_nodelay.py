"""Batch-1 SGD with a PB compensation's per-stage (lr, momentum) but no pipeline delay.

Separates what a per-stage setting such as DTS's does to training from what the delay does: each
stage s of an S-stage cut trains with the learning rate and momentum its compensation gives it at
delay ``D_s = 2(S-1-s)``, but every gradient is fresh (plain ``torch.optim.SGD``, one parameter
group per stage). ``--settings none`` is plain batch-1 SGD, the control. Same model, data order,
initial weights, translated hyper-parameters and end decay as a ``pipetrain pb`` run of that seed.

    PYTHONPATH=src python benchmarks/pb_nodelay.py --model resmlp:depth=62 --stages 64 --settings dts4,none --seeds 0,1,2 --epochs 10
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pipetrain.models import build_model
from pipetrain.optim import translate_hyperparameters
from pipetrain.optim.compensation import delay_lr_factor, temperature_settings, time_scaled_settings
from pipetrain.optim.lr_schedule import EndDecayLR
from pipetrain.pb.study import _evaluate, _index_stream, _load_data, _tensors, StudyConfig
from pipetrain.pb.methods import parse_method
from pipetrain.schedule import pb_delays
from pipetrain.stages import split_model
from pipetrain.data import dataset_info


def stage_settings(kind: str, momentum: float, delay: float) -> tuple[float, float]:
    """(lr factor, momentum) of a stage with delay ``delay`` under ``kind`` (none, dtsN, dttN, dlrN)."""
    if kind == "none":
        return 1.0, momentum
    if kind.startswith("dtt"):
        return temperature_settings(momentum, delay, float(kind[3:] or 4))
    if kind.startswith("dts"):
        return time_scaled_settings(momentum, delay, float(kind[3:] or 4))
    if kind.startswith("dlr"):
        return delay_lr_factor(delay, float(kind[3:] or 8)), momentum
    raise SystemExit(f"unknown --settings {kind!r}: none, dtsN, dttN or dlrN")


def run(args, kind: str, seed: int, lr_scale: float) -> dict:
    config = StudyConfig(model=args.model, data=args.data, methods=(parse_method("sgd"),), epochs=args.epochs)
    train_set, test_set = _load_data(config)
    info = dataset_info(train_set)
    x, y = _tensors(train_set, torch.float32)
    xt, yt = _tensors(test_set, torch.float32)
    t = translate_hyperparameters(args.reference_batch, args.lr, args.momentum, 0.0)
    lr = t.lr * lr_scale
    model = build_model(args.model, input_shape=info.input_shape, num_classes=info.num_classes, seed=seed)
    staged = split_model(model, stages=args.stages)
    delays = pb_delays(args.stages)
    groups = []
    for stage, delay in zip(staged.stages, delays):
        factor, m = stage_settings(kind, t.momentum, delay)
        groups.append({"params": list(stage.parameters()), "lr": lr * factor, "momentum": m, "base": lr * factor})
    opt = torch.optim.SGD(groups, lr=lr)
    updates = int(round(args.epochs * len(x)))
    schedule = EndDecayLR(total=updates, fraction=args.decay_fraction)
    stream = _index_stream(len(x), 1, seed, updates)[:, 0]
    start = time.perf_counter()
    for n in range(updates):
        f = schedule.factor(n)
        for g in opt.param_groups:
            g["lr"] = g["base"] * f
        i = stream[n]
        loss = torch.nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
    seconds = time.perf_counter() - start
    train_loss, train_acc = _evaluate(model, x, y)
    test_loss, test_acc = _evaluate(model, xt, yt)
    return {"settings": kind, "seed": seed, "lr_scale": lr_scale, "test_accuracy": test_acc,
            "final_train_loss": train_loss, "train_accuracy": train_acc, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resmlp:depth=62")
    p.add_argument("--data", default="digits")
    p.add_argument("--stages", type=int, default=64)
    p.add_argument("--settings", default="dts4,none")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lr-scale", default="1")
    p.add_argument("--epochs", type=float, default=10)
    p.add_argument("--reference-batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--decay-fraction", type=float, default=0.2)
    p.add_argument("--out", default=None, help="append one JSON line per run to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    for lr_scale in [float(v) for v in args.lr_scale.split(",")]:
        for seed in [int(v) for v in args.seeds.split(",")]:
            for kind in args.settings.split(","):
                row = run(args, kind, seed, lr_scale)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
