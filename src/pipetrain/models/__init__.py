"""Example models whose top-level children are the pipeline units, and the model-spec registry."""

from pipetrain.models.batchnorm import find_batchnorm, refuse_batchnorm
from pipetrain.models.mlp import mlp
from pipetrain.models.registry import MODELS, build_model
from pipetrain.models.resmlp import ResidualBlock, resmlp
from pipetrain.models.resnet import BasicBlock, resnet_gn

__all__ = [
    "BasicBlock",
    "MODELS",
    "ResidualBlock",
    "build_model",
    "find_batchnorm",
    "mlp",
    "refuse_batchnorm",
    "resmlp",
    "resnet_gn",
]
