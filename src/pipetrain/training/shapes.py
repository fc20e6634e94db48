"""The data checked against the model before training: the first training microbatch and the
first held-out batch, run through every stage and the loss on PyTorch's meta device.

Without it, a held-out set of the wrong shape stops the run at its first evaluation, after the
training, and a forward or a loss that raises on the data stops it only once the workers run. On
the meta device every operation computes the shape and dtype of its result by the rules of the
real kernel and no values: the check is exact for shapes and dtypes, costs no arithmetic and no
memory whatever the model's size, and works for a model built on meta, whose weights exist
nowhere yet. Each stage runs on meta stand-ins of its own parameters and buffers
(``torch.func.functional_call``: the model is not touched), on the value the stage before it
returned, in training mode for the training microbatch and in evaluation mode for the held-out
batch, as the run calls them; then the loss, which must return one number.

What the meta device cannot compute is not checked: an operation that reads values (``.item()``,
``if x.sum() > 0``, a shape that depends on the data) or has no meta kernel ends the check
silently, and the run finds out what it finds out as before. The data is read as the run reads
it: a training data set by its first microbatch (a ``DataLoader``'s batches are its own, made by
its collate function and workers, and are not read twice), held-out data as evaluation reads its
first batch. A worker started by pipetrain's launcher skips the check: the launcher made it.
Under torchrun rank 0, the rank that reads the data, makes it and tells the others the verdict.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from pipetrain.errors import ConfigError, PipetrainError
from pipetrain.execution.failures import StageNames, check_loss, forward_failure, loss_failure
from pipetrain.runtime.errors import collective
from pipetrain.spec import describe_exception
from pipetrain.structure import arguments, flatten, map_values
from pipetrain.training.cutting import first_microbatch
from pipetrain.training.outputs import eval_batches
from pipetrain.training.run import Run

__all__ = ["check_data", "stage_output_bytes", "microbatch_bytes", "MicrobatchBytes"]


def check_data(run: Run) -> None:
    """Refuse, in one :class:`~pipetrain.errors.ModelError`, the first training microbatch or the
    first held-out batch of ``run`` (a prepared :class:`~pipetrain.training.run.Run`) that the
    stages or the loss cannot take (see the module docstring). Under torchrun rank 0, which
    reads the data, checks, and every rank raises its verdict."""
    if os.environ.get("PIPETRAIN_LAUNCHER") == "1":
        return
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        _check(run)
        return
    verdict: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            _check(run)
        except PipetrainError as error:
            verdict[0] = error
        except Exception as error:  # noqa: BLE001 - the other ranks must not wait for a verdict that never comes
            verdict[0] = PipetrainError(f"rank 0 could not check the data at set-up: {describe_exception(error)}")
    collective("checking the data at set-up", lambda: dist.broadcast_object_list(verdict, src=0))
    if verdict[0] is not None:
        raise verdict[0]


def _check(run: Run) -> None:
    with torch.random.fork_rng(devices=[]):
        train_set = run.train_set
        if not isinstance(train_set, DataLoader) and not getattr(train_set, "fed_by_step", False):
            what = "the first training microbatch"
            with _reading(what):
                x, y = first_microbatch(run.config, run.layout.units_per_update, train_set, run.dtype)
            _through(run, x, y, f"at set-up (on the meta device), on {what}", training=True)
        if run.test_set is not None:
            held_out, what = eval_batches(run), "the first held-out batch"
            if len(held_out):
                with _reading(what):
                    x, y = held_out[0]
                _through(run, x, y, f"at set-up (on the meta device), on {what}", training=False)


@contextlib.contextmanager
def _reading(what: str) -> Iterator[None]:
    """A data set's error while reading ``what``, said to be there (and so before training)."""
    try:
        yield
    except ConfigError as error:
        raise ConfigError(f"at set-up, reading {what}: {error}") from None


def _unchecked(error: BaseException) -> bool:
    """Whether ``error`` says only that the meta device cannot run something, or that the module
    cannot be called with stand-ins of its tensors (no verdict on the data)."""
    if isinstance(error, NotImplementedError) or "meta" in str(error).lower():
        return True
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and frames[-1].filename.endswith(_FUNCTIONAL_CALL)


#: torch's own code that puts the stand-ins in place (an error there is not the data's)
_FUNCTIONAL_CALL = (os.path.join("nn", "utils", "stateless.py"), os.path.join("_functorch", "functional_call.py"))


