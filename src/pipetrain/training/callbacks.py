"""Hooks a user's code gets called at during `Pipeline.fit`: losses, evaluations, checkpoints."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipetrain.errors import ArgumentError

__all__ = ["Callback", "Callbacks"]


class Callback:
    """Override what you need. Each hook runs on the ranks that have what it reports, in the
    worker processes of a distributed run: ``on_update`` where the last stage computes that
    update's loss, ``on_evaluation`` where the last stage lives, ``on_checkpoint`` and ``on_end``
    on every rank. Keep them quick: they run between pipeline actions."""

    def on_update(self, step: int, loss: float) -> None:
        """Update ``step`` (0-based) finished with mean loss ``loss``."""

    def on_evaluation(self, step: int, metrics: dict[str, float]) -> None:
        """Held-out ``metrics`` after ``step`` updates."""

    def on_checkpoint(self, step: int, path: str) -> None:
        """A checkpoint after ``step`` updates was written to ``path``."""

    def on_end(self, result: Any) -> None:
        """The run's :class:`~pipetrain.training.result.TrainResult`."""


_HOOKS = ("on_update", "on_evaluation", "on_checkpoint", "on_end")


class Callbacks:
    """Calls every callback in order (a plain function counts as ``on_update``)."""

    def __init__(self, callbacks: Iterable[Any] = ()) -> None:
        if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
            raise ArgumentError(f"callbacks takes a list of Callback objects or functions f(step, loss), not "
                                f"{type(callbacks).__name__} {repr(callbacks)[:40]}")
        self.items = list(callbacks)
        for callback in self.items:
            if not (callable(callback) or any(hasattr(callback, hook) for hook in _HOOKS)):
                raise ArgumentError(f"callbacks: {repr(callback)[:40]}, of type {type(callback).__name__}, is neither a "
                                    f"Callback (with on_update, on_evaluation, on_checkpoint or on_end) nor a "
                                    f"function f(step, loss)")

    def __bool__(self) -> bool:
        return bool(self.items)

    def _each(self, hook: str, *args: Any) -> None:
        for callback in self.items:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)
            elif hook == "on_update" and callable(callback):
                callback(*args)

    def update(self, step: int, loss: float) -> None:
        self._each("on_update", step, loss)

    def evaluation(self, step: int, metrics: dict[str, float]) -> None:
        self._each("on_evaluation", step, metrics)

    def checkpoint(self, step: int, path: str) -> None:
        self._each("on_checkpoint", step, path)

    def end(self, result: Any) -> None:
        self._each("on_end", result)
