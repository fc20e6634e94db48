"""A stage's forward or loss that fails, explained in one line: the user's exception by its type,
message and place, or the input an operation refused, and a loss that is not one number.

Two kinds of failure look alike in a traceback and need different words. When the user's code
raises (``raise ValueError(...)``, an ``assert``, a ``KeyError`` in a dict lookup), the message
names that exception, its type and the file and line it came from: the inputs are not the
problem. When a PyTorch operation refuses its input (a shape, a dtype, a device), the message
shows what the stage received, from where, and the module that failed. Either way it is a
:class:`~pipetrain.errors.ModelError` that names the stage and the microbatch; the executor that
runs the schedule adds the update and the rank (:func:`located`).

Messages name stages as the user asked for them (:class:`StageNames`): with interleaved's model
chunks, the schedule's stage 5 of ``stages=2, chunks=3`` is "chunk 2 of stage 1".
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from torch import Tensor, nn

from pipetrain.errors import ModelError, PipetrainError, StageError
from pipetrain.schedule.ir import Action, Schedule, format_action
from pipetrain.structure import Structure, describe
from pipetrain.usercode import raised_by_user, where

__all__ = ["StageNames", "PLAIN", "forward_failure", "loss_failure", "check_loss", "failing_module", "forward_errors",
           "computed_loss", "located"]


@dataclass(frozen=True)
class StageNames:
    """How a message names a stage of the schedule in the user's terms.

    The schedule's stages are the pieces the model is cut into. With model chunks (interleaved),
    each stage the user asked for holds several: of ``stages=2, chunks=3`` the schedule's stage 5
    (what its actions, ``5F0``, number) is chunk 2 of stage 1, and a message that said "stage 5"
    would name a stage the user never asked for. ``chunk_of[piece]`` is ``(stage, chunk)``, both
    counted from 0; empty where the pieces are the stages."""

    chunk_of: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, schedule: Schedule) -> StageNames:
        """The names of ``schedule``'s pieces: piece ``p`` held by rank ``r`` as its ``c``-th is
        chunk ``c`` of stage ``r`` (interleaved: piece ``c * S + r``)."""
        if schedule.chunks == 1:
            return cls()
        held = schedule.rank_stages()
        return cls(tuple((ranks[0], held[ranks[0]].index(piece)) for piece, ranks in enumerate(schedule.stage_ranks)))

    def __call__(self, piece: int) -> str:
        """``"stage 1"``, or ``"chunk 2 of stage 1"`` with model chunks."""
        if piece >= len(self.chunk_of):
            return f"stage {piece}"
        stage, chunk = self.chunk_of[piece]
        return f"chunk {chunk} of stage {stage}"

    def input_of(self, piece: int) -> str:
        """Where ``piece``'s input comes from: the data, or the piece before it."""
        return "the data" if piece == 0 else self(piece - 1)


#: the names where the pieces are the stages (no model chunks)
PLAIN = StageNames()


def failing_module(error: BaseException, root: nn.Module) -> str:
    """``" in module 'layer1.0.conv2' (Conv2d)"``: the innermost submodule of ``root`` whose
    ``forward`` was running when ``error`` was raised, or ``""`` (``root`` itself, or none)."""
    names = {id(module): name for name, module in root.named_modules()}
    found = ""
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self") if tb.tb_frame.f_code.co_name == "forward" else None
        name = names.get(id(owner)) if isinstance(owner, nn.Module) else None
        if name:
            found = f" in module {name!r} ({type(owner).__name__})"
        tb = tb.tb_next
    return found


def _text(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0].rstrip('.')}" if lines else type(error).__name__


def _shapes(inputs: Any, structure: Structure | None) -> str:
    if structure is None:  # a flat tuple: the shapes without their positions
        return ", ".join(describe(x) for x in inputs)
    return describe(structure.unflatten(inputs))


def _said(name: str, what: str, subject: str, rest: str) -> str:
    """``"stage 1: the loss raised ..."`` in training (the executor adds the step), ``"at set-up
    ..., the loss of stage 1 raised ..."`` with ``what``; ``name``: the stage's (:class:`StageNames`)."""
    return f"{what}, {subject} of {name} {rest}" if what else f"{name}: {subject} {rest}"


