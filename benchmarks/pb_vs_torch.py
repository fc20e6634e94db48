"""The PB study's ``sgd-batch`` (the batched engine, S = 1) against a plain PyTorch loop.

Same model and seed, same batches in the same order (``BatchSampler``), same learning-rate
decay (``EndDecayLR`` over the samples): the two must agree (to rounding in float32; to about
1e-13 in float64, where the arithmetic differs only in order). Prints both accuracies, the
largest relative weight difference, and, at initialisation, how much of the pooled features'
variance (the head's input) lies across samples: near 0 the head sees the same input for every
sample, and training starts from a plateau.

    PYTHONPATH=src python benchmarks/pb_vs_torch.py --model resnet-gn --epochs 1
    PYTHONPATH=src python benchmarks/pb_vs_torch.py --model resnet-gn --epochs 5 --dtype float64
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from pipetrain.models import build_model
from pipetrain.optim import EndDecayLR
from pipetrain.pb.engine import BatchedPB
from pipetrain.pb.methods import parse_method
from pipetrain.pb.study import RunSpec, StudyConfig, _evaluate, _index_stream, _Trainer


def pooled_share(model: nn.Sequential, x: torch.Tensor) -> float:
    """Share of the head input's variance (all samples and features) that lies across samples."""
    with torch.no_grad():
        h = model[:-1](x)
        h = model[-1][:2](h) if isinstance(model[-1], nn.Sequential) else h.flatten(1)
        return float(h.var(0).sum() / (h - h.mean()).pow(2).sum(1).mean())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet-gn")
    parser.add_argument("--data", default="digits")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    method = parse_method("sgd-batch")
    config = StudyConfig(model=args.model, data=args.data, stages=(), methods=(method,), seeds=(args.seed,),
                         epochs=args.epochs, reference_batch=args.batch, lr=args.lr, momentum=args.momentum,
                         dtype=args.dtype)
    trainer = _Trainer(config, None)
    updates = trainer.updates(args.batch)
    stream = _index_stream(trainer.n, args.batch, args.seed, updates)
    engine_model, staged, optimizers = trainer._build(RunSpec(method, None, 1.0, None, args.seed))
    share = pooled_share(engine_model, trainer.x[:512])
    engine = BatchedPB([staged.stages], [optimizers], sample_shape=trainer.info.input_shape,
                       batch_size=args.batch, dtype=trainer.dtype)
    engine.train(trainer.x, trainer.y, stream.unsqueeze(1))
    engine.write_back()

    model = build_model(args.model, input_shape=trainer.info.input_shape, num_classes=trainer.info.num_classes,
                        seed=args.seed).to(trainer.dtype)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    schedule = EndDecayLR(total=updates * args.batch, fraction=config.decay_fraction)
    for n in range(updates):
        for group in opt.param_groups:
            group["lr"] = args.lr * schedule.factor(n * args.batch)
        idx = stream[n]
        loss = nn.functional.cross_entropy(model(trainer.x[idx]), trainer.y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()

    print(f"{args.model} on {args.data}, batch {args.batch}, lr {args.lr}, momentum {args.momentum}, "
          f"{args.epochs:g} epoch(s) ({updates} updates), seed {args.seed}, {args.dtype}")
    print(f"at initialisation: {100 * share:.1f} % of the pooled features' variance lies across samples")
    for name, m in (("engine sgd-batch", engine_model), ("plain PyTorch", model)):
        _, accuracy = _evaluate(m, trainer.x_test, trainer.y_test)
        train_loss, _ = _evaluate(m, trainer.x, trainer.y)
        print(f"{name:<17} test accuracy {100 * accuracy:5.1f} %, final training loss {train_loss:.4f}")
    difference = max(float((a - b).abs().max() / (b.abs().max() + 1e-30))
                     for a, b in zip(engine_model.state_dict().values(), model.state_dict().values()))
    print(f"largest relative weight difference, engine against PyTorch: {difference:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
