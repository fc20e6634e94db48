"""Watching the workers of a local run: start them, reap them, report the first failure truthfully,
and start them again (``restarts``) when a failure is not the user's.

The launcher hosts the run's TCPStore on 127.0.0.1 (a server left to itself listens on every
interface) and keeps gloo on the loopback interface, so nothing of a local run is reachable from
another machine. Every start of the workers is a new generation (:mod:`pipetrain.runtime.rendezvous`)
with a store of its own.

Exit statuses, the command's too: 0; 2 for a user error (bad data, a NaN loss, a mismatched
stage: the worker's own message is the run's one message); 3 for a lost or timed-out peer; 128+N
for a worker killed by signal N; 124 when ``timeout`` ran out; 130 on Ctrl-C, 143 on SIGTERM. Peers of a dead rank
exit within milliseconds of it (status 3), so the launcher names the primary failure, and when
only peers' failures are seen (a rank stopped by SIGSTOP, or one that hangs), the rank the
status board shows the others waiting for.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch.distributed as dist

from pipetrain.errors import PipetrainError, option, written
from pipetrain.runtime.rendezvous import GENERATION, loopback_interface, loopback_listener, run_store
from pipetrain.runtime.status import diagnose, format_status, read_errors, read_status

__all__ = ["LaunchResult", "run_workers", "describe_exit", "EXIT_USER_ERROR", "EXIT_PEER_FAILURE",
           "restartable"]

#: Exit status of a worker that stopped on a PipetrainError of its own (a user error).
EXIT_USER_ERROR = 2
#: Exit status of a worker that stopped because of another rank (lost peer, timeout): a secondary
#: failure; the launcher names a primary failure first when it sees both.
EXIT_PEER_FAILURE = 3


#: With a restart to come, or after a worker was killed by a signal, the seconds the other workers
#: get to end on their own after a failure (instead of ``grace``): their reports would only echo the
#: failure, the restart waits for them, and a rank still setting up (building its model, measuring
#: its stages) would not notice the dead one before it communicates.
RESTART_GRACE = 1.0


def restartable(code: int) -> bool:
    """Whether a run that ended with status ``code`` is worth starting again: not a user error
    (it would fail the same way) and not an interruption."""
    return code not in (0, EXIT_USER_ERROR, 130)


@dataclass
class LaunchResult:
    """How the workers ended. ``returncode`` 0 means all succeeded; ``results[r]`` is what rank
    r's entry function returned (None if it failed or returned nothing); ``restarts``: how many
    times the workers were started again."""

    returncode: int
    results: list[Any] = field(default_factory=list)
    exitcodes: list[int | None] = field(default_factory=list)
    message: str = ""
    restarts: int = 0
    interrupted: bool = False  # stopped by Ctrl-C or SIGTERM: never started again


def describe_exit(code: int) -> str:
    """``"was killed by SIGKILL"`` or ``"exited with status 3"``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def run_workers(
    command: list[str],
    nprocs: int,
    *,
    threads_per_worker: int,
    cores: Sequence[Sequence[int]] | None,
    grace: float,
    timeout: float | None,
    env: Mapping[str, str],
    quiet: bool,
    restarts: int = 0,
    silence: float | None = None,
) -> LaunchResult:
    """Start ``command`` once per rank with the distributed environment set, watch and reap them;
    after a failure that :func:`restartable` allows, start them all again, up to ``restarts``
    times (the workers resume from their checkpoints themselves). ``silence``: seconds after
    which a rank whose status board stopped publishing is stopped or frozen (:func:`_watch`)."""
    if nprocs < 1:
        raise PipetrainError(f"need at least one worker, got {nprocs}")
    if threads_per_worker < 1:
        raise PipetrainError(f"{option('threads_per_worker')} must be at least 1, got {threads_per_worker}")

    def say(text: str) -> None:
        if not quiet:
            print(f"pipetrain launch: {text}", file=sys.stderr, flush=True)

    attempt = 0
    while True:
        result = _start(command, nprocs, attempt, threads_per_worker=threads_per_worker, cores=cores,
                        grace=grace if attempt >= restarts else min(grace, RESTART_GRACE), timeout=timeout, env=env,
                        say=say, silence=silence)
        result.restarts = attempt
        if result.returncode == 0 or result.interrupted or attempt >= restarts or not restartable(result.returncode):
            return result
        attempt += 1
        say(f"{result.message or describe_exit(result.returncode)}: starting the workers again "
            f"(restart {attempt} of {restarts})")


