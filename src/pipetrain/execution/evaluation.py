"""A stage's forward on held-out data: the current weights, the module in eval mode (dropout off,
BatchNorm on its running statistics), no graph, and a failure named as in training."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor, nn

from pipetrain.errors import PipetrainError
from pipetrain.execution.device import autocast_on, to_device
from pipetrain.execution.failures import PLAIN, StageNames, forward_failure
from pipetrain.execution.parameters import Parameters
from pipetrain.structure import flatten

__all__ = ["evaluate_stage"]


def evaluate_stage(stage: int, call: Parameters, params: Mapping[str, Tensor], inputs: Any, device: torch.device,
             autocast: torch.dtype | None = None, names: StageNames = PLAIN) -> Any:
    """``call``'s module on ``inputs`` (moved to ``device``) with ``params``, in eval mode (its mode
    is put back afterwards); a failure of the user's code is a :class:`~pipetrain.errors.ModelError`
    that names stage ``stage``."""
    module: nn.Module = call.module
    was_training = module.training
    module.eval()
    leaves, structure = flatten(inputs)
    try:
        with torch.no_grad(), autocast_on(device, autocast):
            return call(params, to_device(leaves, device, non_blocking=True), structure)
    except PipetrainError:
        raise
    except Exception as error:  # noqa: BLE001 - as in the forward of training
        raise forward_failure(stage, error, leaves, module, structure=structure, what="on held-out data",
                              names=names) from None
    finally:
        module.train(was_training)
