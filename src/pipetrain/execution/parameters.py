"""A stage's module called on the parameters of a weight version, and the parameters its forward
saved read back at backward time from another version (inconsistent backward).

The module's structure is called with the parameters of the version the action reads, so several
versions can be in use at once and none is ever modified (the original PipeDream broke on PyTorch
>= 1.5 by updating weights that autograd had saved). Buffers (BatchNorm running statistics) are
the module's own and are not versioned.

Inconsistent backward (``latest`` and ``predict`` policies, Pipelined Backpropagation): the
forward runs under saved-tensor hooks that record any saved tensor sharing storage with a
parameter as a reference (name, size, stride, offset); when the backward runs, the reference is
resolved against the version the backward action names. So the error propagates through the
weights current at backward time while weight gradients use the activations stored at forward
time, for every layer whose backward reads the parameter tensor itself or a view of it (Linear,
Conv, embeddings, norm affine parameters, attention projections). A layer that saves a tensor
*computed* from a parameter (e.g. weight normalisation's ``g * v / |v|``) keeps the forward-time
value for that tensor.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor, nn

from pipetrain.errors import PipetrainError
from pipetrain.structure import Structure, arguments

__all__ = ["Parameters", "ParamRef", "SavedParameters", "INCONSISTENT"]

#: the version policies whose backward reads another version than its forward
INCONSISTENT = frozenset({"latest", "predict"})


class Parameters:
    """Calls a module with given parameter tensors in place of its own (like
    ``torch.func.functional_call``, restricted to parameters and without its per-call overhead,
    which matters at batch size 1 and small microbatches). Buffers stay the module's own."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.slots = []
        canonical = {id(p): name for name, p in module.named_parameters()}
        # every place that holds a parameter, tied ones included (an LM head reusing the embedding's
        # weight within this stage reads the same version as the embedding)
        for name, p in module.named_parameters(remove_duplicate=False):
            owner, _, attr = name.rpartition(".")
            self.slots.append((module.get_submodule(owner)._parameters, attr, canonical[id(p)]))

    def __call__(self, params: Mapping[str, Tensor], inputs: tuple, structure: Structure | None = None) -> Any:
        """``module`` on ``inputs`` (the leaves of a value of ``structure``, under the call convention
        of :mod:`pipetrain.structure`) with ``params``."""
        args, kwargs = (inputs, {}) if structure is None else arguments(structure.unflatten(inputs))
        saved = [(table, attr, table[attr]) for table, attr, _ in self.slots]
        try:
            for table, attr, name in self.slots:
                table[attr] = params[name]
            return self.module(*args, **kwargs)
        finally:
            for table, attr, original in saved:
                table[attr] = original


class ParamRef:
    """A saved tensor that is (a view of) a parameter, resolved at backward time."""

    __slots__ = ("name", "size", "stride", "offset")

    def __init__(self, name: str, tensor: Tensor) -> None:
        self.name = name
        self.size = tensor.size()
        self.stride = tensor.stride()
        self.offset = tensor.storage_offset()


class SavedParameters:
    """The saved-tensor hooks of an inconsistent backward: a forward under :meth:`recording` saves
    references to the parameters it read; a backward under :meth:`resolving` reads them from the
    version it is given."""

    def __init__(self) -> None:
        self._params: Mapping[str, Tensor] | None = None

    def recording(self, storage: dict[int, str]) -> Any:
        """Hooks that save a tensor in one of ``storage``'s (data pointer -> parameter name) as a
        :class:`ParamRef`."""
        def pack(tensor: Tensor) -> Any:
            name = storage.get(tensor.untyped_storage().data_ptr())
            return tensor if name is None else ParamRef(name, tensor)

        return torch.autograd.graph.saved_tensors_hooks(pack, self._unpack)

    @contextlib.contextmanager
    def resolving(self, params: Mapping[str, Tensor] | None) -> Iterator[None]:
        """References saved by the forward read from ``params`` meanwhile (``None``: no references)."""
        self._params = params
        try:
            yield
        finally:
            self._params = None

    def _unpack(self, saved: Any) -> Any:
        if isinstance(saved, ParamRef):
            if self._params is None:
                raise PipetrainError("internal error: a saved parameter was read outside a backward; please report "
                                     "this with the command")
            return self._params[saved.name].as_strided(saved.size, saved.stride, saved.offset)
        return saved
