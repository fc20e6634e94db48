"""Profile files: pipetrain's JSON form (:mod:`pipetrain.plan.profile`) and PipeDream's ``graph.txt``
(:mod:`pipetrain.plan.graphtxt`), told apart by their first character."""

from __future__ import annotations

import json
from pathlib import Path

from pipetrain.errors import ConfigError
from pipetrain.plan.graphtxt import parse_graph_txt
from pipetrain.plan.profile import Profile

__all__ = ["load_profile", "save_profile"]


def load_profile(path: str | Path) -> Profile:
    """Read a pipetrain JSON profile or a PipeDream ``graph.txt`` profile."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"cannot read profile {str(path)!r}: {error.strerror}") from None
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}: line {error.lineno}: invalid JSON ({error.msg})") from None
        return Profile.from_json(data, where=str(path))
    return parse_graph_txt(text, where=str(path))


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write ``profile`` as pipetrain JSON."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")
