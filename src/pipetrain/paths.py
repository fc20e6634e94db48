"""Output paths checked before any work starts, so that a typo in ``--save`` costs no training.

Every command names its outputs (``--save``, ``--report-json``, ``--plot``, ``--out``, ...) and calls
:func:`check_outputs` before it reads data, builds a model, trains or solves; the Python API calls
it with the same names. A path is writable when it is not a directory (for a file) or not a file
(for a directory), and a file can be created where it will be written: in its directory, or, when
that does not exist yet, in the nearest directory above it that does (the writers create the rest).
That is tried for real, with a temporary file removed at once, so read-only file systems, missing
permissions and a file standing where a directory should be are all found, for any user (root too).
Nothing else is created. The module imports neither PyTorch nor anything that does.

Missing directories: inside the working directory the writers create every one a path needs
(``out/run1/model.pt`` in a fresh checkout); elsewhere only the output's own directory, the last
level of the path. ``--save /nonexistent/dir/m.pt`` is refused naming ``/nonexistent``: a mistyped
mount point or home directory becomes an error, never a tree of new directories.

Formats: an output whose writer picks its format (a picture, JSON) must say so by its suffix
(``formats=`` of :func:`check_outputs`): ``--plot p.txt`` is refused before the run, not by
matplotlib after it, and ``--trace t.png`` never writes JSON into a ``.png``. Saved weights
(:func:`check_save`) come in three forms: a directory (no suffix), one ``torch.save`` file (``.pt``,
``.pth``, ``.bin``, ``.ckpt``) or one safetensors file (``.safetensors``); any other suffix is refused.

Writing them: a SIGTERM that stops a process while it renames a temporary into place waits for
the rename (:func:`termination_deferred`), so no temporary is left beside an output.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
from typing import Iterator, Mapping, NamedTuple

from pipetrain.errors import ConfigError

__all__ = ["check_outputs", "check_output_file", "check_output_dir", "check_format", "check_save", "is_weights_dir",
           "is_safetensors_file", "Format", "SAFETENSORS",
           "IMAGE", "JSON", "TEXT", "WEIGHTS_INDEX", "WEIGHTS_SINGLE", "termination_deferred"]


class Format(NamedTuple):
    """What a writer makes of a file (``what``, for the message) and the suffixes that name it,
    the first one suggested."""

    what: str
    suffixes: tuple[str, ...]


#: a picture drawn by matplotlib, in the formats it writes with its own backends and Pillow
IMAGE = Format("a picture", (".png", ".pdf", ".svg", ".svgz", ".eps", ".ps", ".jpg", ".jpeg", ".tif", ".tiff",
                             ".webp"))
JSON = Format("JSON", (".json",))
#: a schedule's programs as text (``pipetrain schedule --csv``, read back by ``--load``)
TEXT = Format("text", (".csv", ".txt"))

#: the files of a weights directory (:mod:`pipetrain.weights`, HuggingFace's layout)
WEIGHTS_INDEX = "model.safetensors.index.json"
WEIGHTS_SINGLE = "model.safetensors"
#: file suffixes of a one-file ``--save`` written by ``torch.save``
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: the suffix of a one-file ``--save`` written as safetensors
SAFETENSORS = ".safetensors"


def _suffix(text: str) -> str:
    return os.path.splitext(os.path.basename(text))[1].lower()


def is_weights_dir(path: str | os.PathLike) -> bool:
    """Whether ``--save PATH`` names a weights directory (sharded safetensors) rather than one file:
    an existing directory, a path ending in a separator, or a name without a suffix (a suffix
    names one file: :func:`check_save` refuses one that names no form)."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)) or os.path.isdir(text):
        return True
    return not _suffix(text)


def is_safetensors_file(path: str | os.PathLike) -> bool:
    """Whether ``--save PATH`` names one safetensors file (``.safetensors``, not a directory)."""
    return not is_weights_dir(path) and _suffix(os.fspath(path)) == SAFETENSORS


