"""Where the user's code raised: the place a one-line message names instead of a traceback.

An exception of a model, a loss or a data set passes through PyTorch, the standard library and
pipetrain's own machinery on its way up. The place worth naming is the innermost frame in none of
them (nor in code that torch.fx generated): where the user's code raised, or called what raised.
pipetrain's built-in models and data sets (``pipetrain.models``, ``pipetrain.data``) count as
the user's code: they are what the user chose to run. PyTorch is not imported here, so a factory's
exception is named before PyTorch is loaded.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import traceback

__all__ = ["user_frame", "raised_by_user", "where"]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_USER_SIDE = tuple(os.path.join(_PACKAGE, name) + os.sep for name in ("models", "data"))
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")})
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def _machinery(filename: str) -> bool:
    """Whether a frame of ``filename`` is not the user's (see the module docstring)."""
    if filename.startswith("<"):  # code generated at run time: torch.fx's forward, exec'd strings
        return True
    path = os.path.abspath(filename)
    torch = sys.modules.get("torch")
    if torch is not None and getattr(torch, "__file__", None) and path.startswith(os.path.dirname(torch.__file__) + os.sep):
        return True
    if path.startswith(_PACKAGE):
        return not path.startswith(_USER_SIDE)
    return path.startswith(_STDLIB) and not any(part in path for part in _INSTALLED)


def user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``error``'s traceback in the user's code, or ``None``."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    for frame in reversed(frames):
        if not _machinery(frame.filename):
            return frame
    return None


def raised_by_user(error: BaseException) -> bool:
    """Whether the user's code raised ``error`` itself (its innermost frame is the user's), rather
    than an operation it called (a PyTorch kernel refusing a shape)."""
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ is not None else []
    return bool(frames) and not _machinery(frames[-1].filename)


def where(error: BaseException) -> str:
    """``" (model.py:12, in forward)"``: the place :func:`user_frame` finds, or ``""``."""
    frame = user_frame(error)
    return "" if frame is None else f" ({os.path.basename(frame.filename)}:{frame.lineno}, in {frame.name})"
