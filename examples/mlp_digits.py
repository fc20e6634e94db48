"""Train the benchmarks' MLP on scikit-learn's digits with 2 worker processes, under PipeDream.

The model is the built-in `mlp` (hidden Linear+ReLU units and a head); `pipetrain train` spawns one
process per stage, runs the asynchronous PipeDream schedule (weight stashing, no flush) over
torch.distributed, evaluates through the pipeline, and draws its loss curves::

    python examples/mlp_digits.py                       # 2 stages, pipedream, 10 epochs
    python examples/mlp_digits.py --schedule 1f1b --stages 3

It prints the chosen stages, the test loss and accuracy every 90 updates, and writes its loss
curves to out/mlp_digits.png (``--plot`` elsewhere; README's picture was drawn with
``--plot docs/images/mlp_digits.png``).

The same run as one command:

    pipetrain train --model mlp:depth=2,width=128 --data digits --schedule pipedream --stages 2 \\
        --epochs 10 --optimizer sgd:lr=0.02,momentum=0.9 --eval-every 90
"""

from __future__ import annotations

import argparse

from pipetrain.paths import IMAGE, check_outputs
from pipetrain.training import TrainConfig
from pipetrain.training.curves import plot_loss_curves
from pipetrain.training.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="pipedream")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=10)
    parser.add_argument("--plot", default="out/mlp_digits.png")
    args = parser.parse_args()
    check_outputs(files={"--plot": args.plot}, formats={"--plot": IMAGE})  # before training, not after
    result = train(TrainConfig(
        model="mlp:depth=2,width=128", data="digits", schedule=args.schedule, stages=args.stages,
        epochs=args.epochs, batch_size=32, optimizer="sgd:lr=0.02,momentum=0.9", eval_every=90,
        executor="distributed", progress=True,
    ))
    print(f"{result.samples_per_s:.0f} samples/s on {result.workers} worker processes")
    plot_loss_curves({args.schedule: result.report()}, args.plot,
                     f"mlp:depth=2,width=128 on digits, {args.schedule}, {args.stages} workers")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