def _start(
    command: list[str],
    nprocs: int,
    attempt: int,
    *,
    threads_per_worker: int,
    cores: Sequence[Sequence[int]] | None,
    grace: float,
    timeout: float | None,
    env: Mapping[str, str],
    say: Callable[[str], None],
    silence: float | None = None,
) -> LaunchResult:
    """One start of the workers (generation ``attempt``), watched to its end."""
    listener = loopback_listener()
    port = listener.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, world_size=nprocs, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30), master_listen_fd=listener.detach(), use_libuv=True,
    )  # fmt: skip
    base = dict(os.environ)
    base.update(env)
    path = [p for p in sys.path if p]
    base["PYTHONPATH"] = os.pathsep.join(path + [base["PYTHONPATH"]] if base.get("PYTHONPATH") else path)
    base.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(nprocs),
        LOCAL_WORLD_SIZE=str(nprocs),
        GROUP_RANK="0",
        TORCHELASTIC_USE_AGENT_STORE="True",  # every rank is a client of the store hosted here
        PIPETRAIN_LAUNCHER="1",
        PIPETRAIN_THREADS=str(threads_per_worker),
        PIPETRAIN_PARENT=str(os.getpid()),
        PIPETRAIN_RESTART=str(attempt),
        OMP_NUM_THREADS=str(threads_per_worker),
        MKL_NUM_THREADS=str(threads_per_worker),
    )
    base[GENERATION] = str(attempt)
    interface = loopback_interface()
    if interface is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
        base["GLOO_SOCKET_IFNAME"] = interface
    for key in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        base.pop(key, None)

    procs: list[subprocess.Popen[bytes]] = []
    result = LaunchResult(returncode=0)
    old_term = None
    try:
        if _in_main_thread():
            old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        for rank in range(nprocs):
            wenv = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
            if cores is not None:
                wenv["PIPETRAIN_CPUS"] = ",".join(map(str, cores[rank]))
            procs.append(subprocess.Popen(command, env=wenv, start_new_session=True))
        result = _watch(procs, run_store(store, str(attempt)), grace, timeout, say, silence)
    except KeyboardInterrupt as interrupt:
        how = "terminated by SIGTERM" if isinstance(interrupt, _Terminated) else "interrupted"
        say(f"{how}: stopping every worker")
        _stop(procs, 3.0)
        result = LaunchResult(returncode=128 + signal.SIGTERM if isinstance(interrupt, _Terminated) else 130,
                              message=how, interrupted=True)
    finally:
        _stop(procs, 3.0)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        result.exitcodes = [p.poll() for p in procs]
        del store
    return result


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class _Terminated(KeyboardInterrupt):
    """SIGTERM while the launcher watches: stop as on Ctrl-C, and exit 143 (128 + SIGTERM) as a
    terminated process does."""


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise _Terminated


