"""Objects gathered to rank 0 and broadcast from it between real gloo processes
(pipetrain.runtime.share): they arrive equal to what was sent, their large arrays sent as tensors
beside a pickle that leaves them out."""

from __future__ import annotations

import pickle
from array import array

from pipetrain.execution.losses import UnitLosses
from pipetrain.runtime.launch import init_distributed, launch
from pipetrain.runtime.share import LARGE, _pack, _unpack, broadcast_from, gather_to

LIMIT = 60  # seconds: the launcher kills every worker after this, so no test can hang


def _object(rank: int) -> dict:
    """Large arrays of several typecodes (one of them empty on rank 2), small ones, a UnitLosses,
    the same array twice, nested containers."""
    big = array("d", (rank + t / 7 for t in range(LARGE + 3 * rank)))
    losses = UnitLosses({k: k / 3 for k in range(rank, 2 * LARGE, 3)})
    return {"rank": rank, "big": big, "again": big, "ints": array("q", range(rank, LARGE + rank)),
            "small": array("d", [rank, 0.5]), "empty": array("d") if rank == 2 else array("d", [1.0] * LARGE),
            "losses": losses, "nested": [{"ends": array("f", [0.25] * (LARGE + 1))}, ("text", None)]}


def _same(a: dict, b: dict) -> bool:
    return (pickle.dumps({k: v for k, v in a.items() if k != "losses"}) == pickle.dumps(
        {k: v for k, v in b.items() if k != "losses"}) and dict(a["losses"]) == dict(b["losses"]))


def _share_worker():
    env = init_distributed("gloo", timeout=LIMIT)
    mine = _object(env.rank)
    gathered = gather_to(mine, dst=0)
    if env.rank == 0:
        assert gathered is not None and len(gathered) == env.world_size
        for rank, got in enumerate(gathered):
            assert _same(got, _object(rank)), rank
            assert got["again"] is got["big"]  # one array, as pickle keeps it
    else:
        assert gathered is None
    shared = broadcast_from(mine if env.rank == 0 else None, src=0)
    assert _same(shared, _object(0))
    assert (shared is mine) == (env.rank == 0)
    return None


def test_gather_and_broadcast_hand_on_objects_with_their_arrays():
    result = launch(_share_worker, (), 3, timeout=LIMIT, grace=2.0, quiet=True)
    assert result.returncode == 0, result


def test_the_pickle_leaves_the_large_arrays_out():
    data, arrays = _pack(_object(1))
    # big (and again: the same array, once), ints, empty, the losses' values and held flags, nested
    assert [len(a) for a in arrays] == [LARGE + 3, LARGE, LARGE, 2 * LARGE, 2 * LARGE, LARGE + 1]
    assert len(data) < 2000  # the small arrays and the rest
    assert _same(_unpack(data, arrays), _object(1))
