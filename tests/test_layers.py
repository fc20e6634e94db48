"""The package layers of docs/design.md section 2 hold: no module imports a higher layer.

Every import of a pipetrain module is counted, those inside functions too (they would hide a cycle
as well as a top-level one would). A layer may import its own packages and lower layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pipetrain

#: docs/design.md's table, lowest first (``__init__`` is the package's face: the top)
LAYERS = [
    {"errors", "paths", "spec", "structure", "usercode"},
    {"schedule", "optim", "weights"},
    {"stages"},
    {"data", "models"},
    {"execution"},
    {"emulate", "runtime"},
    {"plan", "pb"},
    {"training"},
    {"pipeline", "commands", "cli", "__init__", "__main__"},
]
LAYER = {package: level for level, packages in enumerate(LAYERS) for package in packages}
ROOT = Path(pipetrain.__file__).parent


def package_of(path: Path) -> str:
    relative = path.relative_to(ROOT)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "pipetrain" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def test_every_package_has_a_layer():
    packages = {package_of(p) for p in ROOT.rglob("*.py")}
    assert packages <= set(LAYER), sorted(packages - set(LAYER))


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        source = package_of(path)
        for line, target in imported(path):
            if target in LAYER and LAYER[target] > LAYER[source]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({source}, layer {LAYER[source]}) imports "
                              f"{target} (layer {LAYER[target]})")
    assert not upward, "\n".join(upward)
