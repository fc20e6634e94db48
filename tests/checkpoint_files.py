"""Shared by the checkpoint tests: checkpoint files changed as a file from elsewhere would be
(written on a GPU), and their manifest brought up to date."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path

from pipetrain.runtime.checkpoint import MANIFEST


def claim_device(path: Path, location: str) -> None:
    """Rewrite the torch.save file ``path`` as if its tensors had been saved on ``location``
    (``"cuda:0"``): torch.save records a device only as each storage's location tag in
    ``data.pkl``, so that tag is what a file written on a GPU differs by."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info.filename, archive.read(info)) for info in archive.infolist()]
    out = io.BytesIO()
    tag = b"X" + len(location).to_bytes(4, "little") + location.encode()  # a pickled str (BINUNICODE)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in entries:
            if name.endswith("/data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", tag)  # memoised: later storages refer to it
            archive.writestr(name, data)
    path.write_bytes(out.getvalue())


def reseal(step: Path) -> None:
    """Sizes and SHA-256 of the manifest brought up to date with the files as they are now."""
    manifest = json.loads((step / MANIFEST).read_text())
    for record in manifest["files"]:
        data = (step / record["name"]).read_bytes()
        record["size"], record["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    (step / MANIFEST).write_text(json.dumps(manifest))
