"""Schedules exchanged with torch as CSV: the orders torch builds load, validate, simulate and
train in the emulator bitwise as plain training that sums the same microbatch gradients in the same
order; what pipetrain writes, torch's runtime reads; what cannot run is refused by row and cell."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch_orders import V_SHAPED, StandInStage, compute_order, torch_schedule

from pipetrain.emulate import Emulator
from pipetrain.errors import ScheduleError
from pipetrain.execution import StageExecutor, UnitData, UnitLayout
from pipetrain.optim import SGD
from pipetrain.schedule import Kind, build, check, simulate, strip_communication, torch_csv
from pipetrain.schedule.ir import halves
from pipetrain.training import TrainConfig
from pipetrain.training.setup import prepare

LR = 0.1
SIZE = 12  # samples per batch

#: torch 2.13's multi-stage schedule classes: (class, ranks, microbatches); two stages per rank
TORCH_CASES = [(cls, ranks, microbatches)
               for cls in ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble",
                           "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
               for ranks, microbatches in ((2, 4), (3, 6))]


def mse(output, target):
    return ((output - target) ** 2).mean()


def make_stages(count, width=3, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width), nn.Tanh()).double() for _ in range(count)]


def make_batch(width=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(SIZE, width, generator=generator, dtype=torch.float64),
            torch.randn(SIZE, width, generator=generator, dtype=torch.float64))


def emulated(schedule, stages, batch):
    """The weights of every stage after running ``schedule`` (one update) in the emulator."""
    last = schedule.num_stages - 1
    executors = [{} for _ in schedule.programs]
    for stage, ranks in enumerate(schedule.stage_ranks):
        executors[ranks[0]][stage] = StageExecutor(stage, copy.deepcopy(stages[stage]), SGD(lr=LR),
                                                   loss_fn=mse if stage == last else None, policy="flush")
    data = UnitData(None, UnitLayout(SIZE, schedule.microbatches), lambda t: t, lambda _d, t: batch)
    Emulator(schedule, executors, data).run()
    return [list(executors[ranks[0]][stage].versions.latest.values()) for stage, ranks in
            enumerate(schedule.stage_ranks)]


def accumulation_orders(schedule):
    """``orders[stage]``: the microbatches in the order the stage adds their weight gradients (its B
    and W, a pair's B included)."""
    orders = [[] for _ in range(schedule.num_stages)]
    for program in schedule.programs:
        for action in program:
            for half in halves(action):
                if half.kind in (Kind.B, Kind.W):
                    orders[half.stage].append(half.microbatch)
    return orders


def plain_training(stages, batch, microbatches, orders):
    """Plain PyTorch: each microbatch's gradient of the whole model (its loss weighted by its share
    of the batch), summed per stage in ``orders[stage]``, one SGD update."""
    x, y = batch
    layout = UnitLayout(SIZE, microbatches)
    params = [[p.detach().clone().requires_grad_() for p in stage.parameters()] for stage in stages]
    grads = {}
    for k in range(microbatches):
        _, start, stop = layout.bounds(k)
        out = x[start:stop]
        for stage, group in zip(stages, params):
            out = torch.func.functional_call(stage, dict(zip(dict(stage.named_parameters()), group)), (out,))
        flat = iter(torch.autograd.grad(mse(out, y[start:stop]) * layout.loss_scale(k), [p for g in params for p in g]))
        grads[k] = [[next(flat) for _ in group] for group in params]
    result = []
    for stage, group in enumerate(params):
        total = None
        for k in orders[stage]:
            total = grads[k][stage] if total is None else [a + b for a, b in zip(total, grads[k][stage])]
        result.append([torch.add(p.detach(), g, alpha=-LR) for p, g in zip(group, total)])
    return result


def assert_trains_as_plain(schedule):
    stages, batch = make_stages(schedule.num_stages), make_batch()
    got = emulated(schedule, stages, batch)
    expected = plain_training(stages, batch, schedule.microbatches, accumulation_orders(schedule))
    for stage, (a, b) in enumerate(zip(got, expected)):
        for tensor, reference in zip(a, b):
            assert torch.equal(tensor, reference), (schedule.meta, stage)


@pytest.mark.parametrize("fmt", ["compute_only", "compute_comms"])
@pytest.mark.parametrize("cls,ranks,microbatches", TORCH_CASES)
def test_torchs_own_orders_load_validate_simulate_and_train(tmp_path, cls, ranks, microbatches, fmt):
    path = tmp_path / f"{cls}.csv"
    built = torch_schedule(cls, ranks, 2, microbatches)
    built._dump_csv(str(path), format=fmt)
    schedule = torch_csv.load(str(path))
    check(schedule)
    assert schedule.meta == {"format": fmt, "style": "v" if cls in V_SHAPED else "loop"}
    assert (schedule.num_ranks, schedule.num_stages, schedule.microbatches) == (ranks, 2 * ranks, microbatches)
    assert [s[0] for s in schedule.stage_ranks] == [built.stage_index_to_group_rank[s] for s in range(2 * ranks)]
    order = built.pipeline_order
    assert compute_order(strip_communication(schedule)) == [
        [str(a).replace("OVERLAP_F_B", "") for a in order[rank] if a is not None] for rank in range(ranks)]
    assert simulate(schedule).makespan > 0
    assert_trains_as_plain(schedule)


@pytest.mark.parametrize("name,ranks,microbatches,chunks", [
    ("gpipe", 3, 4, 1), ("1f1b", 3, 5, 1), ("zb-h1", 3, 4, 1), ("interleaved", 2, 4, 2), ("bfs", 2, 3, 2),
    ("interleaved-zb", 3, 6, 2), ("zb-v", 3, 5, 1), ("dualpipev", 2, 5, 1), ("dualpipev", 3, 6, 1)])
def test_what_pipetrain_writes_torchs_runtime_reads(tmp_path, name, ranks, microbatches, chunks):
    schedule = build(name, ranks, microbatches, chunks=chunks)
    path = str(tmp_path / "schedule.csv")
    torch_csv.dump(schedule, path)
    held = [s for s, owner in enumerate(schedule.stage_ranks) if owner == [0]]
    runtime = _PipelineScheduleRuntime([StandInStage(s, schedule.num_stages, ranks) for s in held], microbatches,
                                       loss_fn=mse)
    runtime._load_csv(path)  # torch's own validation and lowering (send/recv added) pass
    assert [runtime.stage_index_to_group_rank[s] for s in range(schedule.num_stages)] == [
        r[0] for r in schedule.stage_ranks]
    ours = compute_order(strip_communication(schedule))
    assert [[str(a).replace("OVERLAP_F_B", "") for a in runtime.pipeline_order[r]] for r in range(ranks)] == ours
    again = torch_csv.load(path)
    assert compute_order(strip_communication(again)) == ours and again.stage_ranks == schedule.stage_ranks
    assert_trains_as_plain(again)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_torchs_names_build_torchs_orders(ranks):
    """torchtitan's names: each builds the order of torch's class of that name."""
    for name, cls, chunks in (("Interleaved1F1B", "ScheduleInterleaved1F1B", 2),
                              ("LoopedBFS", "ScheduleLoopedBFS", 2),
                              ("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", 2),
                              ("ZBVZeroBubble", "ScheduleZBVZeroBubble", 1), ("DualPipeV", "ScheduleDualPipeV", 1)):
        for microbatches in (2 * ranks, 4 * ranks):
            built = torch_schedule(cls, ranks, 2, microbatches).pipeline_order
            expected = [[str(a).replace("OVERLAP_F_B", "") for a in built[r] if a is not None] for r in range(ranks)]
            assert compute_order(build(name, ranks, microbatches, chunks=chunks, communication=False)) == expected


def test_writing_refuses_what_torch_cannot_run():
    with pytest.raises(ScheduleError, match="flush"):
        torch_csv.dumps(build("pipedream", 2, 4))
    with pytest.raises(ScheduleError, match="one rank"):
        torch_csv.dumps(build("1f1b", 2, 4, replicas=[2, 1]))
    with pytest.raises(ScheduleError, match="one step"):
        torch_csv.dumps(build("1f1b", 2, 4, steps=2))


@pytest.mark.parametrize("text,where,what", [
    ("a,b\n1,2\n", "row 1 (rank 0), cell 1 ('a')", "not one of torch's schedule actions"),
    ("0F0,0F1,0Q1\n", "row 1 (rank 0), cell 3 ('0Q1')", "not one of torch's"),
    ("0F0,,0B0\n1F0,1B0,(1F0;1B0)\n", "row 2 (rank 1), cell 3", "not one of torch's"),
    ("0F0,(0B0;1F0)OVERLAP_F_B\n", "row 1 (rank 0), cell 2", "a forward and then a backward"),
    ("0F0,0B0,0F\n", "row 1 (rank 0), cell 3 ('0F')", "needs a microbatch"),
    ("0F0,3F0,0B0,3B0\n1F0,1B0\n", "row 1 (rank 0), cell 2 ('3F0')", "no rank holds stage 2"),
    ("0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0,4RECV_F0\n", "row 2 (rank 1), cell 5 ('4RECV_F0')",
     "stage 4, which no rank holds"),
    ("0F0,0F1,,0B0,0B1\n1F0,1F9,1B0\n", "row 2 (rank 1), cell 2 ('1F9')", "microbatch 9 is out of range"),
    ("0F0,0F1,0B0\n1F0,1F1,1B0,1B1\n", "row 1 (rank 0), cell 2 ('0F1')", "has no backward"),
    ("0F0,0I0\n1F0,1B0\n", "row 1 (rank 0), cell 2 ('0I0')", "has no W"),
    ("0F0,0W0,0I0\n1F0,1B0\n", "row 1 (rank 0), cell 2 ('0W0')", "before its I"),
    ("0B0,0F0\n1F0,1B0\n", "row 1 (rank 0), cell 1 ('0B0')", "before its forward"),
    ("0F0,0B0,1F0\n1F0,1B0\n", "row 2 (rank 1), cell 1 ('1F0')", "runs on rank 1 here but on rank 0"),
])
def test_refusals_name_the_row_and_cell(tmp_path, text, where, what):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ScheduleError) as error:
        torch_csv.read(str(path))
    message = str(error.value)
    assert where in message and what in message and "\n" not in message
    assert message.startswith(str(path))



