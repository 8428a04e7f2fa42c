"""What the exporter and the runtime share: the artifact contract and per-architecture facts.

Nothing here imports torch, transformers or onnxruntime.
"""

from specdec.models.architectures import ArchitectureSpec, architecture_for, supported_model_types
from specdec.models.errors import (
    ArtifactError,
    ExportError,
    GenerationError,
    ManifestError,
    SpecdecError,
)
from specdec.models.manifest import (
    MANIFEST_FILENAME,
    MANIFEST_VERSION,
    GraphSpec,
    Manifest,
    Provenance,
    TokenizerSpec,
    load_manifest,
    sha256_of_file,
    verify_checksums,
    write_manifest,
)

__all__ = [
    "ArchitectureSpec",
    "ArtifactError",
    "ExportError",
    "GenerationError",
    "GraphSpec",
    "MANIFEST_FILENAME",
    "MANIFEST_VERSION",
    "Manifest",
    "ManifestError",
    "Provenance",
    "SpecdecError",
    "TokenizerSpec",
    "architecture_for",
    "load_manifest",
    "sha256_of_file",
    "supported_model_types",
    "verify_checksums",
    "write_manifest",
]
