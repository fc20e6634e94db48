"""Status boards and fault reports (pipetrain.runtime.status), with real processes that hang or die."""

from __future__ import annotations

import datetime
import os
import re
import signal
import time

import torch
import torch.distributed as dist

from pipetrain.runtime.launch import EXIT_PEER_FAILURE, init_distributed, launch
from pipetrain.runtime.p2p import ACTIVATIONS, GRADIENTS, Messenger
from pipetrain.runtime.status import StatusBoard, format_status, read_status

LIMIT = 60


def _store_pair():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore(
        "127.0.0.1", server.port, is_master=False, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=10),
    )  # fmt: skip
    return server, client


def test_board_publishes_recent_actions_and_waits(capfd):
    server, client = _store_pair()
    a = StatusBoard(client, 0, 3, keep=3, interval=0.05, prefix="t", address=("127.0.0.1", server.port))
    b = StatusBoard(client, 1, 3, keep=3, interval=0.05, prefix="t", start=False)
    try:
        for action in ("F0", "F1", "F2", "B0", "F3"):
            a.done(action)
        a.waiting = "RECV_B of microbatch 1 from rank 1"
        a.note = "step 4"
        b.done("F0")
        b.publish()
        deadline = time.monotonic() + 10  # until a's background thread has published its record
        records = read_status(client, 3, prefix="t")
        while (records is None or records.get(0, {}).get("done") != ["F2", "B0", "F3"]
               or records[0].get("waiting_s", 0) <= 0.1) and time.monotonic() < deadline:
            time.sleep(0.05)
            records = read_status(client, 3, prefix="t")
        assert records is not None and set(records) == {0, 1}
        assert records[0]["done"] == ["F2", "B0", "F3"]  # the last 3 only
        assert records[0]["waiting"] == "RECV_B of microbatch 1 from rank 1"
        assert records[0]["waiting_s"] > 0.1
        text = a.report()
        assert re.search(r"rank 0 \[step 4\]: waiting \d+\.\d s for RECV_B of microbatch 1 from rank 1; done: F2 B0 F3", text)
        assert "rank 1: busy (not communicating); done: F0" in text
        assert "rank 2: no status published" in text
        # a record that stopped updating is flagged
        old = dict(records[1], time=time.time() - 30)
        assert "rank 1: silent for 30" in format_status({1: old}, 2)
    finally:
        a.close()
    del server  # the store goes away with the process that hosted it
    time.sleep(0.2)
    start = time.monotonic()
    text = a.report(timeout=2.0)
    assert time.monotonic() - start < 3.0
    assert "unavailable" in text
    assert "Traceback" not in capfd.readouterr().err


def _pipeline_worker(fault, timeout):
    """A three-stage pipeline that runs a few microbatches, then one rank hangs or dies."""
    env = init_distributed("gloo", timeout=LIMIT)
    rank = env.rank
    board = StatusBoard.from_env(interval=0.1)
    m = Messenger(timeout=timeout, status=board)
    x = torch.ones(4, 8)
    sends = []  # waited on at the end, so that no rank blocks in a send
    for k in range(3):
        if rank > 0:
            x = m.recv(rank - 1, ACTIVATIONS, what=f"RECV_F of microbatch {k} from rank {rank - 1}")
        board.done(f"F{k}")
        if rank < 2:
            sends.append(m.isend(x, rank + 1, ACTIVATIONS))
    for k in range(3):
        if rank == 1 and k == 1:
            time.sleep(0.3)  # let the board publish what rank 1 did last
            if fault == "hang":
                time.sleep(60)
            elif fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen: its status board stops publishing too
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        if rank < 2:
            m.recv(rank + 1, GRADIENTS, what=f"RECV_B of microbatch {k} from rank {rank + 1}")
        board.done(f"B{k}")
        if rank > 0:
            sends.append(m.isend(x, rank - 1, GRADIENTS))
    # rank 2 runs ahead into the next step and waits for rank 1 there
    if rank == 2:
        m.recv(1, ACTIVATIONS, what="RECV_F of microbatch 3 from rank 1")
    for h in sends:
        h.wait()
    board.close()


def _worker_errors(err: str) -> dict[int, str]:
    """Each worker's error block (its message and the status table below it)."""
    blocks = re.split(r"(?=pipetrain worker rank \d: error:)", err)
    out = {}
    for block in blocks:
        m = re.match(r"pipetrain worker rank (\d): error:", block)
        if m:
            out[int(m.group(1))] = block
    return out


