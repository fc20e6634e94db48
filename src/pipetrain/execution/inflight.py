"""What a microbatch leaves on a stage between its forward and its backward, and the table of
them a stage keeps: the inputs (or the graph) the backward needs, the leaves of the version the
forward read, and the scales of its loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from pipetrain.errors import PipetrainError
from pipetrain.execution.device import to_device
from pipetrain.structure import Structure, flatten

__all__ = ["InFlight", "InFlightTable", "Gradients", "constants_of", "forward_inputs"]

Gradients = tuple[Tensor | None, ...]


@dataclass
class InFlight:
    """What a microbatch leaves on a stage between its forward and its backward."""

    inputs: tuple  # the stage inputs' leaves (pipetrain.structure), as autograd leaves (or raw values)
    roots: tuple[Tensor, ...]  # outputs (or the scaled loss) to differentiate
    leaves: dict[str, Tensor]  # trainable parameters of the version the forward read
    samples: int
    version: int = 0
    target: Any = None
    loss_scale: float = 1.0
    scale: float = 1.0  # float16: the loss scale stamped on this microbatch by stage 0
    grad_outputs: tuple | None = None
    storage: dict[int, str] = field(default_factory=dict)
    leaf_set: Any = None  # all leaves of the version the forward read (the same object per version)
    microbatch: int = 0
    rng: Any = None  # recomputation: the random state the forward started from (None: a per-microbatch seed)
    predicted: dict[str, Tensor] | None = None  # the tensors the optimizer's prediction wrote, if it made any
    structure: Structure | None = None  # how the inputs' leaves make the value the stage is called with
    weight_half: Any = None  # after the I half of a split backward: what W starts from (split_backward.WeightHalf)

    def scaled(self, loss: Tensor) -> Tensor:
        """What the last stage differentiates: the loss times its share of the update's batch, and
        under float16 times the loss scale (a power of two: the product is exact)."""
        factor = self.loss_scale * self.scale
        return loss * factor if factor != 1.0 else loss

    def differentiable(self, grad_outputs: Sequence | None) -> tuple[list[Tensor], list[Tensor] | None]:
        """The roots to differentiate and their gradients (``grad_outputs`` ``None``: the loss). A
        root that requires grad but got no gradient was used by the later stages in no
        differentiable way (a mask that only chose a causal kernel, a value passed on and never
        used): it adds nothing, as in one process."""
        if grad_outputs is None:  # the last stage: the loss
            return [r for r in self.roots if isinstance(r, Tensor) and r.requires_grad], None
        roots, grads = [], []
        for index, root in enumerate(self.roots):
            if isinstance(root, Tensor) and root.requires_grad and index < len(grad_outputs):
                grad = grad_outputs[index]
                if grad is not None:
                    roots.append(root)
                    grads.append(grad)
        return roots, grads

    def input_positions(self) -> list[int]:
        """The positions of the inputs that take a gradient."""
        return [i for i, x in enumerate(self.inputs) if isinstance(x, Tensor) and x.requires_grad]

    def input_gradients(self, positions: list[int], grads: Sequence) -> Gradients:
        """One gradient per input: ``grads`` at ``positions``, ``None`` elsewhere."""
        out: list[Tensor | None] = [None] * len(self.inputs)
        for position, grad in zip(positions, grads):
            out[position] = grad
        return tuple(out)


class InFlightTable(dict[int, InFlight]):
    """A stage's microbatches in flight, by microbatch number."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        self.stage = stage

    def check_new(self, microbatch: int) -> None:
        if microbatch in self:
            raise PipetrainError(f"stage {self.stage}: microbatch {microbatch} is already in flight")

    def record(self, microbatch: int) -> InFlight:
        """``microbatch``'s record, which its backward reads (an error if its forward did not run)."""
        try:
            return self[microbatch]
        except KeyError:
            raise PipetrainError(
                f"stage {self.stage}: backward of microbatch {microbatch}, whose forward has not run here"
            ) from None

    def take(self, microbatch: int) -> InFlight:
        """:meth:`record`, no longer in flight."""
        record = self.record(microbatch)
        del self[microbatch]
        return record

    def awaits_recomputation(self, version: int) -> bool:
        """Whether a microbatch in flight will recompute its forward on ``version``'s tensors."""
        return any(r.version == version and not r.roots and r.weight_half is None for r in self.values())


def forward_inputs(inputs: Any, device: torch.device, take_grad: bool, constants: int) -> tuple[tuple, Any]:
    """The leaves of ``inputs`` (and their :class:`~pipetrain.structure.Structure`, ``None`` for a
    tensor or a flat tuple) on ``device``; with ``take_grad`` (stages after the first) the floating
    ones become autograd leaves, except non-floating ones (ids, masks) and those ``constants`` (the
    previous stage's :func:`constants_of`, bit ``i``: leaf ``i``) marks: a float mask that needs no
    gradient stays a plain tensor, so that the stage computes exactly what one process computes
    (attention picks its kernel by whether the mask requires grad)."""
    leaves, structure = flatten(inputs)
    leaves = to_device(leaves, device, non_blocking=True)
    if take_grad:
        leaves = tuple(
            x.detach().requires_grad_(True)
            if isinstance(x, Tensor) and x.is_floating_point() and not (constants >> i) & 1 else x
            for i, x in enumerate(leaves)
        )
    return leaves, structure


def constants_of(outputs: tuple, inputs: tuple, recomputed: bool) -> int:
    """The floating ``outputs`` that need no gradient, bit ``i`` for output ``i`` (the next stage's
    ``constants``). A forward without a graph (``recomputed``: recomputation) cannot tell a new
    tensor that needs no gradient from one that does: there only the inputs it hands on unchanged
    are known (a mask made by an earlier stage); it marks nothing else."""
    passed = {id(x) for x in inputs if isinstance(x, Tensor) and not x.requires_grad} if recomputed else None
    mask = 0
    for i, o in enumerate(outputs):
        if (isinstance(o, Tensor) and not o.requires_grad and i < 62 and o.is_floating_point()
                and (passed is None or id(o) in passed)):
            mask |= 1 << i
    return mask
