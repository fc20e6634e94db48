"""Checks of benchmarks/stage_costs.py: it times the benchmark's real stages, updates included."""

import importlib.util
import pathlib

import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "stage_costs.py"
_SPEC = importlib.util.spec_from_file_location("pipetrain_bench_stage_costs", _PATH)
stage_costs = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(stage_costs)

TINY = stage_costs.Config(width=8, batch=8, microbatches=2, steps=1, warmup=0, hidden=4)


def test_every_measurement_is_reported():
    times = stage_costs.measure(TINY, rounds=1, update=True)
    assert set(times) == {"whole", "stage 0", "stage 1", "stage 0+update", "stage 1+update"}
    assert all(len(values) == 1 and values[0] > 0 for values in times.values())
    assert 0 < stage_costs.ceilings(times)[0] == times["whole"][0] / (2 * max(times["stage 0"][0], times["stage 1"][0]))


def test_a_stage_updates_as_its_schedule_does():
    # 1F1B: one update per batch; PipeDream: one per microbatch, stage 0 keeping no stale version
    torch.manual_seed(0)
    for every, updates in ((TINY.microbatches, 1), (1, TINY.microbatches)):
        for index in (0, 1):
            run = stage_costs._stage(TINY, index, every)
            executor = run.executor
            before = {n: p.clone() for n, p in executor.versions.latest.items()}
            for k in range(TINY.microbatches):
                run(k)
            assert executor.versions.current == updates
            assert len(executor.versions.held()) == 1
            assert any(not torch.equal(before[n], p) for n, p in executor.versions.latest.items())