def check_save(path: str | os.PathLike, option: str) -> None:
    """Refuse a ``--save`` path whose suffix names none of the forms weights are saved in, before a
    typo (``out.txt``, meant as a directory or a ``.pt``) becomes a directory of shards."""
    text = os.fspath(path)
    suffix = _suffix(text)
    if is_weights_dir(text) or suffix in FILE_SUFFIXES or suffix == SAFETENSORS:
        return
    raise ConfigError(
        f"{option} {text!r}: {suffix!r} names no form of saved weights; give a directory (a path without a suffix, "
        f"or ending in {os.sep}), one torch.save file ({', '.join(FILE_SUFFIXES)}) or one safetensors file "
        f"({SAFETENSORS})"
    )


def check_outputs(files: Mapping[str, str | None] | None = None,
                  directories: Mapping[str, str | None] | None = None,
                  formats: Mapping[str, Format] | None = None) -> None:
    """Check every output before the work that produces it: ``files`` and ``directories`` map the
    option that names an output (``"--save"``) to its path (``None``: not requested); ``formats``
    maps a file's option to the :class:`Format` its writer makes (``{"--plot": IMAGE}``). Raises one
    :class:`~pipetrain.errors.ConfigError` naming the option, the path and what to change."""
    for option, form in (formats or {}).items():
        path = (files or {}).get(option)
        if path:
            check_format(path, option, form)
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


def check_format(path: str | os.PathLike, option: str, form: Format) -> None:
    """Refuse a file whose suffix is not one of ``form``'s (case does not matter)."""
    text = os.fspath(path)
    root, suffix = os.path.splitext(text)
    if suffix.lower() in form.suffixes:
        return
    shown = ", ".join(form.suffixes) if len(form.suffixes) > 1 else form.suffixes[0]
    raise ConfigError(
        f"{option} {text!r}: {option} writes {form.what}, named by its suffix ({shown}); "
        f"{'there is none' if not suffix else f'{suffix!r} is not one'}: use e.g. {root + form.suffixes[0]!r}"
    )


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
    above it (which must then be a directory, so that the missing ones can be made: outside the
    working directory only ``directory`` itself, see the module docstring)."""
    existing, missing = directory, []
    while not os.path.lexists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        missing.append(existing)
        existing = parent
    if not os.path.isdir(existing):
        raise ConfigError(
            f"{option} {text!r} cannot be written: {existing!r} is a file, not a directory; choose another path"
        )
    if len(missing) > 1 and not _inside(directory, os.getcwd()):
        raise ConfigError(
            f"{option} {text!r}: {missing[-1]!r} does not exist; outside the working directory pipetrain creates "
            f"only the output's own directory ({directory!r}), not the ones above it: correct the path, or create "
            f"{missing[-1]!r} first"
        )
    try:
        handle, probe = tempfile.mkstemp(prefix=".pipetrain-check-", dir=existing)
    except OSError as error:
        what = "a file" if existing == directory else repr(missing[-1])
        raise ConfigError(
            f"{option} {text!r} cannot be written: cannot create {what} in {existing!r} "
            f"({error.strerror or error}); choose a writable path"
        ) from None
    os.close(handle)
    os.unlink(probe)


def _inside(path: str, directory: str) -> bool:
    """Whether ``path`` (absolute) is ``directory`` or lies below it."""
    try:
        return os.path.commonpath([path, os.path.abspath(directory)]) == os.path.abspath(directory)
    except ValueError:  # another drive (Windows)
        return False


@contextlib.contextmanager
def termination_deferred() -> Iterator[None]:
    """Hold a SIGTERM that arrives inside the block until it ends, then act on it as it would have.

    Writers of outputs write under a temporary name and rename it; a worker that a launcher stops
    (SIGTERM: pipetrain's launcher on Ctrl-C, a torchrun agent) in between left the temporary
    behind (``.manifest.json.tmp-*`` in a step directory). Inside the block the signal is only
    noted; when the block ends (renamed, or the temporary removed) it is delivered again to the
    handler that was there before, so the process ends as it would have, a moment later. Only the
    main thread can hold signals: elsewhere the block runs as is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
    except (ValueError, OSError):  # no signals here (an embedded interpreter)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: set outside Python
        if caught:
            os.kill(os.getpid(), signal.SIGTERM)