def test_a_hanging_rank_is_reported_by_every_other_rank_within_the_timeout(capfd):
    start = time.monotonic()
    result = launch(_pipeline_worker, ("hang", 2.0), 3, grace=1.0, timeout=LIMIT)
    elapsed = time.monotonic() - start
    assert result.returncode == EXIT_PEER_FAILURE
    assert result.exitcodes[0] == EXIT_PEER_FAILURE and result.exitcodes[2] == EXIT_PEER_FAILURE
    assert result.exitcodes[1] == -signal.SIGTERM  # the hung rank, stopped by the launcher
    assert elapsed < 30
    errors = _worker_errors(capfd.readouterr().err)
    assert set(errors) == {0, 2}
    assert "rank 0 timed out after 2 s waiting for RECV_B of microbatch 1 from rank 1" in errors[0]
    assert "rank 2 timed out after 2 s waiting for RECV_F of microbatch 3 from rank 1" in errors[2]
    for text in errors.values():
        # the hung rank is alive (it publishes) but busy, and the table shows what it did last
        assert re.search(r"rank 1: busy \(not communicating\); done: F0 F1 F2 B0;", text), text
        # published by rank 0's background thread while its main thread was blocked in gloo
        assert "likely cause: rank 1 is busy and not communicating" in text and "(rank(s) 0, 2 wait for it)" in text
        waited = re.search(r"rank 0: waiting (\d+\.\d) s for RECV_B of microbatch 1 from rank 1; done: F0 F1 F2 B0", text)
        assert waited and float(waited.group(1)) >= 1.0, text


def test_a_killed_rank_is_named_by_the_launcher_and_its_peers(capfd):
    start = time.monotonic()
    result = launch(_pipeline_worker, ("kill", 30.0), 3, grace=5.0, timeout=LIMIT)
    elapsed = time.monotonic() - start
    assert result.returncode == 128 + signal.SIGKILL
    assert result.exitcodes == [EXIT_PEER_FAILURE, -signal.SIGKILL, EXIT_PEER_FAILURE]
    assert elapsed < 20  # far below the 30 s timeout: a dead peer is noticed at once
    err = capfd.readouterr().err
    assert "pipetrain launch: worker rank 1 was killed by SIGKILL" in err
    errors = _worker_errors(err)
    assert "rank 0 lost rank 1 while waiting for RECV_B of microbatch 1 from rank 1" in errors[0]
    assert "rank 2 lost rank 1 while waiting for RECV_F of microbatch 3 from rank 1" in errors[2]
    assert re.search(r"rank 1: .*done: F0 F1 F2 B0", errors[0])


def test_a_stopped_rank_is_named_in_the_last_line_and_the_run_exits_3(capfd):
    result = launch(_pipeline_worker, ("stop", 4.0), 3, grace=1.0, timeout=LIMIT)
    assert result.returncode == EXIT_PEER_FAILURE  # a lost or timed-out peer
    assert result.exitcodes[1] == -signal.SIGKILL  # SIGTERM waits for a stopped process; SIGKILL does not
    # the healthy rank that timed out first is not the culprit: the message (the command's last line) says who is
    assert re.search(r"^worker rank [02] exited with status 3 \(it lost a peer or timed out waiting for one\); rank 1 "
                     r"is silent for \d+\.\d s: it died or is frozen \(stopped, for instance by SIGSTOP\) \(rank\(s\) "
                     r"0, 2 waited for it\)$", result.message), result.message
    assert "deadlock" not in capfd.readouterr().err


def _record(rank, waiting=None, peer=None, age=0.0, done=("F0",), waited=1.0):
    return {"rank": rank, "pid": 1, "host": "h", "time": time.time() - age, "done": list(done),
            "waiting": waiting, "waiting_s": waited, "peer": peer, "note": ""}  # fmt: skip


def test_diagnosis_points_at_the_culprit():
    deadlock = {0: _record(0, "RECV_B 0 from rank 1", 1, waited=9.0), 1: _record(1, "RECV_F 1 from rank 0", 0, waited=9.0)}
    text = format_status(deadlock, 2)
    assert "likely cause: rank 0 waits for rank 1, which waits for it: the two programs deadlock" in text
    # two waits a moment old say nothing about the programs (messages about to arrive), nor does a dead
    # rank's last record: a rank killed while it waited for a peer that waits for it is no deadlock
    assert "likely" not in format_status({0: _record(0, "RECV_B 0 from rank 1", 1, waited=0.1),
                                          1: _record(1, "RECV_F 1 from rank 0", 0, waited=9.0)}, 2)
    text = format_status(deadlock, 2, gone={1: "was killed by SIGKILL"})
    assert "rank 1: was killed by SIGKILL; last done: F0" in text
    assert "likely cause: rank 1 was killed by SIGKILL (rank(s) 0 wait for it)" in text and "deadlock" not in text
    dead = {0: _record(0, "RECV_B 0 from rank 1", 1), 1: _record(1, age=60.0), 2: _record(2, "RECV_F 0 from rank 1", 1)}
    text = format_status(dead, 3)
    assert "rank 1: silent for 60" in text
    assert re.search(r"likely cause: rank 1 is silent for 60\.\d s: it died or is frozen \(stopped, for instance by "
                     r"SIGSTOP\) \(rank\(s\) 0, 2 wait for it\)", text), text
    chain = {0: _record(0, "RECV_B 0 from rank 1", 1), 1: _record(1, "RECV_B 0 from rank 2", 2)}
    text = format_status(chain, 3)
    assert "rank 2: no status published" in text
    assert "likely cause: rank 2 has published no status" in text and "rank 1 " not in text.split("likely")[1]
