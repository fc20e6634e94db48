"""Waits on a peer that last as long as it is heard from (pipetrain.runtime.liveness): a rank at long
work is waited for past the timeout, a silent one is given up within the timeout."""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist

from pipetrain.runtime.errors import PeerTimeoutError
from pipetrain.runtime.liveness import Liveness
from pipetrain.runtime.status import StatusBoard
from launched_workers import kill_stopped, workers


def _client(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


def _rank(store, rank: int, world: int = 2, timeout: float = 1.0, board: bool = True):
    """Rank ``rank``'s board (publishing every 50 ms) and its liveness, each on a client of its own."""
    status = StatusBoard(_client(store.port), rank, world, interval=0.05, prefix="status") if board else None
    live = Liveness(_client(store.port), rank, world, timeout, prefix="live", status_prefix="status", board=status)
    return status, live


def test_a_peer_at_work_is_waited_for_past_the_timeout(store):
    """Rank 1 works three times the timeout before it posts; rank 0 waits as long as rank 1 publishes."""
    board0, waiter = _rank(store, 0)
    board1, worker = _rank(store, 1)
    try:
        later = threading.Timer(3.0, lambda: worker.post("batch"))
        later.start()
        started = time.monotonic()
        waiter.await_count("batch", 1, peer=1, what="a held-out batch from rank 1")
        assert time.monotonic() - started >= 2.9
        assert board0.waiting is None  # the wait is off the board once over
        worker.put("metrics", '{"loss": 0.5}')
        assert waiter.await_value("metrics", peer=1, what="the result") == '{"loss": 0.5}'
    finally:
        later.cancel()
        board0.close()
        board1.close()


def test_a_silent_peer_is_given_up_after_the_timeout_and_named(store):
    """Rank 1's board stops (a stopped process publishes nothing): the wait ends one timeout later."""
    board0, waiter = _rank(store, 0)
    board1, _ = _rank(store, 1)
    time.sleep(0.3)
    board1.close()  # silent from here on
    started = time.monotonic()
    with pytest.raises(PeerTimeoutError) as caught:
        waiter.await_count("batch", 1, peer=1, what="held-out batch 0 of stage 1 from rank 1")
    elapsed = time.monotonic() - started
    board0.close()
    assert 0.9 <= elapsed < 2.0, elapsed
    message = str(caught.value)
    assert message.startswith("rank 0 heard nothing from rank 1 for 1 s while waiting for held-out batch 0 of "
                              "stage 1 from rank 1: rank 1 is stopped (SIGSTOP), frozen or dead"), message
    assert "only if its machine is too loaded to publish" in message
    assert "rank 0: waiting" in message and "for held-out batch 0 of stage 1 from rank 1" in message  # the board's report


def test_a_peer_that_never_published_is_silent_from_the_first_look(store):
    _, waiter = _rank(store, 0, board=False)
    started = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="heard nothing from rank 1 for 1 s"):
        waiter.await_value("metrics", peer=1, what="the result")
    assert 0.9 <= time.monotonic() - started < 2.0


def test_arrive_waits_for_every_rank_and_names_the_silent_one(store):
    boards, lives = zip(*(_rank(store, r, world=3) for r in range(3)))
    try:
        done = []

        def late(rank: int, after: float) -> None:
            time.sleep(after)
            lives[rank].arrive("end", "the end of training")
            done.append(rank)

        threads = [threading.Thread(target=late, args=(r, 1.5 * r)) for r in (1, 2)]
        for thread in threads:
            thread.start()
        started = time.monotonic()
        lives[0].arrive("end", "the end of training")
        assert time.monotonic() - started >= 2.9  # rank 2 came three seconds (three timeouts) later
        for thread in threads:
            thread.join()
        assert sorted(done) == [1, 2]
        boards[2].close()  # rank 2 falls silent before the next arrival
        lives[1].store.set("live/next/1", "1")  # rank 1 is there
        with pytest.raises(PeerTimeoutError, match="heard nothing from rank 2 for 1 s while waiting for the save"):
            lives[0].arrive("next", "the save")
    finally:
        for board in boards:
            board.close()