#: Written in torch's format by pipetrain, run by torch's runtime and by pipetrain's (2 ranks, gloo).
RUNTIME_CASES = [("interleaved", {"chunks": 2}), ("zb-v", {}), ("dualpipev", {})]


def test_torchs_runtime_runs_pipetrains_schedules_to_pipetrains_parameters(tmp_path):
    """Bitwise: pipetrain scales each microbatch's loss by its share of the batch (1/4) before the
    backward, torch divides the summed gradient by 4 after it; both exact for a power of two. The
    stage arithmetic, the order of the gradient sums and SGD's update are the same."""
    from pipetrain.runtime.launch import launch
    from torch_runtime_worker import run_pipetrain, run_torch

    base = dict(model="mlp:depth=5,width=16", data="synthetic:features=8,classes=3,samples=96", batch_size=8,
                steps=3, microbatches=4, optimizer="sgd:lr=0.05", progress=False, timeout=60.0, stages=2,
                executor="distributed")
    configs, cases = [], []
    for name, extra in RUNTIME_CASES:
        config = TrainConfig(schedule=name, save=str(tmp_path / f"{name}-pipetrain.pt"), **base, **extra)
        configs.append(config)
        written = str(tmp_path / f"{name}.csv")
        torch_csv.dump(build(name, 2, 4, chunks=extra.get("chunks", 1)), written)
        cases.append((config, written, str(tmp_path / f"{name}-torch.pt")))
    result = launch(run_pipetrain, (configs,), nprocs=2, timeout=240, quiet=True)
    assert result.returncode == 0, result.message
    result = launch(run_torch, (cases, 0.05), nprocs=2, timeout=240, quiet=True)
    assert result.returncode == 0, result.message
    for config, _, out in cases:
        ours = torch.load(config.save)
        theirs = {**torch.load(f"{out}.0"), **torch.load(f"{out}.1")}
        assert theirs.keys() == ours.keys()
        for key in ours:
            assert torch.equal(theirs[key], ours[key]), (config.schedule, key)
        first = prepare(dataclasses.replace(config, executor="emulate", save=None)).model.state_dict()
        assert all(not torch.equal(first[key], ours[key]) for key in ours)  # every parameter trained
