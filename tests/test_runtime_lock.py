"""One run at a time in a checkpoint directory (pipetrain.runtime.lock)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipetrain.runtime.errors import CheckpointError
from pipetrain.runtime.lock import LOCK, DirectoryLock


def test_a_second_run_is_refused_naming_the_first_and_its_own_run_is_not(tmp_path):
    first = DirectoryLock(tmp_path / "ck", run="run A")
    assert first.acquire() == ""
    holder = json.loads((tmp_path / "ck" / LOCK).read_text())
    assert holder["run"] == "run A" and holder["pid"] == os.getpid()
    with pytest.raises(CheckpointError) as refused:
        DirectoryLock(tmp_path / "ck", run="run B").acquire()
    text = str(refused.value)
    assert text.startswith(f"checkpoint directory {tmp_path / 'ck'} is in use by another run (pid {os.getpid()} on ")
    assert text.endswith("; let it finish, or give this run another checkpoint_dir") and "\n" not in text
    assert refused.value.options == ("checkpoint_dir",)
    assert DirectoryLock(tmp_path / "ck", run="run A").acquire() == ""  # a worker of run A: held for it
    first.release()
    assert not (tmp_path / "ck").exists()  # made by the lock, left empty: removed
    again = DirectoryLock(tmp_path / "ck", run="run B")
    assert again.acquire() == ""
    again.release()


def test_the_lock_of_a_dead_process_is_taken_over(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "step-000001").mkdir()
    holder = subprocess.run(  # takes the lock and dies without releasing it
        [sys.executable, "-c", "import os, sys; from pipetrain.runtime.lock import DirectoryLock; "
         "DirectoryLock(sys.argv[1], run='run A').acquire(); os._exit(9)", str(tmp_path / "ck")],
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), timeout=60)
    assert holder.returncode == 9
    lock = DirectoryLock(tmp_path / "ck", run="run B")
    note = lock.acquire()
    assert note.startswith(f"took over the lock of {tmp_path / 'ck'} left by pid ") and "which no longer runs" in note
    assert json.loads((tmp_path / "ck" / LOCK).read_text())["run"] == "run B"
    lock.release()
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000001"]  # the directory stays


def test_a_lock_file_that_is_a_link_or_no_regular_file_is_refused_untouched(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("someone else's file")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / LOCK).symlink_to(target)
    with pytest.raises(CheckpointError) as refused:
        DirectoryLock(tmp_path / "ck", run="run A").acquire()
    assert str(refused.value) == (f"cannot lock checkpoint directory {tmp_path / 'ck'}: its lock file {LOCK} is a "
                                  "symbolic link, which pipetrain never writes through; remove it, or give this run "
                                  "another checkpoint_dir")
    assert target.read_text() == "someone else's file"
    (tmp_path / "ck" / LOCK).unlink()
    os.mkfifo(tmp_path / "ck" / LOCK)  # would block an open without O_NONBLOCK
    with pytest.raises(CheckpointError, match="is not a regular file"):
        DirectoryLock(tmp_path / "ck", run="run A").acquire()
