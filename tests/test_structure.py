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


# Lower layers never import higher ones, and the packages of one layer not each other: the runtime runs
# without the exporter's torch or the server's FastAPI, and nothing below the CLI needs click's commands.
LAYERS = (
    ("models", "data"),  # the artifact contract, per-architecture facts, specdec's errors; shipped prompt sets
    ("runtime", "console"),  # the decoding engine; the plumbing every command line shares
    ("exporter", "serve"),  # building artifacts; serving them over HTTP
    ("benchmarks", "certify"),  # measuring; the device check a new machine runs
    ("cli",),  # `specdec ...`
)


def _layer(module: str) -> int:
    """Return the layer of a specdec module (-1 for the package itself: its __init__ imports nothing)."""
    parts = module.split(".")
    if len(parts) == 1:
        return -1
    for rank, packages in enumerate(LAYERS):
        if parts[1] in packages:
            return rank
    raise AssertionError(f"{module}: specdec.{parts[1]} has no layer in LAYERS; give it one")


def _layer_breaches(modules: dict[str, Path]) -> list[str]:
    """Return 'importer -> imported' for every import of a higher layer or of another package of the same one."""
    breaches = []
    for name, path in modules.items():
        for dep in sorted(_imports(path, modules)):
            own, other = name.split(".")[:2], dep.split(".")[:2]
            if own != other and _layer(dep) >= _layer(name):
                breaches.append(f"{name} -> {dep}")
    return breaches


def test_imports_point_down_the_layers():
    assert _layer_breaches(_modules()) == []


def test_the_layer_check_sees_an_import_of_a_higher_layer(tmp_path):
    (tmp_path / "errors.py").write_text("def f():\n    from specdec.cli.main import main\n")  # deferred counts
    (tmp_path / "peer.py").write_text("from specdec.serve.config import ServeConfig\n")
    planted = {"specdec.models.errors": tmp_path / "errors.py", "specdec.exporter.peer": tmp_path / "peer.py"}
    breaches = _layer_breaches({**_modules(), **planted})
    assert [b for b in breaches if b.split(" ->")[0] in planted] == [
        "specdec.models.errors -> specdec.cli.main", "specdec.exporter.peer -> specdec.serve.config"]


def test_decode_is_algorithm_1_on_one_screen():
    assert len(inspect.getsource(loop.decode).splitlines()) <= 45


# A function a reader can hold in mind at once: past 80 lines, split it into named steps. create_app is the one
# exception: its routes are nested functions closing over the app's engine and settings, each short.
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS_ALLOWED = {("serve/app.py", "create_app")}


def _long_functions(root: Path, allowed: set[tuple[str, str]]) -> list[str]:
    """Return 'file:line name (N lines)' for every function (nested ones too) under `root` longer than
    MAX_FUNCTION_LINES, counted from its def line to its last, bar the (file, name) pairs in `allowed`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (rel, node.name) not in allowed:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_over_80_lines():
    assert _long_functions(PACKAGE, LONG_FUNCTIONS_ALLOWED) == []


def test_the_length_check_sees_long_functions_nested_ones_too(tmp_path):
    def function(name: str, body: list[str]) -> list[str]:
        return [f"def {name}():"] + ["    " + line for line in body]

    limit = [f"x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1)]  # with its def line: exactly the limit
    (tmp_path / "app.py").write_text("\n".join(function("fits", limit) + function("create_app", limit + ["y = 0"])))
    (tmp_path / "inner.py").write_text("\n".join(function("outer", function("long", limit + ["y = 0"]))))
    assert _long_functions(tmp_path, set()) == [
        "app.py:81 create_app (81 lines)", "inner.py:1 outer (82 lines)", "inner.py:2 long (81 lines)"]
    assert _long_functions(tmp_path, LONG_FUNCTIONS_ALLOWED | {("app.py", "create_app")}) == [
        "inner.py:1 outer (82 lines)", "inner.py:2 long (81 lines)"]
