"""Does `--stages 2` cut a Vision Transformer as well as the best hand cut?

A small ViT written the torchvision way (patch convolution, class token, position embedding,
`encoder.layers.encoder_layer_i` blocks with `nn.MultiheadAttention`, `heads.head`), with a
1000-class head as for ImageNet: at this width the head holds more parameters than a block but
costs almost nothing (it sees the class token only), so balancing parameter counts puts one block
too many on stage 0. The script trains it with 1F1B on 2 worker processes (1 thread each) through
`pipetrain.training.train.train(TrainConfig(model="benchmarks.cut_balance:vit", ...))`, in paired
rounds: every round runs `--stages 2` (measured time, the default), `--stages 2 --balance-by params`
and every hand cut between two blocks, in an order that alternates from round to round, and
reports each one's throughput and its ratio to the best hand cut::

    python benchmarks/cut_balance.py [--rounds 5] [--steps 60] [--out out/cut_balance.json]

A run's throughput is 32 samples over its median update time after the first quarter of its
updates (the median, not the mean: on a shared machine other jobs' bursts stretch some updates).
Across rounds the script reports the median and the best of each contender. It also reports each
run's balance, the busiest worker's share of the two workers' busy time (0.5: perfectly
balanced): other jobs slow both workers alike, so the share moves much less than the
throughput, and with one worker per core the slowest stage sets the pace, so
``share of the best hand cut / share`` estimates the speed relative to it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `benchmarks` as a package from a checkout

__all__ = ["VisionTransformer", "vit"]


class MLPBlock(nn.Sequential):
    def __init__(self, dim: int, hidden: int, dropout: float) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, dim),
                         nn.Dropout(dropout))


class EncoderBlock(nn.Module):
    """Pre-norm self-attention and MLP, each with a residual connection."""

    def __init__(self, heads: int, dim: int, mlp_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = MLPBlock(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = x + self.dropout(y)
        return x + self.mlp(self.ln_2(x))


class Encoder(nn.Module):
    def __init__(self, length: int, layers: int, heads: int, dim: int, mlp_dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, length, dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.Sequential()
        for i in range(layers):
            self.layers.add_module(f"encoder_layer_{i}", EncoderBlock(heads, dim, mlp_dim, dropout))
        self.ln = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VisionTransformer(nn.Module):
    """ViT on square images given flat (the synthetic data) or as (C, H, W)."""

    def __init__(self, image_size: int = 32, patch_size: int = 4, channels: int = 3, layers: int = 6,
                 heads: int = 4, dim: int = 64, mlp_dim: int = 256, num_classes: int = 1000) -> None:
        super().__init__()
        self.image_size, self.patch_size, self.channels = image_size, patch_size, channels
        self.conv_proj = nn.Conv2d(channels, dim, kernel_size=patch_size, stride=patch_size)
        self.class_token = nn.Parameter(torch.zeros(1, 1, dim))
        length = (image_size // patch_size) ** 2 + 1
        self.encoder = Encoder(length, layers, heads, dim, mlp_dim)
        self.heads = nn.Sequential()
        self.heads.add_module("head", nn.Linear(dim, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, self.channels, self.image_size, self.image_size)
        x = self.conv_proj(x).flatten(2).transpose(1, 2)  # (B, patches, dim)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])


def vit(input_shape, num_classes: int, layers: int = 6, dim: int = 64, heads: int = 4) -> VisionTransformer:
    """The `--model benchmarks.cut_balance:vit` factory: 3-channel square images from the data."""
    features = 1
    for size in input_shape:
        features *= size
    side = int(round((features / 3) ** 0.5))
    if 3 * side * side != features:
        raise ValueError(f"samples of {features} features are not 3-channel square images")
    return VisionTransformer(image_size=side, layers=layers, heads=heads, dim=dim, mlp_dim=4 * dim,
                             num_classes=num_classes)


MODEL = "benchmarks.cut_balance:vit:layers=6,dim=64,heads=4"
DATA = "synthetic:features=3072,classes=1000,samples=2048"


def contenders(layers: int) -> dict[str, dict]:
    hand = {f"hand {i}+{layers - i}": {"split_at": [f"encoder.layers.encoder_layer_{i}"]} for i in range(1, layers)}
    return {"--stages 2": {"stages": 2}, "--stages 2 --balance-by params": {"stages": 2, "balance_by": "params"},
            **hand}


def run_one(options: dict, steps: int):
    from pipetrain.training import TrainConfig
    from pipetrain.training.train import train

    config = TrainConfig(model=MODEL, data=DATA, schedule="1f1b", batch_size=32, microbatches=4, steps=steps,
                         optimizer="sgd:lr=0.01,momentum=0.9", executor="distributed", threads_per_worker=1,
                         progress=False, **options)
    result = train(config)
    report = result.report()
    ends = report["update_seconds"][steps // 4:]  # after start-up
    intervals = [b - a for a, b in zip(ends, ends[1:])]
    rate = 32 / statistics.median(intervals)  # the median update: robust to other jobs' bursts
    busy = report["stage_busy_seconds"]
    return rate, max(busy) / sum(busy), report["stage_choice"]["split_at"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", default="out/cut_balance.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, load {load:.1f}")
    print(f"model {MODEL}, data {DATA}, 1f1b, 32 samples per update in 4 microbatches, 2 workers x 1 thread")
    names = list(contenders(6))
    rates: dict[str, list[float]] = {name: [] for name in names}
    shares: dict[str, list[float]] = {name: [] for name in names}
    cuts: dict[str, list[list[str]]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            rate, share, split_at = run_one(contenders(6)[name], args.steps)
            rates[name].append(rate)
            shares[name].append(share)
            cuts[name].append(split_at)
            print(f"round {r}: {name:32s} {rate:7.1f} samples/s  busiest worker {share:.3f}  cut at "
                  f"{','.join(split_at)}", flush=True)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    bests = {name: max(values) for name, values in rates.items()}
    hand = [name for name in names if name.startswith("hand")]
    best = max(hand, key=medians.__getitem__)
    best_of = max(hand, key=bests.__getitem__)
    per_round = [rates["--stages 2"][r] / max(rates[h][r] for h in hand) for r in range(args.rounds)]
    balance = {name: statistics.median(values) for name, values in shares.items()}
    balanced = min(hand, key=balance.__getitem__)
    print(f"\n{'cut':32s} {'median':>8s} {'/ best':>7s} {'best':>8s} {'/ best':>7s} {'busiest':>8s} {'speed est.':>10s}"
          f"  cuts chosen   (samples/s; busiest worker's share of busy time, median)")
    for name in names:
        chosen = sorted({",".join(c) for c in cuts[name]})
        print(f"{name:32s} {medians[name]:8.1f} {medians[name] / medians[best]:7.3f} {bests[name]:8.1f} "
              f"{bests[name] / bests[best_of]:7.3f} {balance[name]:8.3f} {balance[balanced] / balance[name]:10.3f}  "
              f"{' '.join(chosen)}")
    print(f"\nbest hand cut: {best} (median), {best_of} (best of {args.rounds}); --stages 2 / the best hand cut of "
          f"its round: {', '.join(f'{x:.3f}' for x in per_round)} (median {statistics.median(per_round):.3f})")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"rates": rates, "shares": shares, "cuts": cuts, "medians": medians, "bests": bests,
                   "best_hand": best, "per_round": per_round, "load": load, "load_after": os.getloadavg()[0]},
                  handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
