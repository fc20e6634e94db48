"""Versioned weights: what a stage keeps, and when versions are released."""

import pytest
import torch

from pipetrain.errors import PipetrainError
from pipetrain.execution import VersionStore, version_release_points
from pipetrain.schedule import build, memory_by_rank


def test_store_keeps_versions_until_released():
    store = VersionStore({"w": torch.zeros(1)})
    assert store.push({"w": torch.ones(1)}) == 1
    assert store.held() == [0, 1]
    store.release(0)
    assert store.held() == [1]
    store.release(1)  # the current version stays until a newer one is pushed
    assert store.held() == [1]
    store.push({"w": torch.full((1,), 2.0)})
    assert store.held() == [2] and store.peak == 2
    with pytest.raises(PipetrainError, match="version 0 is not held"):
        store[0]


@pytest.mark.parametrize("name, kwargs", [("pipedream", {}), ("pb", {}), ("2bw", {"steps": 4}), ("1f1b", {"steps": 3})])
def test_release_points_hold_exactly_the_schedules_versions(name, kwargs):
    schedule = build(name, 4, 8, **kwargs)
    memory = memory_by_rank(schedule)
    for rank, program in enumerate(schedule.programs):
        releases = version_release_points(program)
        live, peak = {0}, 1
        current = 0
        for position, action in enumerate(program):
            if action.kind.value == "STEP":
                released_now = {v for _, v in releases.get(position, ())}
                live -= released_now
                current += 1
                live.add(current)
                peak = max(peak, len(live))
                continue
            if action.version is not None:
                assert action.version in live, (rank, str(action))
            live -= {v for _, v in releases.get(position, ())}
        assert peak == memory[rank].peak_versions[rank]
