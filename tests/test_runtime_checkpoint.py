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


def test_checkpoints_load_tensors_and_plain_data_only(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"evil.pt": {"x": Payload()}}, META)
    with pytest.raises(CheckpointError, match="evil.pt holds objects other than tensors and plain data"):
        open_checkpoint(path).load("evil.pt")
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
    assert "Resume from another checkpoint, or start afresh with another --checkpoint-dir" in text
