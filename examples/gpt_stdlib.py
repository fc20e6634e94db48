"""Train a character-level GPT on Python's own standard library, cut into pipeline stages.

The model is an ordinary nn.Module (pipetrain.models.GPT); split_model traces it with torch.fx and
cuts it into stages that hand on whatever later stages need. This script runs the stages one
after the other in one process (the same arithmetic as the unsplit model, bit for bit), trains with
Adam, reports validation loss in bits per character, and prints a sample::

    PYTHONPATH=src python examples/gpt_stdlib.py                    # 3 stages, 500 updates
    PYTHONPATH=src python examples/gpt_stdlib.py --stages 4 --steps 200 --min-length 16

The factory below is also how you would hand your own model to the command line::

    pipetrain train --model examples.gpt_stdlib:make_model:n_layer=4 --data text:block_size=64 --stages 3
    pipetrain train --model gpt:n_layer=4,n_embd=128 --data text:block_size=64,min_length=16 --stages 3
"""

from __future__ import annotations

import argparse
import time

import torch

from pipetrain.data import BatchSampler, get_batch, load_train_test
from pipetrain.models import GPT, cross_entropy, evaluate, generate
from pipetrain.stages import split_model


def make_model(input_shape, num_classes, n_layer=4, n_head=4, n_embd=64, dropout=0.0):
    """A factory as `--model PKG.MOD:FACTORY` calls it: sizes from the data, options from the spec."""
    return GPT(vocab_size=num_classes, block_size=input_shape[0], n_layer=n_layer, n_head=n_head,
               n_embd=n_embd, dropout=dropout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--min-length", type=int, default=None, help="variable-length batches")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    train, test = load_train_test(f"text:block_size={args.block_size}"
                                  + (f",min_length={args.min_length}" if args.min_length else ""))
    print(f"data: {train}; {test}")
    torch.manual_seed(args.seed)
    model = make_model((args.block_size,), train.num_classes, n_layer=args.layers, n_embd=args.embd)
    staged = split_model(model, stages=args.stages)
    print(f"split at {', '.join(staged.split_at)}:\n{staged.summary()}")

    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: min(1.0, (t + 1) / 50))
    sampler = BatchSampler(train, args.batch_size, seed=args.seed)
    start = time.perf_counter()
    for step in range(args.steps):
        x, y = get_batch(train, sampler.indices(step))
        loss = cross_entropy(staged(x), y)  # staged(x) runs the stages in sequence
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  length {x.shape[1]:3d}  loss {loss.item():.3f}  "
                  f"({time.perf_counter() - start:.0f} s)")
    result = evaluate(staged, torch.utils.data.Subset(test, range(min(len(test), 1024))), batch_size=128)
    print(f"validation: loss {result['loss']:.3f}, {result['bits_per_target']:.2f} bits/char, "
          f"next-char accuracy {result['accuracy']:.1%}")
    print("sample:\n" + "def " + generate(staged, train.vocab, "def ", 300, seed=0, block_size=args.block_size,
                                          temperature=0.8))


if __name__ == "__main__":
    main()
