"""The missing-dependency error names the module Python could not find and the extra that brings it."""

from specdec.models.errors import MissingDependencyError, SpecdecError
from specdec.models.extras import missing_dependency


def test_a_missing_module_is_named_with_the_extra_that_brings_it():
    err = missing_dependency(ModuleNotFoundError("No module named 'httptools'", name="httptools"),
                             "specdec serve", "serve")
    assert isinstance(err, MissingDependencyError) and isinstance(err, SpecdecError) and isinstance(err, ImportError)
    assert str(err) == "specdec serve: the Python module 'httptools' is not installed; pip install 'specdec[serve]'"


def test_a_module_lacking_a_name_asks_for_an_upgrade():
    old = ImportError("cannot import name 'HttpToolsProtocol' from 'uvicorn.protocols.http.httptools_impl'",
                      name="uvicorn.protocols.http.httptools_impl")
    assert str(missing_dependency(old, "specdec serve", "serve")) == (
        "specdec serve: cannot import name 'HttpToolsProtocol' from 'uvicorn.protocols.http.httptools_impl'; "
        "pip install --upgrade 'specdec[serve]'")


def test_an_error_that_already_says_what_to_install_is_kept():
    runtime = MissingDependencyError("specdec's runtime needs onnxruntime: pip install 'specdec[cpu]'")
    assert missing_dependency(runtime, "specdec serve", "serve") is runtime