def _watch(
    procs: list[subprocess.Popen[bytes]],
    store: Any,
    grace: float,
    timeout: float | None,
    say: Callable[[str], None],
    silence: float | None = None,
) -> LaunchResult:
    """Reap the workers and name the first failure. With ``silence`` (the run's timeout), a rank
    whose status board has not published for that long is stopped or frozen: it is killed and
    named, the run ending ``silence`` seconds after it was last heard, whatever its peers were
    doing meanwhile (a peer that went on computing would time out only ``silence`` seconds after
    its own wait began)."""
    start = time.monotonic()
    listened = start  # when the boards were last read for silence
    first: tuple[int, int] | None = None
    stop_at: float | None = None
    waited = grace
    message = ""
    world = len(procs)
    while True:
        codes = [p.poll() for p in procs]
        if first is None:
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                # Peers of a dead rank exit within milliseconds of it: name the cause, not them.
                first = min(failed, key=lambda rc: (rc[1] >= 0, rc[1] == EXIT_PEER_FAILURE, rc[0]))
                errors = read_errors(store, world) if first[1] > 0 and first[1] != EXIT_PEER_FAILURE else {}
                if first[0] in errors:  # the worker's own error (bad data, a lost data worker): the run's one message
                    message = errors[first[0]]
                else:
                    # ranks that failed on their own (not by losing a peer) are the causes others wait for
                    gone = {r: describe_exit(c) for r, c in failed if c != EXIT_PEER_FAILURE}
                    records = read_status(store, world, timeout=1.0)
                    silent = _silent(procs, records)
                    message = f"worker rank {first[0]} {describe_exit(first[1])}"
                    if first[1] == EXIT_PEER_FAILURE:
                        message += " (it lost a peer or timed out waiting for one)"
                        causes = diagnose(records, gone=gone) if records else []
                        if causes:  # the rank the others waited for, named last: the line a reader sees
                            peer, state, waiters = causes[0]
                            message += f"; rank {peer} {state} (rank(s) {', '.join(map(str, waiters))} waited for it)"
                        elif silent:  # its peer's last record no longer shows the wait: the board still knows
                            message += (f"; rank(s) {', '.join(map(str, silent))} fell silent: stopped (SIGSTOP, for "
                                        "instance) or frozen")
                        finished = [r for r, c in enumerate(codes) if c == 0]
                        if finished:
                            message += (
                                f"; rank(s) {', '.join(map(str, finished))} had already finished "
                                "normally, before the others (do the programs match?)"
                            )
                    say(f"{message}; stopping the other workers")
                    say(format_status(records, world, gone=gone))
                    if silent:  # a stopped process cannot act on the grace period or a SIGTERM
                        say(f"rank(s) {', '.join(map(str, silent))} silent (stopped or frozen): killing them (SIGKILL)")
                        for rank in silent:
                            procs[rank].kill()
                # a rank killed by a signal left no message, and its peers' reports could only echo
                # its loss: a peer still setting up (not communicating) would not notice it for seconds
                waited = min(grace, RESTART_GRACE) if first[1] < 0 else grace
                stop_at = time.monotonic() + waited
        if first is None and silence is not None and time.monotonic() - listened >= LISTEN_EVERY:
            listened = time.monotonic()
            records = read_status(store, world, timeout=1.0)
            frozen = _silent(procs, records, max(silence, SILENT_AFTER))
            if frozen:
                rank = frozen[0]
                age = time.time() - records[rank]["time"]  # type: ignore[index]
                message = written(f"rank {rank} fell silent {age:.1f} s ago, longer than "
                                  f"{option('timeout', silence, cli=f'{silence:g}')}: it is stopped (SIGSTOP, for instance) or "
                                  "frozen; killed it (SIGKILL)")
                say(f"{message}; stopping the other workers")
                say(format_status(records, world, stale_after=SILENT_AFTER))
                for r in frozen:
                    procs[r].kill()
                first = (rank, EXIT_PEER_FAILURE)
                waited = min(grace, RESTART_GRACE)  # its peers can only report that they lost it
                stop_at = time.monotonic() + waited
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if stop_at is not None and now >= stop_at:
            late = [r for r, c in enumerate(codes) if c is None]
            say(f"rank(s) {', '.join(map(str, late))} still running {waited:g} s later: terminating them")
            break
        if timeout is not None and now - start > timeout and first is None:
            message = f"the workers did not finish within {timeout:g} s"
            say(f"{message}; terminating them")
            say(format_status(read_status(store, world, timeout=1.0), world))
            _stop(procs, 3.0)
            return LaunchResult(returncode=124, message=message)
        time.sleep(0.05)
    if first is None:
        return LaunchResult(returncode=0)
    code = first[1]
    return LaunchResult(returncode=128 - code if code < 0 else code, message=message)


#: Seconds without a new status record after which a rank that still runs is silent: stopped
#: (SIGSTOP) or frozen. Its board publishes four times a second from a thread of its own.
SILENT_AFTER = 2.0


#: Seconds between two readings of the status boards for a rank silent longer than the run's timeout.
LISTEN_EVERY = 0.5


def _silent(
    procs: list[subprocess.Popen[bytes]], records: dict[int, dict[str, Any]] | None, after: float = SILENT_AFTER
) -> list[int]:
    """The ranks still running whose status board fell silent (for ``after`` seconds,
    :data:`SILENT_AFTER` by default): stopped or frozen. After a failure nothing they could still
    report is worth waiting for. A board closed at the end of its run is not silent."""
    now = time.time()
    return [r for r, rec in sorted((records or {}).items())
            if r < len(procs) and procs[r].poll() is None and not rec.get("closed") and now - rec["time"] > after]


def _stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """SIGTERM every live worker (and SIGCONT, so that a stopped one acts on it), SIGKILL those
    still alive ``grace`` seconds later, reap all."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            p.terminate()
            p.send_signal(signal.SIGCONT)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
