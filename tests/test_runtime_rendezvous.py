"""Joining a run (pipetrain.runtime.rendezvous): each start of the workers agrees on keys of its own
in a store that outlives the starts (torchrun's), workers may start seconds apart, and local
sockets listen on loopback."""

from __future__ import annotations

import datetime
import re
import threading
import time

import pytest
import torch.distributed as dist

from pipetrain.runtime.errors import JoinError
from pipetrain.runtime.rendezvous import agree, interface_towards, loopback_interface, loopback_listener


def _store():
    listener = loopback_listener()  # on 127.0.0.1 only, as the launcher's store (left to itself: every interface)
    server = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                           master_listen_fd=listener.detach(), use_libuv=True)
    return server, lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                                         timeout=datetime.timedelta(seconds=10))


def _join(connect, world, timeout, delays):
    """``agree`` on one thread per rank, rank r starting ``delays[r]`` seconds late."""
    outcome: dict[int, object] = {}

    def rank_main(rank):
        time.sleep(delays[rank])
        try:
            outcome[rank] = agree(connect(), rank, world, timeout)
        except JoinError as error:
            outcome[rank] = error

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(delays))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return outcome


def test_a_start_agrees_on_fresh_keys_past_a_dead_start_and_late_workers():
    server, connect = _store()
    first = _join(connect, 3, 10.0, [0.0, 0.0, 0.0])
    assert len(set(first.values())) == 1 and all(isinstance(name, str) for name in first.values())
    # a start whose rank 0 died after naming its generation leaves that name behind
    connect().set("pipetrain/join/leader", "dead-start")
    # the next start: rank 2 first, rank 0 more than a second later (workers import for seconds)
    second = _join(connect, 3, 10.0, [1.2, 0.3, 0.0])
    names = set(second.values())
    assert len(names) == 1, second
    name = names.pop()
    assert isinstance(name, str) and name not in ("dead-start", first[0])
    assert connect().get("pipetrain/join/leader") == b""  # cleared: the start after finds no stale name
    del server


def test_a_worker_that_never_comes_is_named_after_the_timeout():
    server, connect = _store()
    started = time.monotonic()
    outcome = _join(connect, 3, 1.5, [0.0, 0.0])  # rank 2 never starts
    assert time.monotonic() - started < 10
    assert isinstance(outcome[0], JoinError) and "rank(s) 2 did not come" in str(outcome[0])
    assert re.search(r"^rank 0 waited 1\.\d s for the other workers to join", str(outcome[0]))  # the time it took
    assert isinstance(outcome[1], JoinError)
    assert re.search(r"^rank 1 waited 1\.\d s for rank 0 to start the run", str(outcome[1]))
    assert outcome[0].exit_status == 3  # a lost or timed-out peer
    del server


def test_local_sockets_are_on_loopback():
    listener = loopback_listener()
    try:
        assert listener.getsockname()[0] == "127.0.0.1" and listener.getsockname()[1] > 0
    finally:
        listener.close()
    name = loopback_interface()
    if name is None:
        pytest.skip("no loopback interface found")
    assert name.startswith("lo") and interface_towards("127.0.0.1") == name
