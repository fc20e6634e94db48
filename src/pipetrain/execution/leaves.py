"""The autograd leaves a stage's forward reads: one set per weight version, shared by the
microbatches that read it (their weight gradients accumulate on it), or a set of their own for
weights given with the forward or predicted by the optimizer (``predict``)."""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from pipetrain.execution.version_store import VersionStore

__all__ = ["ForwardLeaves"]


class ForwardLeaves:
    """Leaves of a stage's weights; those of ``trainable`` parameters take a gradient."""

    def __init__(self, trainable: frozenset[str]) -> None:
        self.trainable = trainable
        #: the shared set of each version a forward has read, until the version is dropped
        self.by_version: dict[int, dict[str, Tensor]] = {}
        self._predictions: list[dict[str, Tensor]] = []  # tensors of predictions no forward reads any more

    def read(self, versions: VersionStore, version: int, params: Mapping[str, Tensor] | None, predict: bool,
             optimizer: Any, samples_seen: int) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        """The leaves a forward of ``version`` reads, and the tensors a prediction wrote for it (if
        any): a set of their own for ``params`` when given, else (``predict``) for ``optimizer``'s
        prediction of the version, else the version's shared set."""
        if params is None and not predict:
            return self.of_version(versions, version), None
        if params is None and optimizer is not None:
            return self.predicted(versions[version], optimizer, samples_seen)
        return self.make(params if params is not None else versions[version]), None

    def make(self, params: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """A set of leaves of its own for ``params``."""
        return {n: t.detach().requires_grad_(n in self.trainable) for n, t in params.items()}

    def of_version(self, versions: VersionStore, version: int) -> dict[str, Tensor]:
        """The leaves that ``version``'s microbatches share."""
        leaves = self.by_version.get(version)
        if leaves is None:
            leaves = self.by_version[version] = self.make(versions[version])
        return leaves

    def predicted(self, params: Mapping[str, Tensor], optimizer: Any, samples_seen: int
                  ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Leaves of ``optimizer``'s prediction from ``params``, and the tensors the prediction wrote
        (into those of a prediction whose backward has run, when there is one; see :meth:`free`)."""
        made = optimizer.predict(params, samples_seen, out=self._predictions.pop() if self._predictions else None)
        return self.make(made), {n: t for n, t in made.items() if t is not params[n]}

    def free(self, predicted: dict[str, Tensor] | None) -> None:
        """After a microbatch's backward: the tensors its prediction wrote are free for the next."""
        if predicted:
            self._predictions.append(predicted)

    def forget(self, versions: VersionStore, version: int) -> None:
        """Drop ``version``'s shared leaves once the store no longer holds it."""
        if version in self.by_version and not versions.holds(version):
            del self.by_version[version]
