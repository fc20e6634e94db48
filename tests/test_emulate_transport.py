"""The emulator's in-process transport: mailboxes by unit, waits that wake, SYNC's rendezvous."""

import torch
import torch.nn as nn

from pipetrain.emulate.in_process import Mailboxes, all_reduce_sum
from pipetrain.execution import StageExecutor
from pipetrain.execution.interpreter import WAIT
from pipetrain.optim import SGD
from pipetrain.schedule import build
from pipetrain.schedule.ir import Kind


def first_of(schedule, rank, kind, microbatch=None):
    return next(a for a in schedule.programs[rank] if a.kind is kind and microbatch in (None, a.microbatch))


def replicas_with_gradients():
    """The two replicas of stage 0 of pipedream on replicas (2, 1), each after one backward."""
    schedule = build("pipedream", 2, 4, replicas=[2, 1])
    torch.manual_seed(0)
    module = nn.Linear(3, 3).double()
    executors = [{0: StageExecutor(0, nn.Linear(3, 3).double(), SGD(lr=0.1), policy="stash")} for _ in range(2)]
    executors.append({1: StageExecutor(1, module, SGD(lr=0.1), policy="stash")})
    for unit, rank in enumerate((0, 1)):
        replica = executors[rank][0]
        replica.versions.latest.update({n: p.detach().clone() for n, p in module.named_parameters()})
        out = replica.forward(unit, 0, torch.full((2, 3), float(unit + 1), dtype=torch.float64), samples=2)
        replica.backward(unit, 0, (torch.ones_like(out[0]),))
    return schedule, executors


def test_messages_wait_by_unit_and_wake_their_receiver():
    schedule = build("1f1b", 2, 3)
    woken = []
    boxes = Mailboxes(schedule, [{}, {}], woken.append)
    sender, receiver = boxes.transport(0), boxes.transport(1)
    receive = first_of(schedule, 1, Kind.RECV_F, 1)
    assert receiver.receive_activations(receive, 0) is WAIT
    payload = (torch.ones(2),)
    sender.send_activations(first_of(schedule, 0, Kind.SEND_F, 0), 0, (torch.zeros(2),), "labels 0", 0)
    assert woken == []  # rank 1 waits for unit 1, not unit 0
    sender.send_activations(first_of(schedule, 0, Kind.SEND_F, 1), 0, payload, "labels 1", 2)
    assert woken == [1]
    got = receiver.receive_activations(receive, 0)
    assert got[0] is payload and got[1:] == ("labels 1", 2)  # the exact tensors, never copies
    assert receiver.receive_activations(receive, 0) is WAIT  # a message is taken once
    grads = (None, torch.ones(3))
    receiver.send_gradients(first_of(schedule, 1, Kind.SEND_B, 0), 0, grads)
    assert sender.receive_gradients(first_of(schedule, 0, Kind.RECV_B, 0), 0) is grads


def test_sync_waits_for_every_replica_then_sums_in_replica_order():
    schedule, executors = replicas_with_gradients()
    parts = [dict(executors[r][0].grads) for r in (0, 1)]
    samples = [executors[r][0].pending_samples for r in (0, 1)]
    woken = []
    boxes = Mailboxes(schedule, executors, woken.append)
    assert not boxes.transport(0).all_reduce(0)  # replica 1 has not arrived
    assert torch.equal(executors[0][0].grads["weight"], parts[0]["weight"])
    assert boxes.transport(1).all_reduce(0) and woken == [0]
    assert boxes.transport(0).all_reduce(0)  # asked again: already summed, not summed twice
    for rank in (0, 1):
        replica = executors[rank][0]
        assert replica.pending_samples == sum(samples)
        for name in parts[0]:
            assert torch.equal(replica.grads[name], parts[0][name].clone().add_(parts[1][name]))
    assert executors[0][0].grads["weight"] is not executors[1][0].grads["weight"]


def test_all_reduce_sum_equals_the_transport_sync():
    schedule, executors = replicas_with_gradients()
    _, others = replicas_with_gradients()
    all_reduce_sum([others[0][0], others[1][0]])
    boxes = Mailboxes(schedule, executors, lambda rank: None)
    boxes.transport(0).all_reduce(0)
    boxes.transport(1).all_reduce(0)
    for name, tensor in others[0][0].grads.items():
        assert torch.equal(executors[0][0].grads[name], tensor)


def test_without_shared_parameters_a_step_never_waits():
    schedule = build("1f1b", 2, 2)
    boxes = Mailboxes(schedule, [{}, {}], lambda rank: None)
    step = next(p for p, a in enumerate(schedule.programs[0]) if a.kind is Kind.STEP)
    assert boxes.transport(0).sum_tied(step)
