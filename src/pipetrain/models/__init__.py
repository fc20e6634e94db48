"""Example models (pipeline-unit Sequentials and ordinary modules), their loss, and the registry."""

from pipetrain.models.batchnorm import find_batchnorm, refuse_batchnorm
from pipetrain.models.generate import generate
from pipetrain.models.gpt import GPT, Block, CausalSelfAttention, gpt
from pipetrain.models.loss import IGNORE_INDEX, CrossEntropy, LossFn, accuracy_counts, cross_entropy, loss_for
from pipetrain.models.metrics import evaluate
from pipetrain.models.mlp import mlp
from pipetrain.models.registry import MODELS, build_model
from pipetrain.models.resmlp import ResidualBlock, resmlp
from pipetrain.models.resnet import BasicBlock, BlockHead, BlockTail, Shortcut, resnet_gn
from pipetrain.models.resnet_skip import ResNetGNSkip, SkipBlock, resnet_gn_skip

__all__ = [
    "BasicBlock",
    "Block",
    "BlockHead",
    "BlockTail",
    "CausalSelfAttention",
    "CrossEntropy",
    "GPT",
    "IGNORE_INDEX",
    "LossFn",
    "MODELS",
    "ResNetGNSkip",
    "ResidualBlock",
    "Shortcut",
    "SkipBlock",
    "accuracy_counts",
    "build_model",
    "cross_entropy",
    "evaluate",
    "find_batchnorm",
    "generate",
    "gpt",
    "loss_for",
    "mlp",
    "refuse_batchnorm",
    "resmlp",
    "resnet_gn",
    "resnet_gn_skip",
]