# -- a whole run: an evaluation longer than --timeout --------------------------------------------

def _train(*argv: str, env: dict[str, str] | None = None, **popen: Any) -> subprocess.Popen[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([here, *sys.path]), **(env or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "pipetrain.cli", "train", "--data", "dying_data:make", "--batch-size", "12",
         "--schedule", "1f1b", "--balance", "2,2", "--steps", "2", "--eval-samples", "64", "--data-workers", "0", "--no-progress", *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment, **popen)


def test_an_evaluation_longer_than_the_timeout_completes(tmp_path):
    """Stage 0 computes each held-out batch for 6 s, the timeout is 4 s: the last stage waits for it
    (on main it timed out: exit 3, "rank 1 timed out after 4 s waiting for receive of 'eval1'")."""
    process = _train("--model", "slow_eval:make:seconds=6", "--timeout", "4", "--save", str(tmp_path / "weights"))
    out, err = process.communicate(timeout=180)
    assert process.returncode == 0, err
    assert re.search(r"1f1b: 2 steps on 2 workers, .*, test loss \d+\.\d{4}, test accuracy", out), out
    assert (tmp_path / "weights" / "model.safetensors.index.json").exists()


def test_a_worker_stopped_during_an_evaluation_ends_the_run_within_the_timeout_and_two_seconds(tmp_path):
    timeout = 4
    mark = tmp_path / "evaluating"
    process = _train("--model", "slow_eval:make:seconds=60", "--timeout", str(timeout),
                     env={"SLOW_EVAL_MARK": str(mark)})
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while not mark.exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the evaluation never started"
            time.sleep(0.05)
        stopped = workers(process.pid)[0]  # stage 0, in its 60 s of held-out work
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        lines = []
        for line in process.stderr:  # up to the run's verdict (the launcher's own exit is not timed)
            lines.append(line)
            if line.startswith("pipetrain train: error: "):
                break
        elapsed = time.monotonic() - started
        err = "".join(lines) + process.communicate(timeout=60)[1]
    finally:
        process.kill()
        kill_stopped(stopped)
    assert process.returncode == 3, err
    assert elapsed < timeout + 2, (elapsed, err)
    last = err.strip().splitlines()[-1]
    if last.startswith("pipetrain train: error: rank 0 fell silent "):  # the launcher heard nothing for --timeout
        assert f"s ago, longer than --timeout {timeout}: it is stopped (SIGSTOP, for instance) or frozen" in last
    else:  # rank 1's wait for the held-out batch gave up first
        assert f"rank 1 heard nothing from rank 0 for {timeout} s while waiting for held-out batch 0 of stage 1" in err
        assert "rank(s) 0 silent (stopped or frozen): killing them (SIGKILL)" in err
        assert last.startswith("pipetrain train: error: worker rank 1 exited with status 3"), err


def test_a_peer_that_stopped_on_its_own_error_is_given_up_at_once(store):
    """Its error left for the launcher (a full disk, say), the peer will not be heard from again."""
    from pipetrain.runtime.errors import PeerLostError
    from pipetrain.runtime.status import publish_error

    board0, waiter = _rank(store, 0, timeout=30.0)
    board1, _ = _rank(store, 1)
    try:
        threading.Timer(0.5, lambda: publish_error(_client(store.port), 1, "no space left on device")).start()
        started = time.monotonic()
        with pytest.raises(PeerLostError, match="rank 0 lost rank 1 while waiting for the outputs: rank 1 "
                                                "stopped on an error of its own"):
            waiter.arrive("outputs", "the outputs")
        assert time.monotonic() - started < 2.0
    finally:
        board0.close()
        board1.close()
