"""A user's training script on pipetrain's Python API, as tests/test_pipeline_api.py runs it:
``python tests/api_script.py OUT`` (spawns its own workers), under torchrun, or with
``--executor emulate``. Each run of ``--runs SCHEDULE:MODE,...`` trains the same seeded model on a
plain map-style Dataset, with ``fit`` (``loader``: ``fit`` given a DataLoader with a worker process) or
with a loop of ``step`` calls over a DataLoader, and the
main rank saves its state dict, losses and schedule to OUT/SCHEDULE-MODE.{pt,json}."""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from pipetrain import Pipeline
from pipetrain.training.callbacks import Callback

STEPS, BATCH = 6, 8


class Points(Dataset):
    """A plain data set, read sample by sample: 3 classes of noisy points."""

    def __init__(self, n: int = 96) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = torch.randint(0, 3, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return self.x[index], int(self.y[index])


class Saved(Callback):
    def __init__(self, paths: list) -> None:
        self.paths = paths

    def on_checkpoint(self, step: int, path: str) -> None:
        self.paths.append([step, os.path.basename(path)])


def one_run(schedule: str, mode: str, executor: str, out: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    pipe = Pipeline(model, stages=2, schedule=schedule, executor=executor, microbatches=2 if schedule == "1f1b" else 1,
                    optimizer=torch.optim.SGD, optimizer_options=dict(lr=0.05, momentum=0.9), timeout=60)
    data = Points()
    in_flight, checkpoints = [], []
    if mode == "fit":
        kept = executor == "distributed" and schedule == "pipedream"  # checkpoints: the runtime's
        result = pipe.fit(data, batch_size=BATCH, steps=STEPS, shuffle=False, progress=False,
                          checkpoint_dir=os.path.join(out, "checkpoints") if kept else None,
                          checkpoint_every=3 if kept else 0, callbacks=[Saved(checkpoints)])
    elif mode == "loader":  # the same batches as fit's unshuffled ones, read by the loader's own worker
        result = pipe.fit(DataLoader(data, batch_size=BATCH, num_workers=1), steps=STEPS, progress=False)
    else:
        pipe.start(steps=STEPS, batch_size=BATCH)
        finished = []
        for index, (x, y) in enumerate(DataLoader(data, batch_size=BATCH)):
            if index == STEPS:
                break
            finished += pipe.step(x, y)
            if index == 2:  # every rank evaluates between two steps, and gets the metrics
                metrics = pipe.evaluate(data, batch_size=32)
                with open(os.path.join(out, f"{schedule}-{mode}-eval-{pipe.rank}.json"), "w") as handle:
                    json.dump(metrics, handle)
            if executor == "emulate":  # minibatches left in the pipeline between calls (no flush)
                in_flight.append(sum(len(e.in_flight) for held in pipe._session.executors for e in held.values()))
        result = pipe.finish()
        if finished:
            assert [u for u, _ in finished] == list(range(STEPS)), finished
            assert [loss for _, loss in finished] == result.update_losses
    if pipe.is_main:
        torch.save(model.state_dict(), os.path.join(out, f"{schedule}-{mode}.pt"))
        programs = [[str(a) for a in p] for p in pipe.last_schedule.programs] if pipe.last_schedule else None
        with open(os.path.join(out, f"{schedule}-{mode}.json"), "w") as handle:
            json.dump({"losses": result.update_losses, "in_flight": in_flight, "workers": result.workers,
                       "programs": programs, "checkpoints": checkpoints}, handle)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--runs", default="1f1b:fit,pipedream:fit,pipedream:step,pipedream:loader")
    parser.add_argument("--executor", default="distributed")
    args = parser.parse_args(argv)
    for item in args.runs.split(","):
        schedule, mode = item.split(":")
        one_run(schedule, mode, args.executor, args.out)


if __name__ == "__main__":
    main()
