"""The one interpreter of the IR: real programs from the schedule package, run with the in-process
transport on real stage executors, against plain training and closed forms (bitwise), and under
an interleaving of the ranks unlike the emulator's (the same bits)."""

import copy

import pytest
import torch
import torch.nn as nn

from pipetrain.emulate import Emulator
from pipetrain.emulate.in_process import Mailboxes
from pipetrain.errors import PipetrainError
from pipetrain.execution import StageExecutor, UnitData, UnitLayout
from pipetrain.execution.interpreter import Interpreter
from pipetrain.optim import SGD
from pipetrain.schedule import build
from pipetrain.schedule.ir import Kind

LR = 0.1


def mse(output, target):
    return ((output - target) ** 2).mean()


def make_stages(count, width=3, seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(width, width, bias=False), nn.Tanh()).double() for _ in range(count)]


def make_batches(count, size=4, width=3, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, width, generator=generator, dtype=torch.float64),
             torch.randn(size, width, generator=generator, dtype=torch.float64)) for _ in range(count)]


def make_executors(schedule, stages, policy):
    """``executors[rank][stage]`` with a copy of the stage's module for every replica."""
    last = schedule.num_stages - 1
    executors = [{} for _ in schedule.programs]
    for stage, ranks in enumerate(schedule.stage_ranks):
        for rank in ranks:
            executors[rank][stage] = StageExecutor(stage, copy.deepcopy(stages[stage]), SGD(lr=LR),
                                                   loss_fn=mse if stage == last else None, policy=policy)
    return executors


def unit_data(batches, microbatches):
    return UnitData(None, UnitLayout(len(batches[0][0]), microbatches), lambda t: t, lambda _d, t: batches[t])


def weights(executors, schedule):
    out = []
    for stage, ranks in enumerate(schedule.stage_ranks):
        executor = executors[ranks[0]][stage]
        out.append({name: tensor.clone() for name, tensor in executor.versions.latest.items()})
    return out


def run_one_action_at_a_time(schedule, executors, data):
    """Every rank in turn, from the last, one action each: an interleaving the emulator never takes."""
    woken = set()
    mailboxes = Mailboxes(schedule, executors, woken.add)
    interpreters = [Interpreter(schedule, rank, executors[rank], data, data.layout, mailboxes.transport(rank))
                    for rank in range(len(schedule.programs))]
    positions = [0] * len(interpreters)
    ends = [len(p) for p in schedule.programs]
    while positions != ends:
        moved = False
        for rank in reversed(range(len(interpreters))):
            if positions[rank] < ends[rank]:
                reached = interpreters[rank].run(positions[rank], positions[rank] + 1)
                moved = moved or reached > positions[rank]
                positions[rank] = reached
        assert moved, f"no rank can proceed from {positions}"
    losses = {}
    for interpreter in interpreters:
        losses.update(interpreter.losses)
    return losses


def plain_training(stages, batches):
    """One update per batch: the gradient of the whole model, applied as pipetrain's SGD rounds."""
    params = [[p.detach().clone() for p in stage.parameters()] for stage in stages]
    for x, y in batches:
        leaves = [[p.clone().requires_grad_() for p in group] for group in params]
        out = x
        for stage, group in zip(stages, leaves):
            out = torch.func.functional_call(stage, {name: p for (name, _), p in zip(stage.named_parameters(), group)},
                                             (out,))
        grads = torch.autograd.grad(mse(out, y), [p for group in leaves for p in group])
        flat = iter(grads)
        params = [[torch.add(p, next(flat), alpha=-LR) for p in group] for group in params]
    return params


@pytest.mark.parametrize("name,ranks,chunks", [("gpipe", 3, 1), ("1f1b", 3, 1), ("zb-h1", 2, 1),
                                               ("interleaved", 2, 2)])
def test_synchronous_programs_equal_plain_training(name, ranks, chunks):
    """One microbatch per update: the pipeline runs plain training's operations in its order."""
    steps = 4
    schedule = build(name, ranks, 1 if chunks == 1 else ranks, steps=steps, chunks=chunks)
    microbatches = schedule.microbatches
    stages, batches = make_stages(schedule.num_stages), make_batches(steps * microbatches)
    if microbatches > 1:  # each update's units are one batch's microbatches: compare the same updates
        batches = [(torch.cat([x for x, _ in batches[t:t + microbatches]]),
                    torch.cat([y for _, y in batches[t:t + microbatches]]))
                   for t in range(0, len(batches), microbatches)]
    executors = make_executors(schedule, stages, schedule.policy)
    run_one_action_at_a_time(schedule, executors, unit_data(batches, microbatches))
    got = weights(executors, schedule)
    if microbatches == 1:
        for stage, expected in enumerate(plain_training(stages, batches)):
            for tensor, e in zip(got[stage].values(), expected):
                assert torch.equal(tensor, e), (name, stage)
    else:  # accumulated over microbatches, which plain training sums in another order
        for stage, expected in enumerate(plain_training(stages, batches)):
            for tensor, e in zip(got[stage].values(), expected):
                torch.testing.assert_close(tensor, e, rtol=1e-12, atol=1e-12)


