"""The runtime's transport (pipetrain.runtime.distributed_transport) between two real gloo processes: what one
stage sends is what the next receives, structure, labels and gradient gaps included, whether
receives are posted ahead of need or on demand."""

from __future__ import annotations

import pytest
import torch

from pipetrain.runtime.launch import init_distributed, launch
from pipetrain.runtime.p2p import Messenger
from pipetrain.runtime.distributed_transport import DistributedTransport, _unmask
from pipetrain.schedule.ir import Kind
from pipetrain.schedule.messages import Messages
from pipetrain.schedule.presets import build

LIMIT = 60  # seconds: the launcher kills every worker after this, so no test can hang


def activations(microbatch: int):
    """Stage 0's output of a microbatch: a float tensor and a mask needing no gradient, in a dict."""
    g = torch.Generator().manual_seed(microbatch)
    return {"hidden": torch.randn(3, 4, generator=g), "mask": torch.rand(3, 4, generator=g) > 0.5}


def labels(microbatch: int):
    return torch.arange(3) + 10 * microbatch


def gradients(microbatch: int):
    """Gradients of a stage's inputs, with gaps (inputs that take none, like a mask)."""
    g = torch.Generator().manual_seed(100 + microbatch)
    return (torch.randn(3, 4, generator=g), None, torch.randn(2, generator=g), None)


def _pipe(receives: str) -> None:
    env = init_distributed("gloo", timeout=LIMIT)
    schedule = build("gpipe", 2, 3, steps=1)
    transport = DistributedTransport(schedule, env.rank, {}, Messenger(timeout=30), {}, Messages(schedule))
    transport.begin(receives, {}, [], 0, None)
    assert transport.on_demand is (receives == "on-demand")
    for position, action in enumerate(schedule.programs[env.rank]):
        m = action.microbatch
        if action.kind is Kind.SEND_F:
            transport.send_activations(action, position, activations(m), labels(m), constants=1)
        elif action.kind is Kind.RECV_F:
            inputs, got_labels, constants = transport.receive_activations(action, position)
            expected = activations(m)
            assert set(inputs) == {"hidden", "mask"} and constants == 1
            assert torch.equal(inputs["hidden"], expected["hidden"]) and torch.equal(inputs["mask"], expected["mask"])
            assert torch.equal(got_labels, labels(m))
        elif action.kind is Kind.SEND_B:
            transport.send_gradients(action, position, gradients(m))
        elif action.kind is Kind.RECV_B:
            got, sent = transport.receive_gradients(action, position), gradients(m)
            # the gaps come back in place; trailing ones may go (a stage reads a missing one as none)
            assert len(got) == 3 and got[1] is None and torch.equal(got[0], sent[0]) and torch.equal(got[2], sent[2])
    transport.drain()
    assert transport.sum_tied(0)  # nothing shared between the stages: nothing to sum


@pytest.mark.parametrize("receives", ["ahead", "on-demand"])
def test_what_a_stage_sends_the_next_receives(receives):
    result = launch(_pipe, (receives,), 2, timeout=LIMIT, grace=2.0, quiet=True)
    assert result.returncode == 0, result


def test_gradients_travel_without_their_gaps_and_come_back_with_them_in_place():
    one, two = torch.ones(1), torch.zeros(2)
    assert _unmask((one, two), 0b101) == (one, None, two)
    assert _unmask((one,), 0b1) == (one,)
    assert _unmask((), 0b0) == ()
    assert _unmask(one, None) == (one,)  # no mask: every gradient present
