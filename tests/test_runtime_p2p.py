"""Point-to-point transfer between real gloo processes (pipetrain.runtime.p2p)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from pipetrain.runtime.launch import init_distributed, launch
from pipetrain.runtime.p2p import ACTIVATIONS, GRADIENTS, LABELS, Messenger

LIMIT = 60  # seconds: the launcher kills every worker after this, so no test can hang


def run(fn, *args, nprocs=2, expect_ok=True):
    result = launch(fn, args, nprocs, timeout=LIMIT, grace=2.0, quiet=True)
    if expect_ok:
        assert result.returncode == 0, result
    return result


def payloads():
    """What rank 0 sends, in order: every dtype, odd shapes, tuples, shape changes, repeats."""
    g = torch.Generator().manual_seed(0)
    out = []
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        out.append(torch.randn(3, 5, generator=g).to(dtype))
    for dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        out.append(torch.randint(-100 if dtype != torch.uint8 else 0, 100, (7,), generator=g).to(dtype))
    out.append(torch.rand(4, 4, generator=g) > 0.5)
    out.append(torch.randn(2, 3, generator=g, dtype=torch.complex64))
    out.append(torch.randn(5, generator=g, dtype=torch.complex128).conj())  # conjugate view
    out.append(torch.tensor(3.25))  # 0-dim
    out.append(torch.empty(0, 4))  # empty
    out.append(torch.randn(4, 6, generator=g).t())  # not contiguous
    out.append(torch.randn(2, 3, 4, 5, generator=g, requires_grad=True))  # requires grad
    out.append((torch.randn(32, 16, generator=g), torch.arange(32)))  # tuple
    out.append((torch.randn(1, generator=g),))  # 1-tuple stays a tuple
    out.append(())  # empty tuple
    for rows in (32, 32, 32, 7, 7, 32, 1):  # same shape repeated, shrink, grow
        out.append(torch.randn(rows, 8, generator=g))
    out.append(torch.randn(128, 1024, generator=g))  # 512 KiB
    out.append(torch.randn(2, 2, generator=g))  # and back to tiny
    # structured payloads (wire form STRUCTURED): the receiver builds exactly what was sent
    ids, mask = torch.arange(12).view(3, 4), torch.rand(3, 4, generator=g) > 0.5
    out.append({"input_ids": ids, "attention_mask": mask})
    out.append({"input_ids": ids, "attention_mask": mask})  # the same structure again (cached)
    out.append(((torch.randn(3, 2, generator=g), ids), [mask, {"deep": torch.tensor(1.5)}]))
    out.append([torch.randn(2, generator=g), ids])  # a list stays a list
    out.append({"h": torch.randn(5, 2, generator=g), "key with \"quotes\"": ids[:1]})
    out.append((torch.randn(2, generator=g), torch.randn(2, generator=g)))  # back to a flat tuple
    return out


def _roundtrip_worker():
    env = init_distributed("gloo", timeout=LIMIT)
    m = Messenger(timeout=30)
    sent = payloads()
    if env.rank == 0:
        handles = [m.isend(p, 1, ACTIVATIONS, tag=i, info=(i, -i, 2**40)) for i, p in enumerate(sent)]
        m.send(torch.ones(3), 1, LABELS)
        m.send(torch.full((2,), 9.0), 1, GRADIENTS)
        for h in handles:
            h.wait()
        return None
    # Receive labels and gradients first, posted before the activations they follow on the wire:
    # channels of different kinds are independent.
    grads = m.irecv(0, GRADIENTS)
    labels = m.irecv(0, LABELS)
    # Post several receives of one channel ahead of waiting (later ones are chained).
    handles = [m.irecv(0, ACTIVATIONS, expect_tag=i, what=f"RECV_F {i}") for i in range(len(sent))]
    got = []
    for h in handles:
        x = h.wait()
        got.append((x, h.tag, h.info))
    return got, labels.wait(), grads.wait()


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.detach().resolve_conj(), b)
        )
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return type(b) is type(a) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def test_roundtrip_every_dtype_shape_and_tuple():
    result = run(_roundtrip_worker)
    got, labels, grads = result.results[1]
    sent = payloads()
    assert len(got) == len(sent)
    for i, (p, (x, tag, info)) in enumerate(zip(sent, got)):
        assert _same(p, x), (i, p, x)
        assert tag == i and info == (i, -i, 2**40)
    assert torch.equal(labels, torch.ones(3))
    assert torch.equal(grads, torch.full((2,), 9.0))


def _chain_worker(sizes):
    """Three stages: activations 0 -> 1 -> 2, gradients 2 -> 1 -> 0, microbatches of changing size."""
    env = init_distributed("gloo", timeout=LIMIT)
    rank = env.rank
    m = Messenger(timeout=30)
    results = []
    pending = []
    for k, rows in enumerate(sizes):
        if rank == 0:
            pending.append(m.isend(torch.full((rows, 4), float(k)), 1, ACTIVATIONS, tag=k))
        else:
            x = m.irecv(rank - 1, ACTIVATIONS, expect_tag=k).wait()
            if rank == 1:
                pending.append(m.isend((x + 1, x.sum().reshape(1)), 2, ACTIVATIONS, tag=k))
            else:
                a, s = x
                results.append((a.clone(), s.clone()))
    for k, rows in enumerate(sizes):
        if rank == 2:
            pending.append(m.isend(torch.full((rows, 4), -float(k), dtype=torch.float64), 1, GRADIENTS, tag=k))
        else:
            g = m.irecv(rank + 1, GRADIENTS, expect_tag=k).wait()
            if rank == 1:
                pending.append(m.isend(g * 2, 0, GRADIENTS, tag=k))
            else:
                results.append(g.clone())
    for h in pending:
        h.wait()
    return results


def test_three_stage_chain_with_changing_microbatch_sizes():
    sizes = [4, 4, 4, 3, 4, 1, 1]
    result = run(_chain_worker, sizes, nprocs=3)
    last, first = result.results[2], result.results[0]
    for k, rows in enumerate(sizes):
        a, s = last[k]
        assert torch.equal(a, torch.full((rows, 4), k + 1.0))
        assert torch.equal(s, torch.tensor([rows * 4.0 * k]))
        assert torch.equal(first[k], torch.full((rows, 4), -2.0 * k, dtype=torch.float64))


def _timeout_worker():
    from pipetrain.errors import PipetrainError
    from pipetrain.runtime.errors import PeerTimeoutError, ProtocolError

    class Board:  # the part of a StatusBoard the messenger writes
        waiting = peer = None

        def report(self, gone=None):
            return "(status)"

    env = init_distributed("gloo", timeout=LIMIT)
    board = Board()
    m = Messenger(timeout=30, status=board if env.rank == 1 else None)
    if env.rank == 0:
        m.send(torch.ones(2), 1, ACTIVATIONS, tag=5)
        try:
            m.send([torch.ones(1), 3], 1, ACTIVATIONS)
        except PipetrainError as error:
            bad_payload = str(error)
        try:
            m.send(torch.ones(2, dtype=torch.float8_e4m3fn), 1, ACTIVATIONS)
        except PipetrainError as error:
            bad_dtype = str(error)
        time.sleep(3)  # never sends what rank 1 waits for next; outlives its timeout
        return bad_payload, bad_dtype
    try:
        m.irecv(0, ACTIVATIONS, expect_tag=4, what="RECV_F of microbatch 4 from rank 0").wait()
    except ProtocolError as error:
        mismatch = str(error)
    cleared = board.waiting is None  # the message arrived: nothing is waited for
    start = time.monotonic()
    try:
        m.irecv(0, ACTIVATIONS, what="RECV_F of microbatch 3 from rank 0").wait(timeout=1.0)
    except PeerTimeoutError as error:
        # a wait that failed stays on the board: the rank's last record names what it gave up on
        return mismatch, str(error), time.monotonic() - start, cleared, (str(board.waiting), board.peer)
    return mismatch, "no timeout", 0.0, cleared, None


def test_timeout_names_the_action_and_mismatches_are_caught():
    result = run(_timeout_worker)
    bad_payload, bad_dtype = result.results[0]
    assert "can only send tensors" in bad_payload and "[1] is of type int" in bad_payload
    assert "float8_e4m3fn" in bad_dtype and "supported" in bad_dtype
    mismatch, message, elapsed, cleared, left = result.results[1]
    assert "expected tag 4" in mismatch and "sent tag 5" in mismatch
    assert "RECV_F of microbatch 3 from rank 0" in message and message.endswith("(status)")
    assert cleared and left == ("RECV_F of microbatch 3 from rank 0", 0)
    assert "timed out after 1 s" in message and "rank 1" in message
    assert 0.9 < elapsed < 5.0


def _dead_peer_worker():
    from pipetrain.runtime.errors import PeerLostError

    env = init_distributed("gloo", timeout=LIMIT)
    m = Messenger(timeout=30)
    if env.rank == 0:
        m.send(torch.ones(2), 1, ACTIVATIONS)
        time.sleep(0.5)
        os._exit(5)  # dies without a word
    m.recv(0, ACTIVATIONS)
    start = time.monotonic()
    try:
        m.recv(0, GRADIENTS, what="RECV_B of microbatch 0 from rank 0")
    except PeerLostError as error:
        return str(error), time.monotonic() - start
    return "no error", 0.0


def test_dead_peer_is_reported_quickly():
    result = run(_dead_peer_worker, expect_ok=False)
    assert result.exitcodes[0] == 5
    message, elapsed = result.results[1]
    assert "lost rank 0" in message and "RECV_B of microbatch 0 from rank 0" in message
    assert "died or exited" in message
    assert elapsed < 10.0  # far below the 30 s timeout


def _collective_worker():
    import torch.distributed as dist

    from pipetrain.runtime.errors import PeerTimeoutError

    env = init_distributed("gloo", timeout=LIMIT)
    m = Messenger(timeout=30)
    if env.rank == 2:
        time.sleep(3)  # never joins the all-reduce
        return None
    work = dist.all_reduce(torch.ones(4), async_op=True)
    try:
        m.guard(work, f"SYNC of stage 0 (replica {env.rank})", timeout=1.0)
    except PeerTimeoutError as error:
        return str(error)
    return "no timeout"


def test_guarded_collective_times_out_with_the_action_named():
    result = run(_collective_worker, nprocs=3)
    for rank in (0, 1):
        message = result.results[rank]
        assert f"rank {rank} timed out after 1 s waiting for SYNC of stage 0 (replica {rank})" in message


def _tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


def _tiny_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(11, 6, generator=g), torch.randint(0, 3, (11,), generator=g)


def _two_stage_training_worker(steps, microbatches):
    """GPipe order over the Messenger: stage 0 = first 2 modules, stage 1 = the rest."""
    env = init_distributed("gloo", timeout=LIMIT)
    model = _tiny_model()
    module = model[:2] if env.rank == 0 else model[2:]
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    x, y = _tiny_data()
    xs, ys = x.chunk(microbatches), y.chunk(microbatches)  # 11 = 4 + 4 + 3: a smaller last one
    m = Messenger(timeout=30)
    for _ in range(steps):
        if env.rank == 0:
            outs = [module(xb) for xb in xs]
            sends = [m.isend(o, 1, ACTIVATIONS, tag=k) for k, o in enumerate(outs)]
            for k, o in enumerate(outs):
                o.backward(m.recv(1, GRADIENTS, expect_tag=k))
            for h in sends:
                h.wait()
        else:
            for k, yb in enumerate(ys):
                xb = m.recv(0, ACTIVATIONS, expect_tag=k).requires_grad_(True)
                torch.nn.functional.cross_entropy(module(xb), yb, reduction="sum").backward()
                m.send(xb.grad, 0, GRADIENTS, tag=k)
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in module.parameters()]


def test_two_stage_training_over_the_messenger_matches_one_process():
    steps, microbatches = 3, 3
    result = run(_two_stage_training_worker, steps, microbatches)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _tiny_data()
        for _ in range(steps):
            for xb, yb in zip(x.chunk(microbatches), y.chunk(microbatches)):
                torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum").backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    expected = [p.detach() for p in model.parameters()]
    got = result.results[0] + result.results[1]
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def test_the_wire_describes_a_structured_payload_and_leaves_the_fast_path_alone():
    from pipetrain.runtime import wire

    tensors = (torch.zeros(2, 3), torch.ones(4, dtype=torch.int64))
    plain = wire.meta_words(tensors, single=False)
    assert wire.parse_meta(plain)[:2] == (wire.TUPLE, None) and plain[0] == wire.TUPLE
    assert wire.parse_meta(wire.meta_words(tensors[:1], single=True))[:2] == (wire.SINGLE, None)
    text = '{"input_ids":*,"pair":(*,)}'
    words = wire.meta_words(tensors, single=False, structure=text)
    form, structure, layout = wire.parse_meta(words)
    assert (form, structure) == (wire.STRUCTURED, text)
    assert [(dtype, shape) for dtype, shape, *_ in layout] == [(torch.float32, (2, 3)), (torch.int64, (4,))]
    assert layout[0][2] == (wire.PREFIX + len(words)) * 8 and (wire.PREFIX + len(words)) % 2 == 0
    assert len(words) > len(plain)  # the structure is in the header; the tensors' layout follows it


def test_a_payload_with_something_other_than_tensors_is_refused_by_path():
    from pipetrain.errors import PipetrainError
    from pipetrain.runtime.p2p import _normalize

    assert _normalize(torch.ones(1))[1:] == (True, None)
    assert _normalize((torch.ones(1),))[1:] == (False, None)
    leaves, single, text = _normalize({"a": torch.ones(1), "b": [torch.zeros(2)]})
    assert text == '{"a":*,"b":[*]}' and len(leaves) == 2 and not single
    with pytest.raises(PipetrainError, match=r"\['b'\]\[1\] is of type str"):
        _normalize({"a": torch.ones(1), "b": [torch.zeros(2), "x"]})
