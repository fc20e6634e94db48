"""The data path's cost: PipeDream's rate with the same samples in four forms, side by side.

The model, split, optimizer and settings are the overhead-bound configuration of
``benchmarks/vs_torch_pipelining.py`` (an MLP of 8 hidden 256-wide layers split 4 + 4, PipeDream
on 2 workers, one update per minibatch of 32), trained by ``pipetrain.training`` on the
distributed runtime. The training data is ``--samples`` random samples (32,768 by default, read
in order without shuffling) given as:

* ``tensors``   two in-memory tensors (a ``TensorDataset``): read by one indexing operation on a
                background thread, the reference every other form is compared with;
* ``dataset``   a plain map-style ``Dataset`` class whose ``__getitem__`` returns ``(x[i], y[i])``:
                read sample by sample in DataLoader worker processes (``--data-workers``);
* ``subset``    a ``Subset`` of that data set whose index list is ``list(range(--samples))``: the
                same samples as ``dataset``, so the difference is the cost of the ``Subset``;
* ``loader``    a user's ``DataLoader`` over that data set, ``batch_size=32`` and ``--loader-workers``
                worker processes of its own.

Each round runs every form once (odd rounds in reverse order); the ratios to ``tensors`` are
taken within a round and their medians printed. ``--data-workers`` may list several counts
(``0,1,2``): each becomes its own ``dataset`` row, so the default worker count can be chosen from
one run. What the worker processes cost shows as the rate lost against ``tensors``, and the CPU
seconds each form spent (all processes of the run, the workers included) per 1,000 samples.

``--transfer`` measures instead what one batch costs to move from a DataLoader worker process to
the training process, as DataLoader sends it (one shared-memory segment per tensor) and packed as
bytes (``pipetrain.data.prefetch.pack``), for batches of 32 KiB to 4 MiB: the figures behind
``PACK_LIMIT`` and the grouping of small batches (``pipetrain.data.batches.group_size``).

Usage::

    PYTHONPATH=src python benchmarks/data_path.py [--rounds 5] [--steps 20] [--warmup 3]
        [--samples 32768] [--data-workers 1] [--loader-workers 2] [--forms tensors,dataset,subset,loader]
    PYTHONPATH=src python benchmarks/data_path.py --transfer
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import replace

import torch
from torch.utils.data import DataLoader, Dataset, Subset, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.vs_torch_pipelining import CONFIGS, Config, pipetrain_config, pipetrain_rate  # noqa: E402

__all__ = ["PlainDataset", "tensors", "dataset", "subset", "loader"]

MODULE = "benchmarks.data_path"


def _arrays(width: int, samples: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(samples, width, generator=g), torch.randint(0, classes, (samples,), generator=g)


class PlainDataset(Dataset):
    """What a user writes: samples held in memory, handed out one by one."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.num_classes = int(y.max()) + 1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


# data factories (``--data benchmarks.data_path:NAME:width=..,samples=..,classes=..``); each has a
# split= parameter, so nothing is held out; the test split is a few samples that are never read


def tensors(width: int, samples: int, classes: int, split: str = "train") -> TensorDataset:
    x, y = _arrays(width, samples, classes)
    return TensorDataset(x, y) if split == "train" else TensorDataset(x[:64], y[:64])


def dataset(width: int, samples: int, classes: int, split: str = "train") -> PlainDataset:
    x, y = _arrays(width, samples, classes)
    return PlainDataset(x, y) if split == "train" else PlainDataset(x[:64], y[:64])


def subset(width: int, samples: int, classes: int, split: str = "train") -> Subset:
    full = dataset(width, samples, classes, split)
    return Subset(full, list(range(len(full))))


def loader(width: int, samples: int, classes: int, batch: int, workers: int, split: str = "train") -> DataLoader:
    return DataLoader(dataset(width, samples, classes, split), batch_size=batch, shuffle=False, drop_last=True,
                      num_workers=workers, persistent_workers=workers > 0)


def _config(cfg: Config, args: argparse.Namespace, form: str, workers: int | None):
    shape = f"width={cfg.width},samples={args.samples},classes={cfg.classes}"
    if form == "loader":
        shape += f",batch={cfg.microbatch},workers={args.loader_workers}"
    config = pipetrain_config(cfg, args.steps, args.warmup, "pipedream", data=f"{MODULE}:{form}:{shape}")
    return replace(config, data_workers=workers)


