"""Train a GroupNorm ResNet with skip connections on digits, cut so that the skips cross stages.

`resnet-gn-skip` is an ordinary nn.Module, not a Sequential: the stem's features skip past every
residual layer to the head, and the blocks have their own shortcuts. `--split-at` names modules
that start a stage; torch.fx traces the model and every stage hands on what later stages need, so
the skips travel through the pipeline in both directions. Training runs on 3 worker processes
under 1F1B::

    python examples/resnet_skip_digits.py
    python examples/resnet_skip_digits.py --split-at layer1.1 --schedule pipedream

It prints the stages (parameters, first module, the values each receives), the test loss and
accuracy every 90 updates, and writes its loss curves to out/resnet_skip_digits.png (``--plot``
elsewhere; README's picture was drawn with ``--plot docs/images/resnet_skip_digits.png``).

The same run as one command:

    pipetrain train --model resnet-gn-skip --data digits --split-at layer1.1,layer2.0.conv2 \\
        --schedule 1f1b --microbatches 4 --epochs 10 --eval-every 90
"""

from __future__ import annotations

import argparse

from pipetrain.paths import IMAGE, check_outputs
from pipetrain.training import TrainConfig
from pipetrain.training.curves import plot_loss_curves
from pipetrain.training.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split-at", default="layer1.1,layer2.0.conv2")
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--plot", default="out/resnet_skip_digits.png")
    args = parser.parse_args()
    check_outputs(files={"--plot": args.plot}, formats={"--plot": IMAGE})  # before training, not after
    split_at = args.split_at.split(",")
    result = train(TrainConfig(
        model="resnet-gn-skip", data="digits", split_at=split_at, schedule=args.schedule,
        microbatches=4 if args.schedule != "pipedream" else None, epochs=args.epochs, batch_size=32,
        optimizer="sgd:lr=0.05,momentum=0.9", eval_every=90, executor="distributed",
        progress=True,
    ))
    print(f"{result.samples_per_s:.0f} samples/s on {result.workers} worker processes")
    plot_loss_curves({args.schedule: result.report()}, args.plot,
                     f"resnet-gn-skip on digits, split at {args.split_at}, {args.schedule}")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
