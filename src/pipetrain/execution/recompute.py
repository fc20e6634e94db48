"""Activation recomputation (``recompute=True``): a stage's forward run again in the backward.

The first forward records no graph and the stage keeps only its inputs (and the random state the
forward started from); the backward first runs the forward again on the same autograd leaves the
first forward read (the version its action named: weight stashing), with the same random numbers
(dropout masks), and on copies of the module's buffers (a BatchNorm's running statistics count
each microbatch once). The recomputed forward is the same arithmetic as the first, so its graph,
and the gradients, are bitwise those of a run without recomputation. Under ``latest`` and
``predict`` the recomputation reads the forward's weights while the backward resolves parameters
to the backward's version, as without recomputation; so the forward's weights must survive until
the backward: an update never overwrites a version in place while a microbatch that read it waits
for its recomputation, and :func:`pipetrain.schedule.memory_by_rank` counts such versions as held.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, TypeVar

import torch
from torch import nn

__all__ = ["STOCHASTIC", "Recomputation", "is_stochastic", "microbatch_seed", "rng_state", "set_rng_state"]

#: the modules that draw random numbers in training (a stage with one seeds each microbatch)
STOCHASTIC = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)

T = TypeVar("T")


def is_stochastic(module: nn.Module) -> bool:
    """Whether ``module`` holds a dropout that drops anything."""
    return any(isinstance(m, STOCHASTIC) and m.p > 0 for m in module.modules())


def microbatch_seed(seed: int, stage: int, microbatch: int) -> int:
    """The seed of ``microbatch``'s forward on ``stage`` of a run seeded ``seed`` (a stage with dropout)."""
    return (seed * 1_000_003 + stage) * 1_000_003 + microbatch


def rng_state(device: torch.device) -> tuple:
    """The random state a forward on ``device`` draws from (the CPU's, and the GPU's on CUDA)."""
    if device.type == "cuda":
        return torch.get_rng_state(), torch.cuda.get_rng_state(device)
    return (torch.get_rng_state(),)


def set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state(state[1], device)


class Recomputation:
    """The random numbers and the buffers of a stage's forwards, so that one can run again alike.

    Args:
        module: the stage's module (its buffers are swapped for copies while a forward runs again).
        device: where the stage computes (whose random state a forward draws from).
        seed: a stage with dropout seeds each microbatch with ``seed(microbatch)``, recomputed or
            not (``None``: a stage without dropout, whose forward starts from the random state).
        enabled: whether forwards are recomputed (else :meth:`begin` keeps no random state).
    """

    def __init__(self, module: nn.Module, device: torch.device, seed: Callable[[int], int] | None,
                 enabled: bool) -> None:
        self.device = device
        self.seed = seed
        self.enabled = enabled
        # where each buffer lives (its module's table and name)
        self._buffer_tables = [(module.get_submodule(owner)._buffers, attr)
                               for owner, _, attr in (name.rpartition(".") for name, _ in module.named_buffers())]

    def begin(self, microbatch: int) -> tuple | None:
        """Before the first forward of ``microbatch``: seeds it (a stage with dropout), or returns the
        random state to start its recomputation from (``None`` when there is nothing to keep)."""
        if self.seed is not None:
            torch.manual_seed(self.seed(microbatch))
            return None
        return rng_state(self.device) if self.enabled else None

    @contextlib.contextmanager
    def buffer_copies(self) -> Iterator[None]:
        """The module's buffers replaced by copies meanwhile: what a forward run again writes into
        them (running statistics), or what its graph saves of them, is dropped afterwards."""
        originals = [(table, attr, table[attr]) for table, attr in self._buffer_tables]
        try:
            for table, attr, buffer in originals:
                table[attr] = buffer.clone()
            yield
        finally:
            for table, attr, buffer in originals:
                table[attr] = buffer

    def again(self, microbatch: int, state: tuple | None, forward: Callable[[], T]) -> T:
        """``forward()`` run again recording a graph, with the random numbers of the first run
        (``state``, from :meth:`begin`) and on copies of the buffers; the caller's random state is
        left as it was."""
        devices = [self.device] if self.device.type == "cuda" else []
        with self.buffer_copies(), torch.random.fork_rng(devices=devices), torch.enable_grad():
            if state is not None:
                set_rng_state(self.device, state)
            elif self.seed is not None:
                torch.manual_seed(self.seed(microbatch))
            return forward()
