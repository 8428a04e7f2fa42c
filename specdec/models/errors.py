"""specdec's own exceptions. The library raises these; only the CLI turns them into exit codes."""


class SpecdecError(Exception):
    """Base class: the message says what is wrong and, where possible, what to change."""


class ManifestError(SpecdecError):
    """The artifact's manifest is missing, malformed, or of an unsupported version."""


class ArtifactError(SpecdecError):
    """The artifact folder is missing files or a file no longer matches its checksum."""


class ExportError(SpecdecError):
    """Export cannot proceed: bad source, incompatible tokenizers, failed validation, ..."""


class GenerationError(SpecdecError):
    """A generation request is invalid (bad sampling settings, prompt too long, ...)."""


class MissingDependencyError(SpecdecError, ImportError):
    """An optional dependency the called feature needs is not installed; says what to install."""
