"""Gaps of a PB study's methods to batch-1 SGD, paired by seed, and the seed spread (the noise).

Reads a study's ``results.json`` (``pipetrain pb --out DIR`` writes it) and prints, for every
method, stage count and lr scale, the accuracy gap to the batch-1 SGD run of the same seed and lr
scale (mean ± std over the seeds: the pairing removes what the seed's initial weights and data
order do to both), the median of the paired final-training-loss ratios, and how many seeds are
within 0.5 points and 1.5x; a mean gap within about two standard errors (std / sqrt(seeds)) of
0 is noise. Diverged runs count with an infinite loss (and 0 % where
their weights are not finite). Then the noise: the
standard deviation over seeds of SGD's and SGD-batch's accuracy, and the spread a mean gap of k
seeds has if methods did not differ (``sqrt(2) * std / sqrt(k)``).

    PYTHONPATH=src python benchmarks/pb_paired.py DIR/results.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from pipetrain.pb.report import load_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="a study's results.json")
    args = parser.parse_args(argv)
    result = load_results(args.results)
    runs = result.runs
    sgd = {(r.seed, r.lr_scale): r for r in runs if r.method == "sgd"}
    if not sgd:
        print("the study has no sgd runs to pair with", file=sys.stderr)
        return 2
    print("| method | S | lr | seeds | accuracy gap, points (paired by seed, mean ± std) | its standard error | "
          "loss ratio (median of the paired ratios) | seeds within 0.5 pt / within 1.5x |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r.method, r.stages, r.lr_scale) for r in runs if r.method not in ("sgd", "sgd-batch")},
                  key=lambda k: ([m.name for m in result.config.methods].index(k[0]), k[1] or 0, k[2]))
    for method, stages, lr in keys:
        gaps, ratios = [], []
        for r in runs:
            if (r.method, r.stages, r.lr_scale) != (method, stages, lr) or (r.seed, lr) not in sgd:
                continue
            base = sgd[(r.seed, lr)]
            accuracy = r.test_accuracy if math.isfinite(r.test_accuracy) else 0.0
            loss = math.inf if r.diverged else r.final_train_loss
            gaps.append(100 * (accuracy - base.test_accuracy))
            ratios.append(loss / base.final_train_loss)
        if not gaps:
            continue
        spread = statistics.stdev(gaps) if len(gaps) > 1 else 0.0
        within = sum(g >= -0.5 for g in gaps), sum(q <= 1.5 for q in ratios)
        print(f"| {method} | {stages} | x{lr:g} | {len(gaps)} | {statistics.fmean(gaps):+.1f} ± {spread:.1f} | "
              f"{spread / math.sqrt(len(gaps)):.1f} | {statistics.median(ratios):.2f}x | "
              f"{within[0]}/{len(gaps)}, {within[1]}/{len(gaps)} |")
    print()
    for name in ("sgd", "sgd-batch"):
        for lr in sorted({r.lr_scale for r in runs if r.method == name}):
            acc = [100 * r.test_accuracy for r in runs if r.method == name and r.lr_scale == lr]
            if len(acc) > 1:
                std = statistics.stdev(acc)
                print(f"{name} lr x{lr:g}: accuracy over {len(acc)} seeds {statistics.fmean(acc):.1f} ± {std:.1f}; "
                      f"a mean gap of {len(acc)} paired seeds is noise below about "
                      f"{math.sqrt(2) * std / math.sqrt(len(acc)):.1f} points (one standard error, unpaired)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
