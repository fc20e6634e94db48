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
    PYTHONPATH=src python benchmarks/pb_paired.py A/results.json B/results.json --against pb+sc+lwp+dts4

With several files their runs are pooled (the same run in two files: the first file's is kept).
``--against M`` pairs every other method with method M at the same stage count, lr scale and seed
instead of with batch-1 SGD (``sgd-batch`` is then compared with ``sgd``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from pipetrain.pb.report import load_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="a study's results.json (several: their runs pooled)")
    parser.add_argument("--against", metavar="METHOD", help="pair with this method (same S, lr, seed) instead of sgd")
    args = parser.parse_args(argv)
    loaded = [load_results(path) for path in args.results]
    seen, runs, order = set(), [], []
    for study in loaded:
        for m in study.config.methods:
            if m.name not in order:
                order.append(m.name)
        for r in study.runs:
            key = (r.method, r.stages, r.lr_scale, r.delay_scale, r.seed)
            if key not in seen:
                seen.add(key)
                runs.append(r)
    if args.against:
        return _against(runs, order, args.against)
    sgd = {(r.seed, r.lr_scale): r for r in runs if r.method == "sgd"}
    if not sgd:
        print("the study has no sgd runs to pair with", file=sys.stderr)
        return 2
    print("| method | S | lr | seeds | accuracy gap, points (paired by seed, mean ± std) | its standard error | "
          "loss ratio (median of the paired ratios) | seeds within 0.5 pt / within 1.5x |")
    print("|---|---|---|---|---|---|---|---|")
    keys = sorted({(r.method, r.stages, r.lr_scale) for r in runs if r.method not in ("sgd", "sgd-batch")},
                  key=lambda k: (order.index(k[0]), k[1] or 0, k[2]))
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


def _against(runs, order: list[str], baseline: str) -> int:
    """Per-seed differences of each method to ``baseline`` (sgd-batch to sgd)."""
    base = {(r.stages, r.lr_scale, r.seed): r for r in runs if r.method == baseline}
    sgd = {(r.lr_scale, r.seed): r for r in runs if r.method == "sgd"}
    if not base:
        print(f"no {baseline} runs to pair with", file=sys.stderr)
        return 2
    print("| difference | S | lr | per seed (points) | mean ± std | standard error | loss ratio (median) |")
    print("|---|---|---|---|---|---|---|")
    keys = sorted({(r.method, r.stages, r.lr_scale) for r in runs if r.method not in (baseline, "sgd")},
                  key=lambda k: (order.index(k[0]), k[1] or 0, k[2]))
    for method, stages, lr in keys:
        pairs = []
        for r in sorted((r for r in runs if (r.method, r.stages, r.lr_scale) == (method, stages, lr)),
                        key=lambda r: r.seed):
            other = sgd.get((lr, r.seed)) if method == "sgd-batch" else base.get((stages, lr, r.seed))
            if other is not None:
                pairs.append((100 * (r.test_accuracy - other.test_accuracy), r.final_train_loss / other.final_train_loss))
        if len(pairs) < 2:
            continue
        gaps = [g for g, _ in pairs]
        spread = statistics.stdev(gaps)
        name = "sgd" if method == "sgd-batch" else baseline
        print(f"| {method} - {name} | {stages if stages else '-'} | x{lr:g} | {', '.join(f'{g:+.1f}' for g in gaps)} | "
              f"{statistics.fmean(gaps):+.1f} ± {spread:.1f} | {spread / math.sqrt(len(gaps)):.1f} | "
              f"{statistics.median([q for _, q in pairs]):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