def forward_failure(stage: int, error: BaseException, inputs: Any, module: nn.Module, *,
                    structure: Structure | None = None, target: Any = None, microbatch: int | None = None,
                    what: str = "", names: StageNames = PLAIN) -> ModelError:
    """The error of ``stage``'s forward (``module`` called on ``inputs``, the leaves of a value of
    ``structure``) that raised ``error``. ``what`` says where, when not in training (``"at
    set-up, on the first held-out batch"``)."""
    inside = failing_module(error, module)
    if raised_by_user(error):
        message = _said(names(stage), what, "the forward", f"raised {_text(error)}{where(error)}{inside}")
    else:
        message = (f"{what + ', ' if what else ''}{names(stage)} cannot run on its input "
                   f"({_shapes(inputs, structure)}) from {names.input_of(stage)}: {_text(error)}{inside}"
                   f"{where(error)}")
        if isinstance(target, Tensor):
            message += f" (targets: {tuple(target.shape)})"
    return ModelError(message, stage=stage, microbatch=microbatch)


def loss_failure(stage: int, error: BaseException, output: Any, target: Any, *, microbatch: int | None = None,
                 what: str = "", names: StageNames = PLAIN) -> ModelError:
    """The error of the loss, called on the last stage's ``output`` and the ``target``."""
    if raised_by_user(error):
        rest = f"raised {_text(error)}{where(error)}"
    else:
        rest = (f"cannot take the model's output ({describe(output)}) and the targets ({describe(target)}): "
                f"{_text(error)}{where(error)}")
    return ModelError(_said(names(stage), what, "the loss", rest), stage=stage, microbatch=microbatch)


def check_loss(stage: int, loss: Any, *, microbatch: int | None = None, what: str = "",
               names: StageNames = PLAIN) -> None:
    """Refuse a loss that is not one number: training differentiates one scalar per microbatch
    (its mean over the samples, which pipetrain weights by the microbatch's share of the update)."""
    if isinstance(loss, Tensor) and loss.numel() == 1:
        return
    if isinstance(loss, Tensor):
        got = f"a {tuple(loss.shape)} tensor"
        fix = ("return its mean over the samples (reduction='mean', the default of torch.nn's losses, or "
               "loss.mean()); pipetrain weights each microbatch's mean by its share of the update")
    else:
        got = f"a {type(loss).__name__}"
        fix = "return a 0-dim tensor computed from the model's output, so that it can be differentiated"
    raise ModelError(_said(names(stage), what, "the loss", f"returned {got}, not one number: {fix}"),
                     stage=stage, microbatch=microbatch)


@contextlib.contextmanager
def forward_errors(stage: int, inputs: Any, module: nn.Module, *, structure: Structure | None, target: Any,
                   microbatch: int, names: StageNames = PLAIN) -> Iterator[None]:
    """Meanwhile (``stage``'s forward of ``microbatch`` on ``inputs``), whatever the user's code raises
    becomes one :func:`forward_failure`; the loss's :class:`ModelError` gets the microbatch."""
    try:
        yield
    except ModelError as error:  # the loss's (it names what it was called on)
        error.microbatch = microbatch
        raise
    except PipetrainError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the user's forward raises, named in one line
        raise forward_failure(stage, error, inputs, module, structure=structure, target=target,
                              microbatch=microbatch, names=names) from None


def computed_loss(stage: int, loss_fn: Callable[[Any, Any], Any], output: Any, target: Any,
                  names: StageNames = PLAIN) -> Tensor:
    """``loss_fn(output, target)``, one number, or a :class:`ModelError` that says what the loss
    raised or returned."""
    try:
        loss = loss_fn(output, target)
    except PipetrainError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the user's loss raises, named in one line
        raise loss_failure(stage, error, output, target, names=names) from None
    check_loss(stage, loss, names=names)
    return loss


def located(error: StageError, rank: int, action: Action, step_of_unit: Callable[[int], int],
            names: StageNames = PLAIN) -> StageError:
    """``error`` raised by a stage executor (a NaN loss, the user's exception), reworded with the
    update (step, counted from 1), the stage, the rank and the action; ``step_of_unit(k)`` is the
    update (from 0) unit ``k`` belongs to."""
    unit = error.microbatch if error.microbatch is not None else action.microbatch
    step = error.step if error.step is not None else step_of_unit(unit) + 1
    name = names(error.stage) if error.stage is not None else "a stage"
    text, prefix = str(error), f"{name}: "
    detail = text[len(prefix):] if text.startswith(prefix) else text
    return type(error)(
        f"step {step}, {name} on rank {rank} ({format_action(action)}): {detail}",
        stage=error.stage, step=step, microbatch=unit, rank=rank,
    )
