"""Joining a run: each start of the workers is a generation with store keys of its own, and
every socket a worker opens listens on the interface that reaches the run's store.

torchrun's agents keep one TCPStore for all restarts of a job, and torch's process group writes
the same keys in it at every start: a restarted worker read a peer's address left by the dead
previous start and failed with "Gloo connectFullMesh failed ... Connection refused" (3 of 4
restarts). So under torchrun the workers first agree on a fresh generation: rank 0 names one (a
random id), every other rank registers under the name it reads, and rank 0 announces the
generation once all have, having cleared the name, so that the next start finds no stale one::

    rank 0:  set  join/leader = G        (G fresh)      rank r:  read join/leader -> G
             wait until ranks 1..W-1 registered under G          set  join/G/rank/r
             clear join/leader; set join/G/go                    wait for join/G/go (re-reading the
                                                                 leader, which may still be stale)

Every key of the run (the process group's, the status board's, the checkpoints') then lives
under ``pipetrain/G/``. Waiting is polled within the run's timeout, so workers may start
seconds apart (pipetrain's take several seconds to import). pipetrain's own launcher hosts a
new store for every start and names the generation itself (``PIPETRAIN_GENERATION``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import time
import uuid
from typing import Any

import torch.distributed as dist

from pipetrain.errors import option
from pipetrain.runtime.errors import JoinError

__all__ = ["GENERATION", "generation", "run_store", "agree", "loopback_listener", "loopback_interface",
           "interface_towards"]

#: The environment variable that names this start's generation of workers.
GENERATION = "PIPETRAIN_GENERATION"
_POLL = 0.05


def generation() -> str:
    """This worker's generation: set by pipetrain's launcher, or by :func:`agree` under torchrun."""
    return os.environ.get(GENERATION, "0")


def run_store(store: Any, name: str | None = None) -> Any:
    """``store`` seen through the key prefix of generation ``name`` (default: this worker's)."""
    return dist.PrefixStore(f"pipetrain/{generation() if name is None else name}/", store)


def agree(store: Any, rank: int, world_size: int, timeout: float) -> str:
    """The generation of this start of the workers, agreed by all ``world_size`` ranks through
    ``store`` (see the module docstring) within ``timeout`` seconds; raises
    :class:`~pipetrain.runtime.errors.JoinError` naming who did not come."""
    started = time.monotonic()
    deadline = started + timeout
    leader = "pipetrain/join/leader"
    if rank == 0:
        name = uuid.uuid4().hex[:16]
        store.set(leader, name)
        waiting = list(range(1, world_size))
        while waiting:
            waiting = [r for r in waiting if not store.check([f"pipetrain/join/{name}/rank/{r}"])]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise JoinError(
                    f"rank 0 waited {time.monotonic() - started:.1f} s for the other workers to join; rank(s) "
                    f"{', '.join(map(str, waiting))} did not come (not started, or dead); check that every worker "
                    f"started, or raise {option('timeout')} if they start this late"
                )
            time.sleep(_POLL)
        # cleared, not deleted: a rank that found the key a moment ago reads it next, and a get of a
        # key deleted in between would wait out the store's timeout
        store.set(leader, "")
        store.set(f"pipetrain/join/{name}/go", "1")
        return name
    registered = None
    while True:
        if store.check([leader]):
            name = store.get(leader).decode()
            if name and name != registered:  # the first name read, or a newer one (the first was a dead start's)
                store.set(f"pipetrain/join/{name}/rank/{rank}", "1")
                registered = name
        if registered is not None and store.check([f"pipetrain/join/{registered}/go"]):
            return registered
        if time.monotonic() > deadline:
            raise JoinError(
                f"rank {rank} waited {time.monotonic() - started:.1f} s for rank 0 to start the run"
                + ("" if registered is None else " (it named a start that never began: a dead one's?)")
                + f"; check that every worker started, or raise {option('timeout')} if they start this late"
            )
        time.sleep(_POLL)


def loopback_listener() -> socket.socket:
    """A listening TCP socket on 127.0.0.1, on a free port (a TCPStore server takes it over:
    left to itself, the server listens on every interface)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    return listener


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux), or None if none is found."""
    return _interface_of("127.0.0.1")


def interface_towards(address: str, port: int = 9) -> str | None:
    """The name of the network interface this machine uses to reach ``address``: where gloo
    should listen for its peers. None if it cannot be told (then gloo picks one itself)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, port))  # no packet is sent: this only asks for the route
            local = probe.getsockname()[0]
    except OSError:
        return None
    return _interface_of(local)


def _interface_of(ipv4: str) -> str | None:
    """The interface holding IPv4 address ``ipv4`` (Linux: SIOCGIFADDR on each interface)."""
    if ipv4.startswith("127."):
        candidates = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
        if candidates:
            return candidates[0]
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for name in names:
            try:
                answer = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(answer[20:24]) == ipv4:
                return name
    return None
