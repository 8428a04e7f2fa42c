"""min_rows (manifest v5): an int4 target of that version asks the runtime never to make a 1-row call.

The exporter now writes `attention_pad_rows` instead (test_attention_rows.py); v5 artifacts still run."""

import json
import shutil

import pytest

from specdec.exporter.quantize import EXACT_ACCURACY_LEVEL, FAST_ACCURACY_LEVEL, target_precision
from specdec.models.errors import ManifestError
from specdec.models.manifest import MANIFEST_FILENAME, load_manifest, manifest_from_dict


@pytest.mark.parametrize("weights, shared, expected", [
    ("int4", True, (FAST_ACCURACY_LEVEL, True)),  # the pad lives in GroupQueryAttention over the shared buffer
    ("int4", False, (EXACT_ACCURACY_LEVEL, False)),  # a concat cache has no such op: fp32 compute
    ("int8", True, (EXACT_ACCURACY_LEVEL, False)),  # int8's level-4 kernels were not measured
])
def test_target_precision(weights, shared, expected):
    assert target_precision(weights, shared) == expected
    assert expected[0] in (1, 4)


@pytest.fixture
def shared_artifact(tiny_artifacts, tmp_path):
    folder = tmp_path / "art"
    shutil.copytree(tiny_artifacts["llama"], folder)
    assert load_manifest(folder).target.kv_buffer == "shared"
    return folder


def _set_min_rows(folder, value):
    path = folder / MANIFEST_FILENAME
    data = json.loads(path.read_text())
    data["target"]["min_rows"] = value
    path.write_text(json.dumps(data))
    return data


def test_min_rows_round_trips_and_defaults_to_one(shared_artifact):
    manifest = load_manifest(shared_artifact)
    assert manifest.target.min_rows == 1  # absent from older manifests: every call shape allowed
    _set_min_rows(shared_artifact, 2)
    manifest = load_manifest(shared_artifact)
    assert manifest.target.min_rows == 2 and manifest.draft.min_rows == 1
    assert manifest_from_dict(manifest.to_dict()).target.min_rows == 2


@pytest.mark.parametrize("value, kv_buffer", [(0, "shared"), (2, "concat")])
def test_bad_min_rows_is_refused(shared_artifact, value, kv_buffer):
    data = _set_min_rows(shared_artifact, value)
    if kv_buffer == "concat":
        data["target"].update(kv_buffer="concat", attention_mask_name="attention_mask", kv_slice_file="x.onnx")
    with pytest.raises(ManifestError, match="min_rows"):
        manifest_from_dict(data)
