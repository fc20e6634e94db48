"""Round-trip latency and bandwidth of gloo point-to-point transfer between two local processes.

Each process is pinned to one core with one thread (pipetrain's launcher). Rows (ping-pong of
one tensor, rank 0 -> rank 1 -> rank 0):

* ``send/recv``        plain blocking ``dist.send`` / ``dist.recv`` of the bare tensor (the
                       receiver knows the shape: what a static-shape runtime does);
* ``isend/irecv``      the same with ``dist.isend`` / ``dist.irecv`` and ``wait()``;
* ``pg.send/recv``     the bare tensor through the ProcessGroup object directly, skipping the
                       Python checks of ``dist.isend`` (what the Messenger calls);
* ``header+data``      a fixed 32-word int64 header message, then the tensor (two messages);
* ``messenger``        pipetrain's ``Messenger`` (one message: inline header + tensor bytes,
                       packed on send, zero-copy views on receive);
* ``messenger tuple``  a Messenger transfer of a 2-tuple (the tensor and a 1-element label).

Usage::

    PYTHONPATH=src python benchmarks/p2p_latency.py [--iters 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from pipetrain.runtime.launch import init_distributed, launch
from pipetrain.runtime.p2p import Messenger

SHAPES = {"small 32x256": (32, 256), "large 128x1024": (128, 1024)}


def _pingpong(rank: int, fn_send, fn_recv, iters: int) -> list[float]:
    """Per-iteration round-trip times (the median resists noise from other processes)."""
    dist.barrier()
    times = []
    clock = time.perf_counter
    for _ in range(iters):
        start = clock()
        if rank == 0:
            fn_send()
            fn_recv()
        else:
            fn_recv()
            fn_send()
        times.append(clock() - start)
    return times


def _worker(iters: int, repeats: int) -> dict[str, dict[str, tuple[float, float]]] | None:
    env = init_distributed("gloo", timeout=120)
    rank, peer = env.rank, 1 - env.rank
    m = Messenger(timeout=120)
    pg = dist.group.WORLD
    results: dict[str, dict[str, tuple[float, float]]] = {}
    for label, shape in SHAPES.items():
        x = torch.randn(shape)
        buf = torch.empty(shape)
        header = torch.zeros(32, dtype=torch.int64)
        hbuf = torch.empty(32, dtype=torch.int64)
        label_t = torch.arange(shape[0])
        n = iters if shape[0] * shape[1] <= 32 * 256 else max(iters // 4, 50)

        def m_send(payload=x):
            m.isend(payload, peer, "act").wait()

        def m_recv():
            m.irecv(peer, "act").wait()

        def t_send():
            m.isend((x, label_t), peer, "tuple").wait()

        def t_recv():
            m.irecv(peer, "tuple").wait()

        rows = {
            "send/recv": (lambda: dist.send(x, peer), lambda: dist.recv(buf, peer)),
            "isend/irecv": (lambda: dist.isend(x, peer).wait(), lambda: dist.irecv(buf, peer).wait()),
            "pg.send/recv": (
                lambda: pg.send([x], peer, 0).wait(),
                lambda: pg.recv([buf], peer, 0).wait(),
            ),
            "header+data": (
                lambda: [w.wait() for w in (dist.isend(header, peer, tag=1), dist.isend(x, peer))],
                lambda: [w.wait() for w in (dist.irecv(hbuf, peer, tag=1), dist.irecv(buf, peer))],
            ),
            "messenger": (m_send, m_recv),
            "messenger tuple": (t_send, t_recv),
        }
        for name, (s, r) in rows.items():
            _pingpong(rank, s, r, max(n // 10, 10))  # warm-up (and the messenger's first header)
            times = sorted(t for _ in range(repeats) for t in _pingpong(rank, s, r, n))
            results.setdefault(label, {})[name] = (times[len(times) // 2], times[len(times) // 10])
    return results if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    result = launch(_worker, (args.iters, args.repeats), 2, threads_per_worker=1, timeout=600)
    if result.returncode != 0:
        raise SystemExit(result.returncode)
    table = result.results[0]
    print("gloo ping-pong between 2 processes, 1 thread and 1 core each")
    print(f"{'tensor':16s} {'method':16s} {'median RTT us':>14s} {'p10 RTT us':>11s} {'one-way MB/s':>13s}")
    for label, rows in table.items():
        shape = SHAPES[label]
        nbytes = shape[0] * shape[1] * 4
        for name, (median, p10) in rows.items():
            print(f"{label:16s} {name:16s} {median * 1e6:14.1f} {p10 * 1e6:11.1f} {nbytes / (median / 2) / 1e6:13.1f}")


if __name__ == "__main__":
    main()
