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


def module_name(path: Path) -> str:
    parts = ["pipetrain", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in ROOT.rglob("*.py")}


def targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The pipetrain modules an import statement runs (``from pkg import sub`` names the submodule)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in MODULES]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if not MODULES[module].name == "__init__.py":
            package = package[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
    found = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return sorted(found & set(MODULES))


def imports_by_place() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """Each module's module-level imports, and its imports inside functions (module, line, target)."""
    top: dict[str, set[str]] = {module: set() for module in MODULES}
    inner = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        in_functions = set()
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        in_functions.add(id(node))
                        inner.extend((module, node.lineno, target) for target in targets(module, node))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in in_functions:
                top[module].update(targets(module, node))
    return top, inner


def test_no_import_inside_a_function_hides_a_cycle():
    """An import moved into a function to break a cycle hides a design fault; lazy imports that
    only keep start-up cheap (the commands import torch late) are fine: hoisted, they close no cycle."""
    top, inner = imports_by_place()

    def reaches(start: str) -> set[str]:
        seen, stack = set(), [start]
        while stack:
            module = stack.pop()
            if module not in seen:
                seen.add(module)
                stack.extend(top[module])
        return seen

    hidden = [f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}, which imports {module}"
              for module, line, target in inner if target != module and module in reaches(target)]
    assert not hidden, "\n".join(hidden)


def test_the_readme_draws_these_layers():
    """README's "Layout" block lists the same packages in the same order as :data:`LAYERS`."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("a module imports only its layer and those below", 1)[1].split("```")[1]
    drawn = []
    for row in block.strip("\n").splitlines():
        names = row.split("  ")[0].split(",")
        drawn.append({name.strip().removesuffix("/").removesuffix(".py") for name in names})
    assert drawn == [layer - {"__init__", "__main__"} for layer in LAYERS]


#: the modules whose imports all stand at the top (training/ and the Python API); the other packages
#: follow as their hoisting lands
HOISTED = ("pipetrain.training", "pipetrain.pipeline")


def _hoisted(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in HOISTED)


def test_no_module_level_import_cycle():
    """No two modules of :data:`HOISTED` import each other at module level, through any chain."""
    top, _ = imports_by_place()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in top[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 and any(_hoisted(m) for m in component):
                cycles.append(sorted(component))

    for module in sorted(top):
        if module not in index:
            visit(module)
    assert not cycles, "\n".join(" <-> ".join(cycle) for cycle in cycles)


def test_imports_inside_functions_say_why():
    """In :data:`HOISTED` (but the package face, which loads the set-up on first use), an import inside
    a function is deliberate: an optional or platform dependency, or PyTorch kept out of the checks
    that run before it; a comment on its line says so."""
    unexplained = []
    for module, path in MODULES.items():
        if not _hoisted(module) or path.name == "__init__.py":
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for function in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)):
                        text = lines[node.lineno - 1]
                        before = lines[node.lineno - 2].strip() if node.lineno > 1 else ""
                        if "#" not in text and not before.startswith("#"):
                            unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text.strip()}")
    assert not unexplained, "\n".join(unexplained)