def _through(run: Run, x: Any, y: Any, what: str, *, training: bool) -> None:
    """``x`` through every stage on meta, then the loss with ``y``; stops silently where the meta
    device cannot go on."""
    stages = run.staged.stages
    names = StageNames.of(run.schedule)  # the user's stages, with model chunks
    value = map_values(x, _meta)
    target = map_values(y, _meta)
    with torch.no_grad():
        for stage, module in enumerate(stages):
            leaves, structure = flatten(value)
            try:
                value = _call(module, value, training)
            except PipetrainError as error:  # a module's own refusal: said where it was met
                raise type(error)(f"{what}, {names(stage)}: {error}") from None
            except Exception as error:  # noqa: BLE001 - the user's forward may raise anything
                if _unchecked(error):
                    return
                raise forward_failure(stage, error, leaves, module, structure=structure,
                                      target=target if stage == len(stages) - 1 else None,
                                      what=what, names=names) from None
        last = len(stages) - 1
        try:
            loss = run.loss_fn(value, target)
        except PipetrainError as error:  # the loss's own refusal (pipetrain's cross entropy)
            raise type(error)(f"{what}, the loss of {names(last)}: {error}") from None
        except Exception as error:  # noqa: BLE001 - the user's loss may raise anything
            if _unchecked(error):
                return
            raise loss_failure(last, error, value, target, what=what, names=names) from None
        check_loss(last, loss, what=what, names=names)


@dataclass(frozen=True)
class MicrobatchBytes:
    """What one training microbatch occupies on a stage, by the meta device's shapes: ``output``,
    the stage's output (a SEND_F's payload besides the labels, and a SEND_B's back); ``held``, what
    the stage keeps from its forward until its backward: the tensors autograd saves, the received
    input and the output (each storage once; the stage's own parameters not); ``inputs``, the
    received input alone (what recomputation keeps instead)."""

    output: int
    held: int
    inputs: int


def stage_output_bytes(run: Run) -> list[int] | None:
    """Bytes of each stage's output for the run's first training microbatch (see
    :func:`microbatch_bytes`)."""
    sizes = microbatch_bytes(run)
    return None if sizes is None else [s.output for s in sizes]


def microbatch_bytes(run: Run) -> list[MicrobatchBytes] | None:
    """Each stage's :class:`MicrobatchBytes` for the run's first training microbatch, run through
    the stages with gradients on the meta device as :func:`check_data` runs it, once per run; None
    where the data or the meta device cannot tell (a ``DataLoader``, a step fed by the caller, an
    operation with no meta kernel)."""
    stages = tuple(map(id, run.staged.stages))  # sized again only if the stages were replaced
    if run.microbatch_sizes is None or run.microbatch_sizes[0] != stages:
        run.microbatch_sizes = (stages, _sized(run))
    return run.microbatch_sizes[1] or None


def _sized(run: Run) -> list[MicrobatchBytes]:
    """:func:`microbatch_bytes`, measured ([] where it cannot be)."""
    train_set = run.train_set
    if isinstance(train_set, DataLoader) or getattr(train_set, "fed_by_step", False):
        return []
    try:
        with torch.random.fork_rng(devices=[]):
            x, _ = first_microbatch(run.config, run.layout.units_per_update, train_set, run.dtype)
            value = map_values(x, _meta)
            sizes = []
            for index, module in enumerate(run.staged.stages):
                if index:  # a received input is a leaf that requires its gradient, as the runtime makes it
                    value = map_values(value, _received)
                inputs = _storages(value)
                saved: dict[int, int] = {}
                state = _stand_ins(module, grads=True)
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep_in(saved), _same):
                    value = _call(module, value, True, state)
                own = _storages(state)
                output = _storages(value)
                held = {**inputs, **output, **{k: v for k, v in saved.items() if k not in own}}
                sizes.append(MicrobatchBytes(sum(output.values()), sum(held.values()), sum(inputs.values())))
                value = map_values(value, lambda t: t.detach())
    except Exception:  # noqa: BLE001 - no verdict here: the run checked its data, this only sizes memory
        return []
    return sizes


def _storages(value: Any) -> dict[int, int]:
    """The bytes of each storage among ``value``'s tensors (views of one storage once)."""
    leaves, _ = flatten(value)
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor)}


def _keep_in(saved: dict[int, int]):
    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return tensor

    return pack


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _received(tensor: torch.Tensor) -> torch.Tensor:
    meta = _meta(tensor)
    return meta.requires_grad_() if meta.is_floating_point() else meta


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="meta")


def _call(module: nn.Module, value: Any, training: bool, state: dict[str, torch.Tensor] | None = None) -> Any:
    """``module`` on ``value`` under the boundary convention, with meta stand-ins of its tensors
    (``state``, default :func:`_stand_ins`) and every submodule in training or evaluation mode
    (each put back as it was)."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(training)
    try:
        args, kwargs = arguments(value)
        return torch.func.functional_call(module, _stand_ins(module) if state is None else state, tuple(args),
                                          kwargs, strict=False)
    finally:
        for m, mode in modes:
            m.training = mode


def _stand_ins(module: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Meta tensors in place of ``module``'s parameters and buffers; ``grads``: the trainable
    parameters' stand-ins require their gradient, as the real ones do."""
    state = {name: _meta(t).requires_grad_(grads and t.requires_grad) for name, t in module.named_parameters()}
    state.update((name, _meta(t)) for name, t in module.named_buffers())
    return state
