"""Train a GroupNorm ResNet with skip connections on digits, cut so that the skips cross stages.

`resnet-gn-skip` is an ordinary nn.Module: the stem's features skip past every residual layer to
the head, and the blocks have their own shortcuts. Split points inside a block (layer2.0.conv2)
make the block's shortcut cross a boundary too; `StagedModel.boundaries` lists what each stage
hands on. The stages run in sequence in one process, trained with SGD and momentum::

    PYTHONPATH=src python examples/resnet_skip_digits.py
    PYTHONPATH=src python examples/resnet_skip_digits.py --split-at layer1.1 --epochs 5

As a command (once `pipetrain train` runs these models)::

    pipetrain train --model resnet-gn-skip --data digits --split-at layer1.1,layer2.0.conv2 --epochs 10
"""

from __future__ import annotations

import argparse

import torch

from pipetrain.data import BatchSampler, get_batch, load_train_test
from pipetrain.models import build_model, cross_entropy, evaluate
from pipetrain.stages import split_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split-at", default="layer1.1,layer2.0.conv2")
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    train, test = load_train_test("digits")
    model = build_model("resnet-gn-skip", input_shape=(64,), num_classes=10, seed=args.seed)
    staged = split_model(model, split_at=args.split_at.split(","))
    print(staged.summary())
    for b, names in enumerate(staged.boundaries):
        print(f"stage {b} -> {b + 1}: {', '.join(names)}")

    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    sampler = BatchSampler(train, args.batch_size, seed=args.seed)
    steps = sampler.steps_for_epochs(args.epochs)
    for step in range(steps):
        x, y = get_batch(train, sampler.indices(step))
        loss = cross_entropy(staged(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % round(sampler.steps_per_epoch) == 0 or step == steps - 1:
            result = evaluate(staged, test)
            print(f"update {step + 1:4d}  train loss {loss.item():.3f}  test loss {result['loss']:.3f}  "
                  f"test accuracy {result['accuracy']:.1%}")


if __name__ == "__main__":
    main()
