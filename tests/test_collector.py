"""When Python's cyclic collector runs (pipetrain.collector): not while modules load, nor while a
schedule is built; during the training loop, blind to setup's heap and collecting the loop's own garbage."""

import gc
import weakref

from pipetrain.collector import gc_paused, loading, setup_heap_frozen


class _Node:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.other = self


def test_setup_objects_are_out_of_sight_and_loop_garbage_is_collected() -> None:
    from_setup = _Node()
    setup_ref = weakref.ref(from_setup)
    with setup_heap_frozen():
        assert gc.get_freeze_count() > 0
        del from_setup
        gc.collect()
        assert setup_ref() is not None  # frozen: the collector does not walk it
        from_loop = _Node()
        loop_ref = weakref.ref(from_loop)
        del from_loop
        gc.collect()
        assert loop_ref() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert setup_ref() is None


def test_unfreezes_when_the_loop_fails() -> None:
    try:
        with setup_heap_frozen():
            raise RuntimeError("a failing run")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_what_loads_is_frozen_and_the_collector_runs_again_as_before() -> None:
    try:
        with loading():
            assert not gc.isenabled()
            loaded_then = _Node()
        assert gc.isenabled() and gc.get_freeze_count() > 0
        ref = weakref.ref(loaded_then)
        del loaded_then
        gc.collect()
        assert ref() is not None  # frozen with what loaded
    finally:
        gc.unfreeze()
    gc.collect()
    assert ref() is None
    gc.disable()
    try:
        with loading():
            pass
        assert not gc.isenabled()  # a caller's pause is kept
    finally:
        gc.unfreeze()
        gc.enable()


def test_a_paused_block_collects_nothing_and_resumes() -> None:
    with gc_paused():
        before = gc.get_stats()[0]["collections"]
        garbage = [_Node() for _ in range(20000)]
        del garbage
        assert gc.get_stats()[0]["collections"] == before
    assert gc.isenabled()

