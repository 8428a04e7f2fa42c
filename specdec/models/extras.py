"""The one-line error for a feature whose optional dependency is missing: the module, and the extra that brings it."""

from __future__ import annotations

from specdec.models.errors import MissingDependencyError


def missing_dependency(err: ImportError, feature: str, extra: str) -> MissingDependencyError:
    """Return the MissingDependencyError saying that `feature` failed on `err`: it names the module Python could
    not find (err.name) and `pip install 'specdec[<extra>]'`, the extra that brings it.

    An `err` that is already a MissingDependencyError (the runtime's, for onnxruntime) is returned as it is: it
    names its own module and extras. An ImportError of a module that is there but lacks a name (an old version)
    says so, and to upgrade.
    """
    if isinstance(err, MissingDependencyError):
        return err
    if isinstance(err, ModuleNotFoundError) and err.name:
        return MissingDependencyError(f"{feature}: the Python module '{err.name}' is not installed; "
                                      f"pip install 'specdec[{extra}]'")
    return MissingDependencyError(f"{feature}: {err}; pip install --upgrade 'specdec[{extra}]'")
