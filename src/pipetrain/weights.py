"""Model weights as files in HuggingFace's sharded safetensors layout: written by stage, read by tensor.

A weights directory holds shards and an index, under the unsplit model's state-dict names::

    DIR/model-00001-of-00004.safetensors     the tensors of the stages of rank 0 (safetensors)
    DIR/model-00002-of-00004.safetensors     ...
    DIR/model.safetensors.index.json         {"metadata": {"total_size": N}, "weight_map": {name: shard}}
    DIR/config.json                          a HuggingFace model's config (only for such models)

This is the layout ``transformers`` writes with ``save_pretrained`` and reads with
``from_pretrained``, so a HuggingFace model trained here loads there. Each rank writes the shard of
its own stages (no rank ever holds the whole model), then rank 0 writes the index, the commit point
(:func:`write_index`). A tensor several names share (tied weights, an LM head reusing the
embedding) is stored once, under its first name, as ``save_pretrained`` does. A directory with one
``model.safetensors`` and no index (a small ``save_pretrained``) reads the same way.

Reading is lazy (:class:`WeightsDir`): a rank asks for the tensors of its stages by name and only
their bytes are read (``safetensors.safe_open``), which is how a model larger than one process
starts from pretrained weights (``init="DIR"``, ``--init-from DIR``).
:func:`pipetrain.load_weights` (:mod:`pipetrain.stages.materialize`) loads a whole directory into
an unsplit model.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from pipetrain.errors import ConfigError, PipetrainError, option
from pipetrain.paths import WEIGHTS_INDEX as INDEX
from pipetrain.paths import WEIGHTS_SINGLE as SINGLE
from pipetrain.paths import is_weights_dir, termination_deferred

__all__ = [
    "INDEX",
    "SINGLE",
    "CONFIG",
    "WeightsDir",
    "is_weights_dir",
    "save_weights",
    "shard_name",
    "write_index",
    "write_shard",
    "commit_shards",
    "discard_shards",
]

CONFIG = "config.json"
_SHARD = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


def _safetensors() -> Any:
    try:
        import safetensors.torch  # late, so that a broken environment gets this message, not a traceback
    except ImportError:  # a dependency of pipetrain; missing only in a broken environment
        raise ConfigError("weights directories need the safetensors package: pip install safetensors") from None
    return safetensors


def shard_name(index: int, count: int) -> str:
    """``model-00002-of-00004.safetensors`` for shard 1 (from 0) of 4."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor of ``tensor``'s values (safetensors writes whole storages)."""
    value = tensor.detach()
    if value.device.type != "cpu":
        value = value.cpu()
    return value.contiguous()


