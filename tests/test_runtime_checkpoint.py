"""Atomic, verified checkpoints (pipetrain.runtime.checkpoint)."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
import random
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist

from checkpoint_files import claim_device, reseal

from pipetrain.runtime.checkpoint import (
    MANIFEST,
    capture_rng,
    check_compatible,
    find_latest,
    fingerprint,
    list_checkpoints,
    open_checkpoint,
    prune,
    resolve,
    restore_rng,
    save_checkpoint,
    save_distributed,
    stage_file,
    step_dir,
    write_manifest,
)
from pipetrain.runtime.errors import CheckpointError, CheckpointMismatchError
from pipetrain.runtime.launch import init_distributed, launch

META = {"model": "mlp:width=16", "schedule": "1f1b", "stages": 2, "replicas": [1, 1], "fingerprint": "abc"}


def stage_state(stage: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed * 10 + stage)
    return {
        "weights": {"0.weight": torch.randn(4, 3, generator=g), "0.bias": torch.zeros(4)},
        "versions": [torch.randn(2, generator=g), torch.randn(2, generator=g)],
        "optimizer": {"step": 7, "lr": 0.01, "momentum": {"0.weight": torch.ones(4, 3)}},
        "rng": capture_rng(),
        "name": f"stage {stage}",
        "flags": (True, None, 3),
    }


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def save(tmp_path, step, seed=0, meta=META):
    return save_checkpoint(tmp_path, step, {stage_file(s): stage_state(s, seed) for s in range(2)}, meta)


def test_round_trip_of_nested_state_and_rng(tmp_path):
    path = save(tmp_path, 120)
    assert path == step_dir(tmp_path, 120) and path.name == "step-000120"
    assert sorted(p.name for p in path.iterdir()) == [MANIFEST, "stage-0.pt", "stage-1.pt"]
    ckpt = open_checkpoint(path)
    assert ckpt.step == 120 and ckpt.meta == META
    for s in range(2):
        assert_same(ckpt.load(stage_file(s)), stage_state(s))
    manifest = json.loads((path / MANIFEST).read_text())
    assert {f["name"] for f in manifest["files"]} == {"stage-0.pt", "stage-1.pt"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"])
    with pytest.raises(CheckpointError, match="no file 'stage-2.pt'"):
        ckpt.load(stage_file(2))
    assert not [p for p in path.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_rng_states_restore_the_same_random_numbers():
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    state = capture_rng()
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    restore_rng(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(expected[0], again[0]) and expected[1:] == again[1:]


def test_truncated_or_corrupted_checkpoint_is_refused_or_skipped(tmp_path):
    save(tmp_path, 10, seed=1)
    path = save(tmp_path, 20, seed=2)
    f = path / "stage-1.pt"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="stage-1.pt has .* bytes, the manifest says .*truncated"):
        open_checkpoint(path)
    with pytest.raises(CheckpointError, match="damaged"):
        resolve(path)  # named explicitly: refused
    with pytest.warns(UserWarning, match="step-000020 is damaged.*truncated.*skipping it"):
        latest = find_latest(tmp_path)  # searched for: the previous complete one
    assert latest is not None and latest.step == 10
    assert_same(latest.load("stage-1.pt"), stage_state(1, seed=1))
    # same size, one byte flipped
    f.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        open_checkpoint(path)


def test_missing_manifest_means_not_a_checkpoint(tmp_path):
    save(tmp_path, 5)
    path = save(tmp_path, 6)
    (path / MANIFEST).unlink()  # as if the run died before committing
    with pytest.raises(CheckpointError, match="not a complete checkpoint: it has no manifest.json"):
        open_checkpoint(path)
    with pytest.warns(UserWarning, match="step-000006"):
        assert resolve(tmp_path).step == 5
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve(tmp_path / "not-there")
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        resolve(tmp_path / "nothing")


def test_resume_into_a_different_run_is_refused_naming_the_difference(tmp_path):
    ckpt = open_checkpoint(save(tmp_path, 3))
    check_compatible(ckpt.meta, dict(META))
    other = dict(META, schedule="gpipe", stages=4)
    with pytest.raises(CheckpointMismatchError) as info:
        check_compatible(ckpt.meta, other, where=str(ckpt.path))
    text = str(info.value)
    assert "schedule: '1f1b' in" in text and "'gpipe' in this run" in text
    assert "stages: 2 in" in text and "4 in this run" in text
    assert "model" not in text
    config = {"model": "mlp", "lr": 0.1}
    assert fingerprint(config) == fingerprint(dict(reversed(list(config.items()))))
    with pytest.raises(CheckpointMismatchError, match="fingerprint"):
        check_compatible({"fingerprint": fingerprint(config)}, {"fingerprint": fingerprint(dict(config, lr=0.2))})


def test_prune_keeps_the_last_complete_ones(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save(tmp_path, step)
    (step_dir(tmp_path, 2) / MANIFEST).unlink()  # an old incomplete one
    step_dir(tmp_path, 6).mkdir()  # a newer one still being written
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-000001", "step-000002", "step-000003"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5, 6]
    with pytest.raises(CheckpointError):
        prune(tmp_path, keep=0)


def test_distributed_protocol_with_threads_and_a_real_store(tmp_path):
    from pipetrain.runtime.rendezvous import loopback_listener

    listener = loopback_listener()  # on 127.0.0.1 only, as the launcher's store
    server = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                           master_listen_fd=listener.detach(), use_libuv=True)
    clients = [
        dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
        for _ in range(3)
    ]  # fmt: skip
    outcome: dict[int, object] = {}

    def rank_main(rank, shards, timeout):
        try:
            outcome[rank] = save_distributed(
                tmp_path, 8, shards, META, rank=rank, world_size=3, store=clients[rank], timeout=timeout
            )
        except CheckpointError as error:
            outcome[rank] = error

    # ranks 0 and 1 hold stages 0 and 1; rank 2 is a second replica of stage 1 and writes nothing
    threads = [
        threading.Thread(target=rank_main, args=(r, {stage_file(r): stage_state(r)} if r < 2 else {}, 10))
        for r in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert outcome[0] == outcome[1] == outcome[2] == step_dir(tmp_path, 8)
    assert sorted(open_checkpoint(step_dir(tmp_path, 8)).files) == ["stage-0.pt", "stage-1.pt"]

    # rank 2 never arrives: rank 0 gives up after the timeout and rank 1 hears why
    threads = [threading.Thread(target=rank_main, args=(r, {stage_file(r): stage_state(r)}, 1.0)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(outcome[0], CheckpointError) and "ranks [2] did not finish" in str(outcome[0])
    assert isinstance(outcome[1], CheckpointError) and "ranks [2]" in str(outcome[1])
    assert outcome[0].exit_status == outcome[1].exit_status == 3  # a timed-out peer, not a bad checkpoint
    assert open_checkpoint(step_dir(tmp_path, 8)).step == 8  # the earlier commit still stands


def test_a_full_disk_on_one_rank_stops_every_rank_and_leaves_nothing(tmp_path, monkeypatch):
    from pipetrain.runtime.rendezvous import loopback_listener

    listener = loopback_listener()
    server = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, wait_for_workers=False,
                           master_listen_fd=listener.detach(), use_libuv=True)
    clients = [dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=10)) for _ in range(2)]
    save(tmp_path, 4)
    full_disk(monkeypatch, only="stage-1.pt")  # rank 1's file system is full, rank 0 writes its file
    outcome: dict[int, object] = {}

    def rank_main(rank):
        try:
            outcome[rank] = save_distributed(tmp_path, 8, {stage_file(rank): stage_state(rank)}, META, rank=rank,
                                             world_size=2, store=clients[rank], timeout=10)
        except CheckpointError as error:
            outcome[rank] = error

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    expected = (f"checkpoint of step 8 failed on rank 1: cannot write checkpoint file "
                f"{step_dir(tmp_path, 8) / 'stage-1.pt'}: No space left on device")
    assert [str(outcome[r]) for r in range(2)] == [expected, expected]
    assert all(outcome[r].exit_status == 2 for r in range(2))
    assert not step_dir(tmp_path, 8).exists()  # rank 0's file of the failed save is gone too
    assert open_checkpoint(step_dir(tmp_path, 4)).step == 4


def _save_worker(directory):
    from pipetrain.runtime.status import env_store

    env = init_distributed("gloo", timeout=60)
    store = env_store()
    state = {"stage": env.rank, "w": torch.full((3,), float(env.rank))}
    path = save_distributed(
        directory, 2, {stage_file(env.rank): state}, META, rank=env.rank, world_size=env.world_size,
        store=store, timeout=30,
    )  # fmt: skip
    dist.barrier()
    ckpt = find_latest(directory)
    return str(path), ckpt.load(stage_file(1 - env.rank))["stage"]


def test_distributed_save_in_real_processes(tmp_path):
    result = launch(_save_worker, (str(tmp_path),), 2, timeout=60, quiet=True)
    assert result.returncode == 0, result
    assert result.results[0] == (str(step_dir(tmp_path, 2)), 1)
    assert result.results[1] == (str(step_dir(tmp_path, 2)), 0)


class Payload:
    """Any class: a pickle of an arbitrary object could run code when loaded."""


class Exploit:
    """What a malicious pickle holds: a call run when it is loaded."""

    def __reduce__(self):
        import os

        return (os.system, ("echo loaded",))


def test_checkpoints_load_tensors_and_plain_data_only(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"evil.pt": {"x": Payload()}, "exploit.pt": {"x": Exploit()}}, META)
    for name, what in (("evil.pt", "Payload"), ("exploit.pt", "system")):
        with pytest.raises(CheckpointError, match=f"{name} holds objects other than tensors and plain data") as caught:
            open_checkpoint(path).load(name)
        text = str(caught.value)
        assert what in text and "\n" not in text, text
        # torch's own message advises loading unsafely ("will likely succeed") or allow-listing: not ours
        for advice in ("weights_only", "likely succeed", "safe_globals", "trust"):
            assert advice not in text, text
    source = Path(__file__).resolve().parents[1] / "src"
    found = [str(p) for p in source.rglob("*.py") if "weights_only=False" in p.read_text()]
    assert not found, found


def test_a_checkpoint_written_on_a_gpu_loads_onto_the_cpu(tmp_path):
    path = save(tmp_path, 4)
    for name in (stage_file(0), stage_file(1)):
        claim_device(path / name, "cuda:0")
    reseal(path)
    if not torch.cuda.is_available():  # the file really says CUDA: torch's own default refuses it here
        with pytest.raises(RuntimeError, match="CUDA"):
            torch.load(path / stage_file(0), weights_only=True)
        with pytest.raises(CheckpointError, match=r"cannot be read with map_location=None here .*map_location='cpu'"):
            open_checkpoint(path).load(stage_file(0), map_location=None)
    for stage in range(2):
        state = open_checkpoint(path).load(stage_file(stage))
        assert state["weights"]["0.weight"].device == torch.device("cpu")
        assert_same(state, stage_state(stage) | {"rng": state["rng"]})


def test_tensors_saved_without_data_are_refused_saying_where_they_are(tmp_path):
    state = stage_state(0)
    state["weights"] = {name: t.to("meta") for name, t in state["weights"].items()}
    path = save_checkpoint(tmp_path, 1, {stage_file(0): state}, META)
    with pytest.raises(CheckpointError) as caught:
        open_checkpoint(path).load(stage_file(0))
    text = str(caught.value)
    assert "stage-0.pt holds tensors without data, on PyTorch's 'meta' device (weights/0.weight, weights/0.bias)" in text
    assert "Resume from another checkpoint, or start afresh with another checkpoint_dir" in text
    assert caught.value.options == ("checkpoint_dir",)


def _rename_record(step: Path, name: str, data: bytes | None = None) -> None:
    """The manifest of ``step`` made to name ``name`` for its first file (with the size and
    SHA-256 of ``data``, as a forger who knows the target would write)."""
    import hashlib

    manifest = json.loads((step / MANIFEST).read_text())
    manifest["files"][0]["name"] = name
    if data is not None:
        manifest["files"][0]["size"], manifest["files"][0]["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (step / MANIFEST).write_text(json.dumps(manifest))


def _refused(path: Path) -> str:
    """The one-line refusal of ``open_checkpoint(path)``, which must come at once (a thread that
    blocked on a FIFO or read /dev/zero would not finish)."""
    outcome: list[object] = []

    def attempt() -> None:
        try:
            open_checkpoint(path)
            outcome.append(None)
        except CheckpointError as error:
            outcome.append(error)
        except BaseException as error:  # noqa: BLE001 - reported below
            outcome.append(error)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(10)
    assert outcome, f"opening {path} blocked"
    error = outcome[0]
    assert isinstance(error, CheckpointError), error
    assert "\n" not in str(error)
    return str(error)


def test_a_manifest_names_nothing_outside_its_directory(tmp_path):
    import os

    root = tmp_path / "ck"
    save(root, 1)
    secret = tmp_path / "secret"
    secret.write_bytes(b"not yours" * 1000)
    cases = {
        "../../secret": "'../../secret', which is not a plain file name",  # right size and hash: still refused
        str(secret): "which is not a plain file name",  # an absolute name
        "/dev/zero": "'/dev/zero', which is not a plain file name",
        ".stage-0.pt.tmp-1-2": "which is not a plain file name",  # a temporary is never a checkpoint file
        "fifo": "fifo is a FIFO, not a checkpoint file",
        "zero": "zero is a symbolic link",
    }
    for step, (name, expected) in enumerate(cases.items(), start=2):
        path = save(root, step)
        if name == "fifo":
            os.mkfifo(path / "fifo")
        elif name == "zero":
            (path / "zero").symlink_to("/dev/zero")
        _rename_record(path, name, secret.read_bytes())
        text = _refused(path)
        assert expected in text, text
        assert str(len(secret.read_bytes())) not in text  # the size of what it names is not told
    # the manifest itself as a FIFO: refused at once too (it used to hang the launcher)
    fifo_manifest = save(root, 20)
    (fifo_manifest / MANIFEST).unlink()
    os.mkfifo(fifo_manifest / MANIFEST)
    assert "manifest.json is a FIFO" in _refused(fifo_manifest)
    with pytest.warns(UserWarning) as caught:
        assert find_latest(root).step == 1  # each of them skipped for the one good checkpoint
    assert len(caught) == len(cases) + 1


def test_a_manifest_that_lists_no_files_is_skipped(tmp_path):
    save(tmp_path, 1)
    path = save(tmp_path, 2)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps(dict(manifest, files=[])))
    with pytest.raises(CheckpointError, match="not a complete checkpoint: its manifest.json lists no files"):
        open_checkpoint(path)
    with pytest.warns(UserWarning, match="step-000002 is not a complete checkpoint: its manifest.json lists no files"):
        assert find_latest(tmp_path).step == 1


def test_a_step_directory_that_is_a_link_is_neither_read_nor_pruned(tmp_path):
    elsewhere = save(tmp_path / "elsewhere", 9)
    root = tmp_path / "ck"
    for step in (1, 2, 3):
        save(root, step)
    (root / "step-000009").symlink_to(elsewhere)
    (root / "step-000000").symlink_to(elsewhere)  # older than every checkpoint: prune would take it
    assert [s for s, _ in list_checkpoints(root)] == [1, 2, 3]
    with pytest.warns(UserWarning, match="step-000009 is a symbolic link"):
        assert find_latest(root).step == 3
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        resolve(root / "step-000009")
    assert sorted(p.name for p in prune(root, keep=1)) == ["step-000001", "step-000002"]
    assert (root / "step-000009").is_symlink() and (root / "step-000000").is_symlink()
    assert open_checkpoint(elsewhere).step == 9  # its manifest and files untouched


class _FullDisk:
    """A file whose writes fail as on a full disk (a real ENOSPC OSError) after ``room`` bytes."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        import errno
        import os

        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def full_disk(monkeypatch, room: int = 1000, only: str = "") -> None:
    """Every file the checkpoint module writes (whose name holds ``only``) fills up after ``room`` bytes."""
    import builtins

    import pipetrain.runtime.checkpoint_write as module

    def opened(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return _FullDisk(f, room) if "w" in mode and only in str(path) else f

    monkeypatch.setattr(module, "open", opened, raising=False)


def test_a_full_disk_is_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch):
    save(tmp_path, 1)
    full_disk(monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        save(tmp_path, 2)
    text = str(caught.value)
    assert text == f"cannot write checkpoint file {step_dir(tmp_path, 2) / 'stage-0.pt'}: No space left on device"
    assert not step_dir(tmp_path, 2).exists()  # no temporary, no half checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]
    assert open_checkpoint(step_dir(tmp_path, 1)).step == 1  # the older checkpoint intact

    from pipetrain.training.outputs import save_state_dict

    target = tmp_path / "out" / "model.pt"
    full_disk(monkeypatch, only="model.pt")
    import pipetrain.training.outputs  # noqa: F401 - save_state_dict writes through the checkpoint module

    with pytest.raises(OSError, match="No space left on device"):
        save_state_dict({"w": torch.ones(1000)}, str(target))
    assert list((tmp_path / "out").iterdir()) == []


def test_nothing_is_written_through_a_linked_step_directory(tmp_path):
    outside = tmp_path / "outside"
    save(outside, 10)  # another run's checkpoint, where the link points
    before = {p.name: p.read_bytes() for p in step_dir(outside, 10).iterdir()}
    root = tmp_path / "ck"
    root.mkdir()
    step_dir(root, 10).symlink_to(step_dir(outside, 10), target_is_directory=True)
    with pytest.raises(CheckpointError) as refused:
        save(root, 10, seed=1)
    assert str(refused.value).startswith(f"cannot write checkpoint {step_dir(root, 10)}: it is a symbolic link")
    assert {p.name: p.read_bytes() for p in step_dir(outside, 10).iterdir()} == before
    with pytest.raises(CheckpointError):  # the manifest alone, written by rank 0 of a distributed save
        write_manifest(root, 10, [], META)
    assert {p.name: p.read_bytes() for p in step_dir(outside, 10).iterdir()} == before


def test_a_sigterm_while_a_file_is_written_ends_the_process_after_the_rename(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    # the state's pickling sends the process a SIGTERM in the middle of torch.save, as a launcher
    # stopping its workers does at any moment; the temporary must not outlive the process
    script = (
        "import os, signal, sys\n"
        "from pipetrain.runtime.checkpoint import save_checkpoint\n"
        "class Stop:\n"
        "    def __reduce__(self):\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        return (int, (0,))\n"
        "save_checkpoint(sys.argv[1], 3, {'rank-0.pt': {'x': list(range(1000)), 'stop': Stop()}}, {})\n"
        "print('went on after the SIGTERM')\n"
    )
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert "went on" not in result.stdout
    assert sorted(p.name for p in step_dir(tmp_path, 3).iterdir()) == ["rank-0.pt"]  # renamed; no .rank-0.pt.tmp-*
