"""How the stages of a model built on the meta device get their first values: one typed value
(:class:`Init`), read once where the user gives it (``--init``/``--init-from`` on the command line,
``init=`` in Python) and handed to :func:`pipetrain.stages.materialize.materialize`.

This module imports no PyTorch, so the command line reads and checks its options before PyTorch
loads; a run's weights directory is opened once, by its set-up, below
(:func:`pipetrain.stages.materialize.opened`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from pipetrain.errors import ConfigError

if TYPE_CHECKING:
    from pipetrain.weights import WeightsDir

__all__ = ["Init", "KINDS", "resolve_init", "init_from_flags"]

#: what gives the first values: each module's reset_parameters(), the user's function, a weights directory
KINDS = ("reset", "function", "weights")


@dataclass(frozen=True)
class Init:
    """A resolved initialiser.

    ``kind``: one of :data:`KINDS`; ``function``: the ``(module, name)`` callable of ``"function"``;
    ``path``: the weights directory of ``"weights"``. ``on_meta``: whether a model pipetrain builds
    from its spec (``--model``) is built on the meta device: always, except ``--init eager
    --init-from DIR``, where the model is built with values and then given the directory's.
    ``weights``: the directory opened (its index read), filled once by ``opened``.
    """

    kind: str
    function: Callable[[Any, str], Any] | None = None
    path: str | None = None
    on_meta: bool = True
    weights: WeightsDir | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Init kind must be one of {KINDS}, not {self.kind!r}")
        if (self.function is not None) != (self.kind == "function"):
            raise ValueError("an Init takes a function exactly when its kind is 'function'")
        if (self.path is not None) != (self.kind == "weights"):
            raise ValueError("an Init takes a path exactly when its kind is 'weights'")

    @property
    def given(self) -> str:
        """As the user gave it: ``"reset"``, the directory's path, or the function's name."""
        if self.kind == "function":
            return getattr(self.function, "__qualname__", type(self.function).__name__)
        return self.path if self.kind == "weights" else "reset"

    def describe(self) -> str:
        if self.kind == "weights":
            return f"weights from {self.path}"
        if self.kind == "function":
            return f"init function {self.given}"
        return "reset_parameters() under per-module seeds"


def resolve_init(init: Any) -> Init | None:
    """``None``, ``"reset"``, a function ``(module, name)`` or a weights directory's path as an
    :class:`Init` (an :class:`Init` as it is). Whether the directory holds weights is checked
    with the other options (:func:`pipetrain.training.validate.check_config`)."""
    if init is None or isinstance(init, Init):
        return init
    if callable(init):
        return Init("function", function=init)
    if isinstance(init, (str, os.PathLike)) and os.fspath(init):
        path = os.fspath(init)
        return Init("reset") if path == "reset" else Init("weights", path=path)
    raise ConfigError(f"init must be 'reset', a function (module, name) or a weights directory, not {init!r}")


def init_from_flags(init: str | None, init_from: str | None) -> Init | None:
    """``--init`` and ``--init-from`` read together (`pipetrain train` and `pipetrain profile`):
    ``--init meta`` builds the model on the meta device and resets it, ``--init-from DIR`` gives
    it the directory's values (on meta, unless ``--init eager``), ``--init eager`` alone (the
    default) builds it with values of its own."""
    if init_from is not None:
        return Init("weights", path=init_from, on_meta=init != "eager")
    return Init("reset") if init == "meta" else None