def test_pipedream_program_reads_stashed_versions():
    """Stage s of a 3-stage PipeDream reads version max(0, k - (2 - s)) for minibatch k (docs/design.md 3.2)."""
    count = 3
    schedule = build("pipedream", count, 8)
    stages, batches = make_stages(count), make_batches(8)
    executors = make_executors(schedule, stages, "stash")
    run_one_action_at_a_time(schedule, executors, unit_data(batches, 1))
    history = [[[p.detach().clone() for p in stage.parameters()]] for stage in stages]
    for k, (x, y) in enumerate(batches):
        leaves = [[p.clone().requires_grad_() for p in history[s][max(0, k - (count - 1 - s))]] for s in range(count)]
        out = x
        for stage, group in zip(stages, leaves):
            out = torch.func.functional_call(stage, {n: p for (n, _), p in zip(stage.named_parameters(), group)}, (out,))
        grads = iter(torch.autograd.grad(mse(out, y), [p for group in leaves for p in group]))
        for s in range(count):
            history[s].append([torch.add(p, next(grads), alpha=-LR) for p in history[s][-1]])
    for s, got in enumerate(weights(executors, schedule)):
        for tensor, expected in zip(got.values(), history[s][-1]):
            assert torch.equal(tensor, expected)


@pytest.mark.parametrize("name,ranks,microbatches,kwargs", [
    ("1f1b", 3, 4, {"steps": 2}),
    ("zb-h1", 3, 4, {"steps": 2}),
    ("interleaved", 2, 4, {"chunks": 2, "steps": 2}),
    ("pipedream", 2, 8, {"replicas": [2, 1]}),
    ("2bw", 2, 2, {"steps": 3}),
])
def test_result_does_not_depend_on_interleaving(name, ranks, microbatches, kwargs):
    """The emulator's turns and one action per rank in reverse order compute the same bits: losses
    and weights (replicas' SYNC and zero-bubble W actions included)."""
    schedule = build(name, ranks, microbatches, **kwargs)
    m = microbatches if schedule.policy in ("flush", "2bw") else 1
    units = max(a.microbatch for p in schedule.programs for a in p if a.kind is Kind.F) + 1
    stages, batches = make_stages(schedule.num_stages), make_batches(units // m, size=4 * m)
    emulated = make_executors(schedule, stages, schedule.policy)
    emulator = Emulator(schedule, emulated, unit_data(batches, m))
    expected_losses = dict(emulator.run())
    interleaved = make_executors(schedule, stages, schedule.policy)
    losses = run_one_action_at_a_time(schedule, interleaved, unit_data(batches, m))
    assert losses == expected_losses and len(losses) == units
    for got, expected in zip(weights(interleaved, schedule), weights(emulated, schedule)):
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[n], expected[n]) for n in got)
    if "replicas" in kwargs:  # replicas hold the same weights after every SYNC
        for a, b in zip(interleaved[0][0].versions.latest.values(), interleaved[1][0].versions.latest.values()):
            assert torch.equal(a, b)


def test_a_receive_without_its_message_waits_at_its_action():
    schedule = build("1f1b", 2, 2)
    stages, batches = make_stages(2), make_batches(1, size=4)
    executors = make_executors(schedule, stages, "flush")
    data = unit_data(batches, 2)
    woken = []
    mailboxes = Mailboxes(schedule, executors, woken.append)
    second = Interpreter(schedule, 1, executors[1], data, data.layout, mailboxes.transport(1))
    first = Interpreter(schedule, 0, executors[0], data, data.layout, mailboxes.transport(0))
    program = schedule.programs[1]
    assert program[0].kind is Kind.RECV_F
    assert second.run(0, len(program)) == 0  # nothing sent yet: it stands at its receive
    reached = first.run(0, len(schedule.programs[0]))
    assert woken == [1] and schedule.programs[0][reached].kind is Kind.RECV_B
    assert second.run(0, len(program)) == len(program)
    assert sorted(second.losses) == [0, 1]


def test_tensors_only_refuses_another_output_at_the_forward():
    class Pair(nn.Module):
        def forward(self, x):
            return x, "label"

    schedule = build("gpipe", 2, 1)
    stages = [Pair(), nn.Linear(3, 3).double()]
    executors = make_executors(schedule, stages, "flush")
    data = unit_data(make_batches(1), 1)
    mailboxes = Mailboxes(schedule, executors, lambda rank: None)
    strict = Interpreter(schedule, 0, executors[0], data, data.layout, mailboxes.transport(0), tensors_only=True)
    with pytest.raises(PipetrainError, match="stage 0 returned a str; stages must pass tensors"):
        strict.run(0, 1)
    lenient = Interpreter(schedule, 0, make_executors(schedule, stages, "flush")[0], data, data.layout,
                          mailboxes.transport(0))
    assert lenient.run(0, 1) == 1 and lenient.local[("F", 1, 0)][1] == "label"
