"""Train a character-level GPT on Python's own standard library with 2 worker processes.

`gpt` is an ordinary nn.Module (token and position embeddings, causal self-attention blocks,
LayerNorm, a head); `--stages 2` traces it with torch.fx and cuts it between blocks. Batches have
variable sequence length (`min_length`): the runtime passes whatever shapes arrive, no fixed-shape
declaration. After training, a sample is generated from the saved weights::

    python examples/gpt_stdlib.py                          # pipedream, 600 updates
    python examples/gpt_stdlib.py --schedule 1f1b --steps 300

The weights go to out/gpt_stdlib/gpt.pt and the loss curves to out/gpt_stdlib.png (``--out``,
``--plot``).

The same run as one command:

    pipetrain train --model gpt:n_layer=4,n_embd=64,n_head=4 --data text:block_size=64,min_length=16 \\
        --stages 2 --schedule pipedream --batch-size 16 --optimizer adam:lr=0.002 --steps 600 \\
        --eval-every 100 --eval-samples 512 --save gpt.pt

A factory of your own works the same way: `--model examples.gpt_stdlib:make_model:n_layer=4`.
"""

from __future__ import annotations

import argparse
import os

import torch

from pipetrain.data import load_train_test
from pipetrain.models import GPT, build_model, generate
from pipetrain.paths import IMAGE, check_outputs
from pipetrain.training import TrainConfig
from pipetrain.training.curves import plot_loss_curves
from pipetrain.training.train import train

MODEL = "gpt:n_layer=4,n_embd=64,n_head=4"
DATA = "text:block_size=64,min_length=16"


def make_model(input_shape, num_classes, n_layer=4, n_head=4, n_embd=64, dropout=0.0):
    """A factory as `--model PKG.MOD:FACTORY` calls it: sizes from the data, options from the spec."""
    return GPT(vocab_size=num_classes, block_size=input_shape[0], n_layer=n_layer, n_head=n_head,
               n_embd=n_embd, dropout=dropout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="pipedream")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="out/gpt_stdlib", help="folder of the trained weights")
    parser.add_argument("--plot", default="out/gpt_stdlib.png")
    args = parser.parse_args()
    weights = os.path.join(args.out, "gpt.pt")
    check_outputs(files={"--out": weights, "--plot": args.plot}, formats={"--plot": IMAGE})  # before training, not after
    result = train(TrainConfig(
        model=MODEL, data=DATA, stages=2, schedule=args.schedule, batch_size=16,
        microbatches=4 if args.schedule != "pipedream" else None, optimizer="adam:lr=0.002", steps=args.steps,
        eval_every=max(args.steps // 6, 1), eval_samples=512, executor="distributed",
        save=weights, progress=True,
    ))
    print(f"{result.samples_per_s:.0f} sequences/s on {result.workers} worker processes")
    train_set, _ = load_train_test(DATA)
    model = build_model(MODEL, input_shape=(64,), num_classes=train_set.num_classes)
    model.load_state_dict(torch.load(weights))
    model.eval()
    print("sample (prompt 'def ', temperature 0.8):")
    print("def " + generate(model, train_set.vocab, prompt="def ", length=200, seed=0, temperature=0.8))
    plot_loss_curves({args.schedule: result.report()}, args.plot, f"{MODEL} on {DATA}, {args.schedule}")
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