def write_shard(
    directory: str | os.PathLike, name: str, tensors: Mapping[str, torch.Tensor], *, commit: bool = True
) -> dict[str, Any]:
    """Write ``tensors`` (unsplit names) as shard ``name`` of ``directory``, atomically (a temporary
    file renamed); returns its record ``{"name", "keys", "bytes"}`` for :func:`write_index`. Names
    of one tensor (tied weights: the same memory) are stored once, under the first.

    With ``commit=False`` the shard stays under its temporary name (the record's ``"tmp"``) until
    :func:`commit_shards` renames it, or :func:`discard_shards` removes it: several writers rename
    their shards only once every one of them has written its own, so a save that fails anywhere (a
    full disk) leaves no shard of its own, and an earlier save in the directory stays whole. A
    failed write raises its ``OSError`` (``ENOSPC``), whatever safetensors turned it into; the
    temporary is removed."""
    st = _safetensors()
    target = Path(directory) / name
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    values, seen = {}, set()
    for key, value in tensors.items():
        same = (value.device, value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if same not in seen or not value.numel():  # (empty tensors own no memory to share)
            seen.add(same)
            values[key] = _host(value)
    with termination_deferred():
        try:
            try:
                st.torch.save_file(values, str(tmp), metadata={"format": "pt"})
            except Exception as error:  # noqa: BLE001 - safetensors' own error class holds the OSError's text only
                raise _os_error(error, tmp) from None
            if commit:
                os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    size = sum(v.numel() * v.element_size() for v in values.values())
    record = {"name": name, "keys": sorted(values), "bytes": size}
    return record if commit else dict(record, tmp=tmp.name)


def _os_error(error: Exception, path: Path) -> Exception:
    """The ``OSError`` behind a failed safetensors write ("I/O error: No space left on device (os
    error 28)"), or ``error`` itself when it was something else."""
    if isinstance(error, OSError):
        return error
    found = re.search(r"os error (\d+)", str(error))
    if found is None:
        return error
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def commit_shards(directory: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> None:
    """Rename the shards :func:`write_shard` left under temporary names (``commit=False``)."""
    d = Path(directory)
    for record in records:
        if record.get("tmp"):
            with termination_deferred():
                os.replace(d / record["tmp"], d / record["name"])


def discard_shards(directory: str | os.PathLike, records: Iterable[Mapping[str, Any] | None]) -> None:
    """Remove the temporaries of shards written with ``commit=False`` (a save that failed elsewhere)."""
    d = Path(directory)
    for record in records:
        if record is not None and record.get("tmp"):
            (d / record["tmp"]).unlink(missing_ok=True)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    with termination_deferred():
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def write_index(directory: str | os.PathLike, records: Iterable[Mapping[str, Any]], config: str | None = None) -> Path:
    """Write ``model.safetensors.index.json`` for the shards ``records`` (from :func:`write_shard`),
    and ``config.json`` when ``config`` (its JSON text) is given; then remove the shards of an
    earlier save that this one does not list. The index is written last: it is what readers open."""
    d = Path(directory)
    records = list(records)
    weight_map: dict[str, str] = {}
    for record in records:
        for key in record["keys"]:
            if key in weight_map:
                raise PipetrainError(f"internal error: {key!r} was written to {weight_map[key]} and to {record['name']}")
            weight_map[key] = record["name"]
    if config is not None:
        _atomic_text(d / CONFIG, config)
    index = {"metadata": {"total_size": sum(r["bytes"] for r in records)},
             "weight_map": dict(sorted(weight_map.items()))}
    _atomic_text(d / INDEX, json.dumps(index, indent=2) + "\n")
    written = {r["name"] for r in records}
    for entry in d.iterdir():
        if _SHARD.match(entry.name) and entry.name not in written and entry.is_file() and not entry.is_symlink():
            entry.unlink()
    single = d / SINGLE
    if single.is_file() and not single.is_symlink():  # an older unsharded save would be read first by some tools
        single.unlink()
    return d / INDEX


def save_weights(directory: str | os.PathLike, shards: list[Mapping[str, torch.Tensor]], config: str | None = None) -> Path:
    """Write a whole weights directory from one process: one shard per entry of ``shards``; when
    one cannot be written, none is renamed into place."""
    records: list[dict[str, Any]] = []
    try:
        for i, shard in enumerate(shards):
            records.append(write_shard(directory, shard_name(i, len(shards)), shard, commit=False))
    except BaseException:
        discard_shards(directory, records)
        raise
    commit_shards(directory, records)
    return write_index(directory, records, config)


def model_config_json(model: nn.Module) -> str | None:
    """A HuggingFace model's ``config.json`` text (``from_pretrained`` needs it), else ``None``."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    if not callable(to_json):
        return None
    try:
        return to_json(use_diff=False)
    except TypeError:
        return to_json()


class WeightsDir:
    """A weights directory (or one ``.safetensors`` file) opened for reading by tensor name.

    Only the index is read when it opens; :meth:`get` reads the named tensors' bytes and nothing
    else. Shard names in the index must be plain file names of the directory (an index is input:
    it may not point anywhere else).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._open: dict[str, Any] = {}
        if self.path.is_file() and self.path.suffix == ".safetensors":
            self.root, files = self.path.parent, {self.path.name: None}
        elif self.path.is_dir():
            self.root = self.path
            files = self._read_index()
        else:
            raise ConfigError(
                f"weights {str(path)!r}: no such directory; give a directory written by {option('save', 'DIR')} "
                f"(or a HuggingFace save_pretrained directory) holding {INDEX} or {SINGLE}"
            )
        self.file_of: dict[str, str] = {}
        for name, keys in files.items():
            handle = self._handle(name)
            for key in (handle.keys() if keys is None else keys):
                self.file_of[key] = name

    def _read_index(self) -> dict[str, list[str] | None]:
        index = self.root / INDEX
        if not index.is_file():
            if (self.root / SINGLE).is_file():
                return {SINGLE: None}
            raise ConfigError(
                f"weights directory {str(self.root)!r} holds neither {INDEX} nor {SINGLE}: it was not written by "
                f"{option('save', 'DIR')} or save_pretrained (a directory of .pt files is not a weights directory)"
            )
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"{index} is not a safetensors index ({type(error).__name__}: {error})") from None
        files: dict[str, list[str]] = {}
        for key, name in weight_map.items():
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise ConfigError(f"{index} names shard {name!r} for {key!r}: shards must be plain file names of "
                                  f"the directory")
            files.setdefault(name, []).append(key)
        return files  # type: ignore[return-value]

    def _handle(self, name: str) -> Any:
        handle = self._open.get(name)
        if handle is None:
            path = self.root / name
            if path.is_symlink() or not path.is_file():
                raise ConfigError(f"weights directory {str(self.root)!r}: shard {name} is missing or not a regular file")
            try:
                handle = self._open[name] = _safetensors().safe_open(str(path), framework="pt", device="cpu")
            except Exception as error:  # noqa: BLE001 - a damaged file: say which
                raise ConfigError(f"weights file {path} cannot be read as safetensors ({error})") from None
        return handle

    def keys(self) -> set[str]:
        return set(self.file_of)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(self.file_of[key]).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        """The tensor stored as ``key`` (read now, on the CPU)."""
        return self._handle(self.file_of[key]).get_tensor(key)

    def find(self, keys: Iterable[str]) -> str | None:
        """The first of ``keys`` (one tensor's names: its own and its aliases) stored here."""
        return next((key for key in keys if key in self.file_of), None)


def tensor_names(model: nn.Module) -> dict[int, list[str]]:
    """The state-dict names of each of ``model``'s tensors, by identity (a tied tensor has several)."""
    names: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        names.setdefault(id(value), []).append(key)
    return names


def check_against(weights: WeightsDir, model: nn.Module) -> None:
    """Refuse ``weights`` that do not fit ``model``: a tensor of the model stored under none of its
    names, a stored name the model lacks, or another shape. Reads the index and headers only."""
    state = model.state_dict(keep_vars=True)
    known = set(state)
    missing = [names[0] for names in tensor_names(model).values() if weights.find(names) is None]
    unexpected = sorted(k for k in weights.keys() if k not in known)
    if missing or unexpected:
        raise ConfigError(
            f"the weights in {str(weights.path)!r} do not fit the model: "
            + (f"{len(missing)} of its tensors are missing (e.g. {missing[:3]})" if missing else "")
            + ("; " if missing and unexpected else "")
            + (f"{len(unexpected)} stored tensors are not the model's (e.g. {unexpected[:3]})" if unexpected else "")
            + ": they were saved from another model"
        )
    for names in tensor_names(model).values():
        key = weights.find(names)
        stored, expected = weights.shape(key), tuple(state[names[0]].shape)  # type: ignore[arg-type]
        if stored != expected:
            raise ConfigError(f"the weights in {str(weights.path)!r} store {key!r} with shape {stored}, but the "
                              f"model's is {expected}: they were saved from another model or configuration")
