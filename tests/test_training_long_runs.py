"""Long runs from their schedule's pattern (pipetrain.schedule.pattern): training equals the run of
the whole-built schedule bitwise, on the emulator and the distributed runtime, and resumes from a
checkpoint exactly; the measured timeline of a long run is a window plus whole-run aggregates."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from pipetrain.runtime.launch import launch
from pipetrain.schedule.pattern import pattern_of
from pipetrain.training import TrainConfig, prepare
from pipetrain.training.train import train

BASE = dict(model="mlp:depth=3,width=8", data="synthetic:features=6,classes=3,samples=64", batch_size=2,
            progress=False, quiet=True, timeout=60)
CONFIGS = {
    "pipedream": dict(schedule="pipedream", stages=2, steps=300),
    "pb": dict(schedule="pb", stages=2, batch_size=1, steps=200, compensation="sc+lwp"),
    "1f1b": dict(schedule="1f1b", stages=2, microbatches=2, steps=20),
    "2bw": dict(schedule="2bw", stages=2, microbatches=2, steps=20),
}
PATTERN, WHOLE = "7", "1000000000"  # PIPETRAIN_PATTERN_MIN_COPIES: from the pattern, or built whole


def _equal(a: str, b: str) -> bool:
    first, second = torch.load(a), torch.load(b)
    return first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_emulator_trains_a_pattern_as_the_whole_schedule(name, tmp_path, monkeypatch):
    config = TrainConfig(**dict(BASE, **CONFIGS[name]), executor="emulate")
    results = {}
    for label, value in (("pattern", PATTERN), ("whole", WHOLE)):
        monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", value)
        run = dataclasses.replace(config, save=str(tmp_path / f"{label}.pt"))
        assert (pattern_of(prepare(run).schedule) is not None) == (label == "pattern")
        results[label] = train(run)
    assert _equal(str(tmp_path / "pattern.pt"), str(tmp_path / "whole.pt"))
    assert results["pattern"].update_losses == results["whole"].update_losses


def test_a_long_run_keeps_a_window_of_action_times(tmp_path, monkeypatch):
    from pipetrain.execution import timing

    monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", PATTERN)
    monkeypatch.setattr(timing, "WINDOW", 100)
    config = TrainConfig(**dict(BASE, **CONFIGS["pipedream"]), executor="emulate",
                         trace=str(tmp_path / "trace.json"))
    result = train(config)
    timeline = result.timeline
    lengths = [len(p) for p in timeline.schedule.programs]
    assert all(50 < n <= 100 for n in lengths)  # the actions before a cut within 100 of every rank
    with open(tmp_path / "trace.json") as handle:  # measured and simulated: the window is a schedule
        events = [e for e in json.load(handle)["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 2 * sum(lengths)
    assert len(result.extra["update_seconds"]) == 300  # every update's end, over the whole run
    assert list(result.extra["update_seconds"]) == sorted(result.extra["update_seconds"])
    assert len(result.report()["update_seconds"]) == 300  # listed in the report JSON
    assert all(busy > 0 for busy in result.stage_busy)
    assert result.extra["steady_samples_per_s"] > 0


def _each(runs):
    """Worker entry: each ``(config, PIPETRAIN_PATTERN_MIN_COPIES)`` in one process group."""
    from pipetrain.training.distributed import worker

    for config, copies in runs:
        os.environ["PIPETRAIN_PATTERN_MIN_COPIES"] = copies
        worker(config)


def test_the_runtime_trains_and_resumes_a_pattern_bitwise(tmp_path, monkeypatch):
    runs, pairs = [], []
    for name, every, resume in (("pipedream", 70, 210), ("pb", 50, 150)):
        config = TrainConfig(**dict(BASE, **CONFIGS[name]), executor="distributed", workers=2)
        long = dataclasses.replace(config, checkpoint_dir=str(tmp_path / name), checkpoint_every=every, keep=10,
                                   save=str(tmp_path / f"{name}.pt"))
        whole = dataclasses.replace(config, save=str(tmp_path / f"{name}-whole.pt"))
        resumed = dataclasses.replace(long, checkpoint_dir=str(tmp_path / f"{name}-resumed"),
                                      resume=str(tmp_path / name / f"step-{resume:06d}"),
                                      save=str(tmp_path / f"{name}-resumed.pt"))
        runs += [(long, PATTERN), (whole, WHOLE), (resumed, PATTERN)]
        pairs += [(f"{name}.pt", f"{name}-whole.pt"), (f"{name}.pt", f"{name}-resumed.pt")]
        monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", PATTERN)
        emulated = dataclasses.replace(config, executor="emulate", workers=None, save=str(tmp_path / f"{name}-emulated.pt"))
        train(emulated)
        pairs.append((f"{name}.pt", f"{name}-emulated.pt"))
    result = launch(_each, (runs,), nprocs=2, timeout=300)
    assert result.returncode == 0, result.message
    for a, b in pairs:
        assert _equal(str(tmp_path / a), str(tmp_path / b)), (a, b)


@pytest.mark.parametrize("name, options, batch, steps", [("pipedream", {}, 2, 300), ("1f1b", dict(microbatches=2), 4, 20)])
def test_feeding_a_long_run_batch_by_batch_equals_the_whole_schedule(name, options, batch, steps, monkeypatch):
    from torch import nn
    from torch.utils.data import TensorDataset

    from pipetrain import Pipeline

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))

    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator)

    def pipeline(module):
        return Pipeline(module, stages=2, schedule=name, optimizer="sgd:lr=0.05,momentum=0.9", executor="emulate",
                        **options)

    monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", WHOLE)
    whole_model = model()
    whole = pipeline(whole_model).fit(TensorDataset(x, y), batch_size=batch, steps=steps, shuffle=False,
                                      progress=False)
    monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", PATTERN)
    stepped_model = model()
    pipe = pipeline(stepped_model)
    pipe.start(steps=steps, batch_size=batch)
    assert pattern_of(pipe._run.schedule) is not None
    for update in range(steps):
        start = update * batch % len(x)
        pipe.step(x[start:start + batch], y[start:start + batch])
    result = pipe.finish()
    assert result.update_losses == whole.update_losses
    assert all(torch.equal(p, q) for p, q in zip(stepped_model.parameters(), whole_model.parameters()))


def _stepped_worker(out: str) -> None:
    """Worker entry: a long PipeDream run fed batch by batch from the pattern, on the runtime."""
    from torch import nn

    from pipetrain import Pipeline

    os.environ["PIPETRAIN_PATTERN_MIN_COPIES"] = PATTERN
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    pipe = Pipeline(model, stages=2, schedule="pipedream", optimizer="sgd:lr=0.05,momentum=0.9", timeout=60)
    pipe.start(steps=300, batch_size=2)
    assert pattern_of(pipe._run.schedule) is not None
    for update in range(300):
        start = update * 2 % len(x)
        pipe.step(x[start:start + 2], y[start:start + 2])
    result = pipe.finish()
    if pipe.is_main:
        torch.save({"losses": result.update_losses, "model": model.state_dict()}, out)


def test_the_runtime_fed_batch_by_batch_runs_a_pattern_as_the_emulator(tmp_path, monkeypatch):
    from torch import nn
    from torch.utils.data import TensorDataset

    from pipetrain import Pipeline

    result = launch(_stepped_worker, (str(tmp_path / "stepped.pt"),), nprocs=2, timeout=240)
    assert result.returncode == 0, result.message
    monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", WHOLE)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    whole = Pipeline(model, stages=2, schedule="pipedream", optimizer="sgd:lr=0.05,momentum=0.9",
                     executor="emulate").fit(TensorDataset(x, y), batch_size=2, steps=300, shuffle=False,
                                             progress=False)
    stepped = torch.load(tmp_path / "stepped.pt")
    assert stepped["losses"] == whole.update_losses
    assert all(torch.equal(stepped["model"][k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("schedule, microbatches", [("1f1b", 1), ("1f1b", 2)])
def test_a_tied_parameter_sums_where_the_pattern_says(schedule, microbatches, monkeypatch):
    from test_execution_tied import OPTIMIZER, batches, tied_gpt

    from pipetrain import Pipeline
    from pipetrain.schedule.pattern import pattern_of as of

    data = batches(steps=9)
    trained = {}
    for label, value in (("pattern", PATTERN), ("whole", WHOLE)):
        monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", value)
        model = tied_gpt()
        pipe = Pipeline(model, executor="emulate", stages=2, schedule=schedule, microbatches=microbatches,
                        optimizer=OPTIMIZER)
        pipe.start(steps=len(data), batch_size=8)
        assert (of(pipe._run.schedule) is not None) == (label == "pattern") and pipe._run.tied
        for x, y in data:
            pipe.step(x, y)
        pipe.finish()
        assert model.head.weight is model.wte.weight
        trained[label] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(trained["pattern"][n], p) for n, p in trained["whole"].items())


@pytest.mark.parametrize("replicas", [None, [2, 1]])
def test_a_long_run_reads_its_updates_as_a_range(replicas, monkeypatch):
    from pipetrain.training.distributed import _updates_read

    monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", PATTERN)
    config = TrainConfig(**dict(BASE, **dict(CONFIGS["pipedream"], replicas=replicas, stages=None if replicas else 2)))
    run = prepare(config)
    assert pattern_of(run.schedule) is not None
    monkeypatch.setenv("PIPETRAIN_PATTERN_MIN_COPIES", WHOLE)
    whole = prepare(config)
    for rank in run.schedule.stage_ranks[0]:
        order = _updates_read(run.schedule, rank, run.layout)
        assert isinstance(order, range) and list(order) == _updates_read(whole.schedule, rank, whole.layout)
