"""The package's shape: import path = file path, no import circle (deferred imports count), Algorithm 1 on a screen."""

import ast
import inspect
from pathlib import Path

import specdec
from specdec.runtime import loop

PACKAGE = Path(specdec.__file__).parent


def _modules() -> dict[str, Path]:
    """Return {dotted name: file} for every module of the package."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Return the package modules a file imports anywhere (a deferred import inside a function too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found.update(name for name in names if name in modules)
    return found


def test_every_specdec_import_is_a_file_under_specdec():
    modules = _modules()
    assert modules["specdec.runtime.loop"] == PACKAGE / "runtime" / "loop.py"
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("specdec"):
                assert node.module in modules, f"{path}: {node.module} is no file"


def test_the_import_graph_has_no_cycle():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    # a package's __init__ re-exporting its own modules is not a circle through them
    graph = {name: {d for d in deps if not name.startswith(d + ".") and not d.startswith(name + ".")}
             for name, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in graph[name]:
            assert state.get(dep) != 1, "import circle: " + " -> ".join(trail[trail.index(dep):] + [dep])
            if dep not in state:
                visit(dep, trail + [dep])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_decode_is_algorithm_1_on_one_screen():
    assert len(inspect.getsource(loop.decode).splitlines()) <= 45
