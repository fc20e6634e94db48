"""A character-level GPT on the Python standard library, trained with 2 local worker processes
under PipeDream (asynchronous, weight stashing) and under 1F1B (synchronous flushes).

Runs `pipetrain train` for each schedule with the same model, data (variable-length batches),
samples per update and optimizer; collects the reports and draws the validation and training loss
against updates and against wall time; prints a sample from each trained model.

    python benchmarks/gpt_pipeline.py [--steps 600] [--out out/gpt_loss.png] [--dir out/gpt_pipeline]

Reports and weights go to ``--dir``; README's picture was drawn with ``--out docs/images/gpt_loss.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

MODEL = "gpt:n_layer=4,n_embd=64,n_head=4"
DATA = "text:block_size=64,min_length=16"
SCHEDULES = {
    "pipedream": ["--schedule", "pipedream", "--batch-size", "16"],
    "1f1b": ["--schedule", "1f1b", "--batch-size", "16", "--microbatches", "4"],
}


def command(schedule: str, steps: int, directory: str) -> list[str]:
    return [
        "pipetrain", "train", "--model", MODEL, "--data", DATA, "--stages", "2", *SCHEDULES[schedule],
        "--optimizer", "adam:lr=0.002", "--steps", str(steps), "--eval-every", str(max(steps // 6, 1)), "--eval-samples", "512",
        "--seed", "0", "--no-progress", "--report-json", os.path.join(directory, f"{schedule}.json"),
        "--save", os.path.join(directory, f"{schedule}.pt"),
    ]


def sample(state_path: str, seed: int = 0) -> str:
    import torch

    from pipetrain.data import load_train_test
    from pipetrain.models import build_model, generate

    train, _ = load_train_test(DATA)
    model = build_model(MODEL, input_shape=(64,), num_classes=train.num_classes)
    model.load_state_dict(torch.load(state_path))
    model.eval()
    return generate(model, train.vocab, prompt="def ", length=160, seed=seed, temperature=0.8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--out", default="out/gpt_loss.png", help="the loss curves (PNG)")
    parser.add_argument("--dir", default="out/gpt_pipeline", help="folder of each run's report and weights")
    args = parser.parse_args()
    directory = args.dir
    from pipetrain.paths import IMAGE, check_outputs

    check_outputs(files={"--out": args.out}, directories={"--dir": directory}, formats={"--out": IMAGE})  # before the runs
    reports = {}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    for schedule in SCHEDULES:
        argv = command(schedule, args.steps, directory)
        print("$ " + " ".join(argv), flush=True)
        done = subprocess.run([sys.executable, "-m", "pipetrain.cli", *argv[1:]], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(done.stderr)
        print(done.stdout.strip())
        with open(os.path.join(directory, f"{schedule}.json")) as handle:
            reports[schedule] = json.load(handle)
    from pipetrain.training.curves import plot_loss_curves

    plot_loss_curves(reports, args.out, f"{MODEL} on {DATA}, 2 worker processes")
    print()
    print(f"{'schedule':<10} {'samples/s':>10} {'final train loss':>17} {'validation loss':>16} {'accuracy':>9} {'seconds':>8}")
    for name, report in reports.items():
        final = report["evaluations"][-1]
        print(f"{name:<10} {report['samples_per_s']:>10.0f} {report['final_loss']:>17.4f} {final['loss']:>16.4f} "
              f"{100 * final['accuracy']:>8.2f}% {report['seconds']:>8.1f}")
    for name in reports:
        print(f"\nsample from the {name} model (prompt 'def ', temperature 0.8):")
        print("def " + sample(os.path.join(directory, f"{name}.pt")))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
