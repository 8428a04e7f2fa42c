"""A feature whose extra is not installed fails in one line naming the missing module and the extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from specdec.models.errors import MissingDependencyError

# Hides one module, as an install without it would: ModuleNotFoundError naming it, as Python's own.
HIDE = textwrap.dedent("""
    import importlib.abc, sys

    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == sys.argv[1]:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Hide())
    from specdec.cli.main import main
    main(sys.argv[2:])
""")


def test_serve_without_httptools_names_httptools_and_the_serve_extra(tiny_artifacts):
    # httptools came only from ray[serve] once: the message then said the server was not installed at all
    completed = subprocess.run([sys.executable, "-c", HIDE, "httptools", "serve", str(tiny_artifacts["llama"]),
                                "--port", "0", "--provider", "cpu"], capture_output=True, text=True, timeout=120)
    assert completed.returncode == 1, completed.stdout + completed.stderr
    assert completed.stderr.strip().splitlines() == [
        "Error: specdec serve: the Python module 'httptools' is not installed; pip install 'specdec[serve]'"]
    assert "listening on" not in completed.stdout


def test_plots_without_matplotlib_name_it_and_the_bench_extra(monkeypatch):
    from specdec.cli import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependencyError, match=r"^plots \(--no-plot skips them\): the Python module "
                                                     r"'matplotlib' is not installed; pip install 'specdec\[bench\]'$"):
        plots._pyplot()


def test_ray_serve_without_ray_names_it_and_the_ray_extra(monkeypatch):
    from specdec.serve import ray_app

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingDependencyError, match=r"^specdec serve --ray: the Python module 'ray' is not "
                                                     r"installed; pip install 'specdec\[ray\]'$"):
        ray_app._ray_serve()
