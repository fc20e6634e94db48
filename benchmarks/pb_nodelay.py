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
from pipetrain.optim import build_stage_optimizers
from pipetrain.optim.lr_schedule import EndDecayLR
from pipetrain.pb.methods import parse_method
from pipetrain.pb.study import StudyConfig, _evaluate, _index_stream, _Trainer
from pipetrain.schedule import pb_delays
from pipetrain.stages import split_model


def run(args, kind: str, seed: int, lr_scale: float) -> dict:
    """One run: stage s trains at the (lr, momentum) of its optimizer under compensation ``kind``
    (none, dtsN, dttN, dlrN, as ``pipetrain train --compensation``) at delay D_s, on fresh gradients."""
    config = StudyConfig(model=args.model, data=args.data, methods=(parse_method("sgd"),), epochs=args.epochs,
                         reference_batch=args.reference_batch, lr=args.lr, momentum=args.momentum)
    trainer = _Trainer(config, None)  # the study's data and translated hyper-parameters
    x, y = trainer.x, trainer.y
    lr, momentum = trainer.translated.lr * lr_scale, trainer.translated.momentum
    model = build_model(args.model, input_shape=trainer.info.input_shape, num_classes=trainer.info.num_classes,
                        seed=seed)
    staged = split_model(model, stages=args.stages)
    optimizers = build_stage_optimizers(f"sgd:lr={lr!r},momentum={momentum!r}", pb_delays(args.stages),
                                        compensation=kind)
    groups = [{"params": list(stage.parameters()), "lr": o.lr, "momentum": o.momentum, "base": o.lr}
              for stage, o in zip(staged.stages, optimizers)]
    opt = torch.optim.SGD(groups, lr=lr)
    updates = trainer.updates(1)
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
    test_loss, test_acc = _evaluate(model, trainer.x_test, trainer.y_test)
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
