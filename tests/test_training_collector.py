"""The training loop runs with setup's heap frozen, and its own garbage is still collected."""

import gc
import weakref

from pipetrain.training.collector import setup_heap_frozen


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
