"""Errors of the distributed runtime: lost or silent peers, protocol mismatches, bad checkpoints."""

from __future__ import annotations

import torch.distributed as dist

from pipetrain.errors import DataWorkerLost, PipetrainError  # noqa: F401 - DataWorkerLost: (re-exported)

__all__ = [
    "CommunicationError",
    "PeerTimeoutError",
    "PeerLostError",
    "ProtocolError",
    "LaunchError",
    "JoinError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointPeerError",
    "DataWorkerLost",
    "collective",
]


class CommunicationError(PipetrainError):
    """A transfer between two ranks failed; the message names the action that was waiting."""

    exit_status = 3  # a lost or timed-out peer (a user error is 2)


class PeerTimeoutError(CommunicationError):
    """A peer sent nothing within the timeout: it hangs, is slower than the timeout, or its program
    never posts the matching send. Fatal: gloo closes the connection after a timeout."""


class PeerLostError(CommunicationError):
    """The connection to a peer closed: the peer process died or exited early."""


class ProtocolError(CommunicationError):
    """Two ranks disagree about what is sent next (their programs do not match)."""


class LaunchError(PipetrainError):
    """Workers could not be started, or the distributed environment is incomplete."""


class JoinError(LaunchError):
    """A worker could not join the run within the timeout: a peer never came, or is unreachable."""

    exit_status = 3


class CheckpointError(PipetrainError):
    """A checkpoint is missing, incomplete or corrupted, or could not be written."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint was written for a different model, schedule or configuration than this run."""


class CheckpointPeerError(CheckpointError):
    """A checkpoint could not be committed because another rank did not take its part in time:
    it is gone or stuck (a lost or timed-out peer, not a bad checkpoint)."""

    exit_status = 3


def collective(what: str, call):
    """``call()``, a collective of torch.distributed, whose failure (a peer died or is stuck: gloo's
    own error is 30 lines of C++) becomes one :class:`PeerLostError` naming ``what``."""
    try:
        return call()
    except RuntimeError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise PeerLostError(f"rank {dist.get_rank()}: {what} failed because a peer is gone or stuck ({first})") from None
