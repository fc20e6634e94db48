"""The package layers of docs/design.md section 2 hold: no module imports a higher layer, no two
modules import each other, and imports sit at the top of their module.

Every import of a pipetrain module is counted, those inside functions too (they would hide a cycle
as well as a top-level one would). A layer may import its own packages and lower layers. Only the
entry modules (:data:`ENTRY`) import pipetrain modules inside functions, on purpose: they keep
``pipetrain --help`` and the checks of options and paths free of PyTorch.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pipetrain

#: docs/design.md's table, lowest first (``__init__`` is the package's face: the top)
LAYERS = [
    {"errors", "paths", "spec", "structure", "usercode", "collector"},
    {"schedule", "optim", "weights", "initialiser"},
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


#: the modules that may import pipetrain modules inside functions: the command line and the
#: package's face, which import late so that ``pipetrain --help`` and the checks of options and
#: paths run before PyTorch is imported
ENTRY = ("pipetrain/__init__.py", "pipetrain/cli.py", "pipetrain/commands/")

#: modules besides :data:`ENTRY` that import a pipetrain module inside a function on purpose, and why
DELIBERATE = {
    "pipetrain/training/__init__.py": "the package's face loads the set-up (PyTorch) on first use, so that "
                                      "a configuration is built and checked without it",
    "pipetrain/training/validate.py": "the loss scale's checks import PyTorch, which check_config runs without",
}


def relative(module: str) -> str:
    return "pipetrain/" + MODULES[module].relative_to(ROOT).as_posix()


def is_type_checking(node: ast.AST) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``): imports for type hints only, never run."""
    test = getattr(node, "test", None) if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports_at_load(module: str) -> dict[str, int]:
    """The pipetrain modules that loading ``module`` imports (the first line of each): module-level
    imports, those in class bodies and ``try`` blocks too, but not those in functions or under
    ``if TYPE_CHECKING:``."""
    found: dict[str, int] = {}

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) or is_type_checking(child):
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in targets(module, child):
                    if target != module:
                        found.setdefault(target, child.lineno)
            visit(child)

    visit(ast.parse(MODULES[module].read_text(encoding="utf-8")))
    return found


def import_cycles() -> list[list[str]]:
    """One cycle of each strongly connected group of modules under :func:`imports_at_load`."""
    graph = {module: imports_at_load(module) for module in sorted(MODULES)}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []
    for root in graph:  # Tarjan's algorithm, iterative (the graph has hundreds of modules)
        if root in order:
            continue
        work = [(root, iter(graph[root]))]
        order[root] = low[root] = len(order)
        stack.append(root)
        while work:
            module, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in order:
                    order[child] = low[child] = len(order)
                    stack.append(child)
                    work.append((child, iter(graph[child])))
                elif child in stack:
                    low[module] = min(low[module], order[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == order[module]:
                group = set()
                while True:
                    member = stack.pop()
                    group.add(member)
                    if member == module:
                        break
                if len(group) > 1:
                    groups.append(group)
    cycles = []
    for group in groups:  # a shortest way from the group's first module back to it, breadth first
        start = min(group)
        before: dict[str, str] = {}
        frontier, last = [start], None
        while last is None:
            following = []
            for module in frontier:
                if start in graph[module]:
                    last = module
                    break
                for target in graph[module]:
                    if target in group and target not in before and target != start:
                        before[target] = module
                        following.append(target)
            frontier = following
        cycle = [start]
        while last != start:
            cycle.insert(1, last)
            last = before[last]
        cycles.append([*cycle, start])
    return cycles


def test_no_two_modules_import_each_other():
    """No cycle among the modules' module-level imports, however long: a cycle means two modules
    that are one concept, or code that lives in the wrong one."""
    cycles = import_cycles()
    graph = {module: imports_at_load(module) for cycle in cycles for module in cycle}
    text = [" -> ".join(f"{relative(a)}:{graph[a][b]}" for a, b in zip(cycle, cycle[1:])) + f" -> {relative(cycle[-1])}"
            for cycle in cycles]
    assert not text, "import cycles (move the code to where it belongs):\n" + "\n".join(text)


def function_level_imports() -> dict[str, list[tuple[int, str]]]:
    """Each module's imports of pipetrain modules inside functions: (line, imported module)."""
    found: dict[str, list[tuple[int, str]]] = {}
    for module, path in sorted(MODULES.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        seen = set()  # an import in a nested function is inside the outer one too: count it once
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                for node in ast.walk(function):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in seen:
                        seen.add(id(node))
                        found.setdefault(module, []).extend((node.lineno, t) for t in targets(module, node))
    return {module: sorted(set(imports)) for module, imports in found.items() if imports}


def test_imports_of_pipetrain_modules_sit_at_the_top():
    """Outside :data:`ENTRY`, a module imports pipetrain modules at its top, where a reader sees
    what it depends on and the cycle test sees them (third-party imports inside functions are
    left to their authors: optional dependencies such as matplotlib, each with its reason)."""
    inner = function_level_imports()
    late = [f"{relative(module)}:{line} imports {target} inside a function: hoist it to the top of the module"
            for module, imports in inner.items() if not relative(module).startswith(ENTRY)
            and relative(module) not in DELIBERATE for line, target in imports]
    assert not late, "\n".join(late)
    stale = sorted(name for name in DELIBERATE if not any(relative(m) == name for m in inner))
    assert not stale, f"remove from DELIBERATE (their imports are at the top now): {stale}"


def test_the_readme_draws_these_layers():
    """README's "Layout" block lists the same packages in the same order as :data:`LAYERS`."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("a module imports only its layer and those below", 1)[1].split("```")[1]
    drawn = []
    for row in block.strip("\n").splitlines():
        names = row.split("  ")[0].split(",")
        drawn.append({name.strip().removesuffix("/").removesuffix(".py") for name in names})
    assert drawn == [layer - {"__init__", "__main__"} for layer in LAYERS]


def test_imports_inside_functions_say_why():
    """Outside :data:`ENTRY`, an import inside a function (of any module, third-party ones too) is
    deliberate: an optional or platform dependency, or PyTorch kept out of the checks that run
    before it; a comment on its line or the line before says so."""
    unexplained = []
    for module, path in MODULES.items():
        if relative(module).startswith(ENTRY):
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
