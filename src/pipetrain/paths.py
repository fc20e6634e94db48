"""Output paths checked before any work starts, so that a typo in ``--save`` costs no training.

Every command names its outputs (``--save``, ``--report-json``, ``--plot``, ``--out``, ...) and calls
:func:`check_outputs` before it reads data, builds a model, trains or solves; the Python API calls
it with the same names. A path is writable when it is not a directory (for a file) or not a file
(for a directory), and a file can be created where it will be written: in its directory, or, when
that does not exist yet, in the nearest directory above it that does (the writers create the rest).
That is tried for real, with a temporary file removed at once, so read-only file systems, missing
permissions and a file standing where a directory should be are all found, for any user (root too).
Nothing else is created. The module imports neither PyTorch nor anything that does.
"""

from __future__ import annotations

import os
import tempfile
from typing import Mapping

from pipetrain.errors import ConfigError

__all__ = ["check_outputs", "check_output_file", "check_output_dir", "is_weights_dir", "WEIGHTS_INDEX",
           "WEIGHTS_SINGLE"]

#: the files of a weights directory (:mod:`pipetrain.weights`, HuggingFace's layout)
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_SINGLE = "model.safetensors"
#: file suffixes of a one-file ``--save`` (torch.save); any other path is a weights directory
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def is_weights_dir(path: str | os.PathLike) -> bool:
    """Whether ``--save PATH`` names a weights directory (sharded safetensors) rather than one file:
    an existing directory, a path ending in a separator, or a name without a file suffix
    (``.pt``, ``.pth``, ``.bin``, ``.ckpt`` are files written by ``torch.save``)."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)) or os.path.isdir(text):
        return True
    return not text.lower().endswith(FILE_SUFFIXES)


def check_outputs(files: Mapping[str, str | None] | None = None,
                  directories: Mapping[str, str | None] | None = None) -> None:
    """Check every output before the work that produces it: ``files`` and ``directories`` map the
    option that names an output (``"--save"``) to its path (``None``: not requested). Raises one
    :class:`~pipetrain.errors.ConfigError` naming the option, the path and what to change."""
    seen: dict[str, str] = {}
    for kind, outputs in (("file", files or {}), ("directory", directories or {})):
        for option, path in outputs.items():
            if path is None or path == "":
                continue
            key = os.path.abspath(os.fspath(path))
            if key in seen:
                raise ConfigError(f"{seen[key]} and {option} both name {path!r}; give each output its own path")
            seen[key] = option
            if kind == "file":
                check_output_file(path, option)
            else:
                check_output_dir(path, option)


def check_output_file(path: str | os.PathLike, option: str = "output") -> None:
    """Refuse a file output that could not be written (see the module docstring)."""
    text = os.fspath(path)
    full = os.path.abspath(text)
    if os.path.isdir(full):
        raise ConfigError(f"{option} {text!r} is a directory; name a file in it, e.g. {os.path.join(text, 'out')!r}")
    if os.path.lexists(full) and not os.access(full, os.W_OK):
        raise ConfigError(f"{option} {text!r} exists and is not writable; choose another path or change its permissions")
    _check_can_create_in(os.path.dirname(full), text, option)


def check_output_dir(path: str | os.PathLike, option: str = "output directory") -> None:
    """Refuse a directory output that could not be written in (see the module docstring)."""
    text = os.fspath(path)
    full = os.path.abspath(text)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise ConfigError(f"{option} {text!r} is a file, not a directory; name a directory (it is created if missing)")
    _check_can_create_in(full, text, option)


def _check_can_create_in(directory: str, text: str, option: str) -> None:
    """Create and remove a temporary file in ``directory``, or in the nearest existing directory
    above it (which must then be a directory, so that the missing ones can be made)."""
    existing = directory
    while not os.path.lexists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{option} {text!r} cannot be written: {existing!r} is a file, not a directory; choose another path"
        )
    try:
        handle, probe = tempfile.mkstemp(prefix=".pipetrain-check-", dir=existing)
    except OSError as error:
        where = "in" if existing == directory else "the missing directories under"
        raise ConfigError(
            f"{option} {text!r} cannot be written: cannot create a file {where} {existing!r} "
            f"({error.strerror or error}); choose a writable path"
        ) from None
    os.close(handle)
    os.unlink(probe)
