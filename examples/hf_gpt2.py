"""Train a HuggingFace GPT-2 (random weights from a config) as a 2-stage pipeline, then load the
trained weights back into ``GPT2LMHeadModel`` and sample from it.

``pipetrain.models.hf:gpt2`` builds ``GPT2LMHeadModel(GPT2Config(...))`` sized by the data and
declares its pipeline units (embeddings, each block, the final norm with the LM head), which hold
the HF model's own modules: ``--stages 2`` cuts between blocks (balancing the measured time of each
unit), the LM head tied to the token embedding trains as one weight (the first and last stage sum
its gradient), and the saved state dict has the HF model's keys::

    python examples/hf_gpt2.py                            # 1f1b, 300 updates, outputs in out/hf_gpt2
    python examples/hf_gpt2.py --schedule gpipe --steps 100 --out /tmp/hf

The same run as one command:

    pipetrain train --model pipetrain.models.hf:gpt2:n_layer=4,n_embd=64,n_head=4 \\
        --data text:block_size=64 --stages 2 --schedule 1f1b --batch-size 16 --microbatches 4 \\
        --optimizer adam:lr=0.002 --steps 300 --eval-every 50 --eval-samples 512 --save out/gpt2.pt

Needs ``pip install transformers``.
"""

from __future__ import annotations

import argparse
import os

import torch

from pipetrain.data import load_train_test
from pipetrain.models import build_model, generate
from pipetrain.training import TrainConfig
from pipetrain.training.curves import plot_loss_curves
from pipetrain.training.result import write_json_atomic
from pipetrain.training.train import train

MODEL = "pipetrain.models.hf:gpt2:n_layer=4,n_embd=64,n_head=4"
DATA = "text:block_size=64"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", help="a synchronous schedule (the LM head is tied)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="out/hf_gpt2", help="folder for the weights, report and plot")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    weights = os.path.join(args.out, "gpt2.pt")
    result = train(TrainConfig(
        model=MODEL, data=DATA, stages=2, schedule=args.schedule, batch_size=16, microbatches=4,
        optimizer="adam:lr=0.002", steps=args.steps, eval_every=max(args.steps // 6, 1), eval_samples=512,
        executor="distributed", save=weights, progress=True,
    ))
    for evaluation in result.evaluations:
        print(f"after {evaluation['step']:4d} updates: validation loss {evaluation['loss']:.4f} nats/char, "
              f"accuracy {100 * evaluation['accuracy']:.1f} %")
    print(f"{result.samples_per_s:.0f} sequences/s on {result.workers} worker processes")

    from transformers import GPT2LMHeadModel  # the HF class itself takes the trained weights

    train_set, _ = load_train_test(DATA)
    config = build_model(MODEL, input_shape=(64,), num_classes=train_set.num_classes).config
    model = GPT2LMHeadModel(config)
    model.load_state_dict(torch.load(weights), strict=True)
    model.eval()
    print("sample (prompt 'def ', temperature 0.8):")
    text = generate(lambda ids: model(input_ids=ids).logits, train_set.vocab, prompt="def ", length=200, seed=0,
                    temperature=0.8, block_size=64)
    print("def " + text)
    report = os.path.join(args.out, "report.json")
    write_json_atomic(report, result.report())
    plot = os.path.join(args.out, "loss.png")
    plot_loss_curves({args.schedule: result.report()}, plot, f"HF GPT-2 ({MODEL.split(':', 2)[2]}) on {DATA}")
    print(f"wrote {weights}, {report} and {plot}")


if __name__ == "__main__":
    main()