class _Ready(Dataset):
    """Item t: a fresh batch of ``rows`` x 256 floats and its labels (``packed`` as bytes or not)."""

    def __init__(self, rows: int, packed: bool) -> None:
        self.x, self.packed = torch.randn(rows, 256), packed

    def __getitem__(self, t: int):
        from pipetrain.data.prefetch import pack

        batch = (self.x.clone(), torch.zeros(len(self.x), dtype=torch.int64))
        return pack(batch) if self.packed else batch


def _keep(item):
    return item


def transfer(batches: int = 200) -> None:
    """Training-process time per batch taken from one DataLoader worker that is always ahead."""
    from pipetrain.data.prefetch import unpack

    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f}; ms per batch on the training process (median of {batches})")
    print(f"  {'batch':>9}  {'shared memory':>13}  {'packed bytes':>12}")
    for rows in (32, 256, 1024, 4096):
        cells = []
        for packed in (False, True):
            loader = DataLoader(_Ready(rows, packed), batch_size=None, sampler=range(batches + 1), num_workers=1,
                                collate_fn=_keep, generator=torch.Generator())
            iterator, times = iter(loader), []
            next(iterator)
            for _ in range(batches):
                time.sleep(0.004)  # the worker gets ahead, as during training
                started = time.perf_counter()
                item = next(iterator)
                if packed:
                    unpack(item)
                times.append(time.perf_counter() - started)
            del iterator
            cells.append(statistics.median(times) * 1e3)
        print(f"  {rows * 256 * 4 // 1024:>5} KiB  {cells[0]:>13.2f}  {cells[1]:>12.2f}")


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=None, help="timed batches of 1024 (default: the config's, 20)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed batches of 1024 first (default 3)")
    parser.add_argument("--samples", type=int, default=32768)
    parser.add_argument("--data-workers", default="1", help="worker counts for the dataset form, e.g. 0,1,2")
    parser.add_argument("--loader-workers", type=int, default=2)
    parser.add_argument("--forms", default="tensors,dataset,subset,loader")
    parser.add_argument("--transfer", action="store_true", help="measure moving one batch between processes instead")
    args = parser.parse_args()
    if args.transfer:
        transfer()
        return
    cfg = CONFIGS["overhead-bound"]
    args.steps = cfg.steps if args.steps is None else args.steps
    args.warmup = cfg.warmup if args.warmup is None else args.warmup
    counts = [int(n) for n in args.data_workers.split(",")]
    entries: list[tuple[str, str, int | None]] = []  # (label, form, data workers)
    for form in args.forms.split(","):
        if form in ("dataset", "subset"):
            entries += [(f"{form}, {n} data worker{'s' * (n != 1)}", form, n) for n in counts]
        elif form in ("tensors", "loader"):
            entries.append((form if form == "tensors" else f"loader, {args.loader_workers} workers", form, None))
        else:
            raise SystemExit(f"unknown form {form!r}")
    if entries[0][1] != "tensors":
        raise SystemExit("the first form must be tensors (the reference)")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"torch {torch.__version__}; load average {os.getloadavg()[0]:.2f}")
    print(f"pipedream, overhead-bound (width {cfg.width}, minibatch {cfg.microbatch}), {args.samples} samples, "
          f"{args.steps} x {cfg.batch} timed samples after {args.warmup} x {cfg.batch}, {args.rounds} paired rounds")
    rates: dict[str, list[float]] = {label: [] for label, _, _ in entries}
    cpu: dict[str, list[float]] = {label: [] for label, _, _ in entries}
    for round_index in range(args.rounds):
        order = entries if round_index % 2 == 0 else entries[::-1]
        for label, form, workers in order:
            before = _children_cpu()
            rates[label].append(pipetrain_rate(_config(cfg, args, form, workers), cfg, args.warmup))
            samples = (args.steps + args.warmup) * cfg.batch
            cpu[label].append((_children_cpu() - before) / samples * 1000)
        line = ", ".join(f"{label} {rates[label][-1]:.0f}" for label, _, _ in entries)
        print(f"round {round_index + 1}: {line}", flush=True)
        time.sleep(0.5)
    reference = rates[entries[0][0]]
    print(f"\n  {'form':<28} {'samples/s':>9} {'/ tensors':>9}  {'faster':>6}  {'cpu s/1k':>8}   rounds")
    for label, _, _ in entries:
        ratios = [r / ref for r, ref in zip(rates[label], reference)]
        ahead = sum(ratio > 1 for ratio in ratios)
        print(f"  {label:<28} {statistics.median(rates[label]):>9.0f} {statistics.median(ratios):>9.3f}  "
              f"{ahead:>3}/{len(ratios):<2}  {statistics.median(cpu[label]):>8.3f}   "
              + ", ".join(f"{r:.0f}" for r in rates[label]))


if __name__ == "__main__":
    main()
