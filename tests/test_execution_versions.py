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


def test_released_versions_lend_their_tensors_to_the_next_update():
    store = VersionStore({"w": torch.zeros(2), "frozen": torch.ones(1)})
    first = store.latest
    assert store.spares(["w"]) == {}  # nothing released yet
    store.push({"w": torch.ones(2), "frozen": first["frozen"]})  # a parameter without a gradient keeps its tensor
    store.release(0)
    spares = store.spares(["w", "frozen"])
    assert set(spares) == {"w"} and spares["w"] is first["w"]  # "frozen" is still held by version 1
    store.push({"w": spares["w"].fill_(2.0), "frozen": first["frozen"]})
    assert store.reused == 1 and store.allocated == 3  # version 0's two tensors and version 1's new "w"
    lent = store.spares(["w"])  # nothing released since: no spare
    assert lent == {}
    store.release(1)
    lent = store.spares(["w"])
    store.push({"w": torch.zeros(2), "frozen": first["frozen"]})  # the update did not use what it was lent
    assert store.spares(["w"])["w"] is lent["w"]


def test_an_update_in_place_is_neither_allocated_nor_reused_and_shared_tensors_are_not_exclusive():
    store = VersionStore({"w": torch.zeros(2), "b": torch.zeros(1)})
    current = store.latest
    assert store.exclusive(0, "w")
    store.release(0)
    assert store.releasing_current([]) and store.releasing_current([0])
    store.push(dict(current))  # same tensors: written in place
    assert (store.allocated, store.reused, store.held()) == (2, 0, [1])
    assert store.spares(["w", "b"]) == {}
    store.push({"w": torch.ones(2), "b": store.latest["b"]})
    assert not store.exclusive(2, "b") and store.exclusive(2, "w")


def test_versions_restored_from_a_checkpoint_share_what_they_shared():
    shared = torch.arange(4.0)
    state = {3: {"w": torch.zeros(4), "b": shared}, 4: {"w": torch.ones(4), "b": shared}}
    loaded = {v: {n: t.clone() if n == "w" else t.view(4) for n, t in p.items()} for v, p in state.items()}
    store = VersionStore.from_state(loaded, 4)
    assert store[3]["b"] is store[4]["b"] and not store.exclusive(4, "b") and store.exclusive(4, "w")
    store.release(3)
    assert set(store.spares(["w", "b"])) == {"w"}


def test_without_recycling_released_tensors_are_dropped():
    store = VersionStore({"w": torch.zeros(2)}, recycle=False)
    store.push({"w": torch.ones(2)})
    store.release(0)
    assert store.spares(["w"]) == {}


def _allocations_in(prof, name: str) -> list[int]:
    """Bytes of every allocation the profiler saw inside events called ``name``."""
    inside = []
    for event in prof.events():
        if event.cpu_memory_usage <= 0 or event.cpu_children:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name != name:
            parent = parent.cpu_parent
        if parent is not None:
            inside.append(event.cpu_memory_usage)
    return inside


@pytest.mark.parametrize("name, optimizer, policy", [
    ("pipedream", "sgd:lr=0.05,momentum=0.9", None),
    ("pipedream", "adamw:lr=0.001,weight_decay=0.01", None),
    ("pb", "sgd:lr=0.01,momentum=0.9", "predict"),  # Spike Compensation and Linear Weight Prediction
    ("2bw", "sgd:lr=0.05,momentum=0.9,nesterov=true", None),
])
def test_no_parameter_memory_is_allocated_per_update_in_steady_state(name, optimizer, policy):
    """Over a few hundred updates of a schedule with several versions per stage, the version stores
    allocate nothing after the first updates (each update writes into a released version's tensors
    or, where nothing reads the version it replaces, in place), and neither updates nor predictions
    allocate parameter memory (counted by PyTorch's profiler over the last fifty updates)."""
    from torch import nn
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    from pipetrain.emulate import Emulator
    from pipetrain.execution import StageExecutor, UnitData, UnitLayout
    from pipetrain.optim import build_stage_optimizer
    from pipetrain.schedule import staleness

    stages, units = 3, 300
    per_update = 4 if name == "2bw" else 1
    schedule = (build(name, stages, per_update, steps=units // per_update) if name == "2bw"
                else build(name, stages, units, policy=policy))
    torch.manual_seed(0)
    modules = [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(stages)]
    delays = staleness(schedule)
    compensation = "sc+lwp" if policy == "predict" else "none"
    executors = [{s: StageExecutor(s, modules[s], build_stage_optimizer(optimizer, stage_delay=delays[s],
                                                                        compensation=compensation),
                                   loss_fn=(lambda out, y: ((out - y) ** 2).mean()) if s == stages - 1 else None,
                                   policy=schedule.policy)} for s in range(stages)]
    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(2, 16, generator=generator), torch.randn(2, 16, generator=generator))
               for _ in range(units * per_update)]
    data = UnitData(None, UnitLayout(2 * per_update, per_update), lambda t: t,
                    lambda _d, t: tuple(torch.cat(part) for part in zip(*batches[t * per_update:(t + 1) * per_update])))
    emulator = Emulator(schedule, executors, data)
    programs = schedule.programs
    steps = [[p for p, a in enumerate(program) if a.kind.value == "STEP"] for program in programs]
    warm = [positions[len(positions) // 3] for positions in steps]
    emulator.begin()
    emulator.advance(warm)
    allocated = [executors[s][s].versions.allocated for s in range(stages)]
    tail = [positions[-len(positions) // 6] for positions in steps]
    emulator.advance(tail)
    assert [executors[s][s].versions.allocated for s in range(stages)] == allocated
    for stage in range(stages):
        executor = executors[stage][stage]
        original_step, optimizer_object = executor.step, executor.optimizer
        original_predict = optimizer_object.predict

        def step(release=(), original_step=original_step):
            with record_function("update"):
                return original_step(release)

        def predict(*args, original_predict=original_predict, **kwargs):
            with record_function("update"):
                return original_predict(*args, **kwargs)

        executor.step = step
        optimizer_object.predict = predict
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        emulator.advance()
    assert [executors[s][s].versions.allocated for s in range(stages)] == allocated
    for stage in range(stages):
        store = executors[stage][stage].versions
        # the tensors of as many versions as the stage holds at once, and no more; a stage holding
        # one version updates it in place, one holding several writes into released ones
        assert store.allocated == 2 * store.peak, (stage, store.allocated, store.peak)
        assert (store.reused > 0) == (store.peak > 1), (stage, store.reused, store.peak)
    smallest = 16 * 4  # bytes of a bias
    assert [b for b in _allocations_in(prof, "update") if b >= smallest] == []
