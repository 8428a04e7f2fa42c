import json
import shutil

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.models.architectures import architecture_for, supported_model_types
from specdec.models.errors import ArtifactError, ExportError, ManifestError
from specdec.models.manifest import MANIFEST_FILENAME, load_manifest, manifest_from_dict, write_manifest


@pytest.fixture
def artifact_copy(tiny_artifacts, tmp_path):
    folder = tmp_path / "art"
    shutil.copytree(tiny_artifacts["gpt2"], folder)
    return folder


def _edit(folder, change):
    path = folder / MANIFEST_FILENAME
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_round_trip(artifact_copy):
    manifest = load_manifest(artifact_copy)
    write_manifest(artifact_copy, manifest)
    again = load_manifest(artifact_copy)
    assert again == manifest
    assert manifest_from_dict(manifest.to_dict()) == manifest


def test_manifest_describes_the_graphs(artifact_copy):
    manifest = load_manifest(artifact_copy)
    target, draft = manifest.target, manifest.draft
    assert (target.family, target.num_layers, target.num_kv_heads, target.head_dim) == ("gpt2", 2, 4, 16)
    assert target.past_names[1] == ["past_key_values.1.key", "past_key_values.1.value"]
    assert target.present_names[0] == ["present.0.key", "present.0.value"]
    assert target.kv_dtype == "float32" and target.weights_dtype == "fp32"
    # the gpt2 draft pads its vocabulary: recorded, and the tokenizer says what is shared
    assert (target.vocab_size, draft.vocab_size, manifest.tokenizer.vocab_size) == (400, 448, 400)
    assert manifest.tokenizer.eos_token_ids and manifest.tokenizer.chat_template
    assert manifest.provenance.library_versions["onnxruntime"]


@pytest.mark.parametrize("path, message", [
    (("target", "num_layers"), "missing field 'target.num_layers'"),
    (("tokenizer", "eos_token_ids"), "missing field 'tokenizer.eos_token_ids'"),
    (("provenance",), "missing field 'provenance'"),
])
def test_missing_field_is_named(artifact_copy, path, message):
    def drop(data):
        node = data
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    _edit(artifact_copy, drop)
    with pytest.raises(ManifestError, match=message.replace(".", r"\.")):
        load_manifest(artifact_copy)


def test_wrong_type_is_named(artifact_copy):
    _edit(artifact_copy, lambda d: d["target"].__setitem__("head_dim", "16"))
    with pytest.raises(ManifestError, match=r"'target\.head_dim' should be int, got str"):
        load_manifest(artifact_copy)


@pytest.mark.parametrize("defaults, message", [
    ({"num_draft_tokens": 0}, "num_draft_tokens' should be an integer >= 1 or 'auto'"),
    ({"verify_cost": "0.1"}, "verify_cost' should be int/float"),
    ({"target_call_costs": [1.0, "1.1"]}, "target_call_costs' should be a list of positive numbers"),
    ({"target_call_costs": [1.0, -1.1]}, "target_call_costs' should be a list of positive numbers"),
    # The list grows with the drafters (and holds a regex character, "ngram+model"): its start is checked.
    ({"drafter": "medusa"}, "drafter' should be one of model, ngram"),
    ({"tuned": [0.5]}, "tuned' should be dict"),
])
def test_bad_runtime_defaults_are_named(artifact_copy, defaults, message):
    _edit(artifact_copy, lambda d: d.__setitem__("runtime_defaults", defaults))
    with pytest.raises(ManifestError, match=message):
        load_manifest(artifact_copy)
    result = CliRunner().invoke(main, ["generate", str(artifact_copy), "hi", "--provider", "cpu"])
    assert result.exit_code != 0 and "Traceback" not in result.output and message in result.output


def test_newer_version_is_refused_with_advice(artifact_copy):
    _edit(artifact_copy, lambda d: d.__setitem__("version", 99))
    with pytest.raises(ManifestError, match="version 99.*re-export"):
        load_manifest(artifact_copy)


def test_not_json(artifact_copy):
    (artifact_copy / MANIFEST_FILENAME).write_text("{nope")
    with pytest.raises(ManifestError, match="not valid JSON"):
        load_manifest(artifact_copy)


def test_changed_graph_fails_checksum(artifact_copy):
    with open(artifact_copy / "target" / "model.onnx", "ab") as handle:
        handle.write(b"\0")
    with pytest.raises(ArtifactError, match="target/model.onnx.*sha256"):
        load_manifest(artifact_copy)
    load_manifest(artifact_copy, check_files=False)  # explicitly skipped


def test_missing_file(artifact_copy):
    (artifact_copy / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer/tokenizer.json' is missing"):
        load_manifest(artifact_copy)


def test_missing_folder_and_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        load_manifest(tmp_path / "nothing")
    with pytest.raises(ArtifactError, match="no specdec.json"):
        load_manifest(tmp_path)


def test_architectures():
    assert {"gpt2", "llama", "qwen2", "mistral", "phi3"} <= set(supported_model_types())
    gpt2 = architecture_for("gpt2")
    config = {"n_layer": 3, "n_head": 4, "n_embd": 64, "n_positions": 128}
    assert (gpt2.num_layers(config), gpt2.num_kv_heads(config), gpt2.head_dim(config)) == (3, 4, 16)
    llama = architecture_for("llama")
    config = {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64,
              "max_position_embeddings": 256, "head_dim": None}
    assert (llama.num_kv_heads(config), llama.head_dim(config), llama.max_positions(config)) == (2, 8, 256)
    with pytest.raises(ExportError, match="unknown architecture 'bert'.*supports"):
        architecture_for("bert")


def test_v1_manifest_still_loads_and_runs(artifact_copy):
    """Artifacts exported before the optimization stage (manifest v1) keep working as plain graphs."""
    from specdec.runtime.engine import Engine, GenerationConfig

    def to_v1(data):
        data["version"] = 1
        for role in ("target", "draft"):
            data[role].pop("optimization", None)

    _edit(artifact_copy, to_v1)
    manifest = load_manifest(artifact_copy)
    assert manifest.version == 1 and manifest.target.optimization == {}
    result = Engine.load(artifact_copy, provider="cpu").generate("Hello", GenerationConfig(max_new_tokens=4))
    assert len(result.token_ids) == 4
    shown = CliRunner().invoke(main, ["inspect", str(artifact_copy)])
    assert "exported before the optimization stage" in shown.output


def test_every_graph_field_is_read_in_the_dataclass_order():
    from dataclasses import fields

    from specdec.models.manifest import _GRAPH_FIELDS, GraphSpec

    assert list(_GRAPH_FIELDS) == [f.name for f in fields(GraphSpec)]


def test_kv_buffer_field(artifact_copy):
    def to_v2(data):
        data["version"] = 2
        for role in ("target", "draft"):
            for key in ("kv_buffer", "seqlens_name", "total_length_name"):
                data[role].pop(key, None)

    _edit(artifact_copy, to_v2)
    assert load_manifest(artifact_copy).target.kv_buffer == "concat"  # v2 graphs concatenate
    _edit(artifact_copy, lambda d: d["target"].__setitem__("kv_buffer", "shared"))
    with pytest.raises(ManifestError, match="shared KV buffer but no seqlens"):
        load_manifest(artifact_copy)
    _edit(artifact_copy, lambda d: d["target"].__setitem__("kv_buffer", "paged"))
    with pytest.raises(ManifestError, match="kv_buffer' must be concat or shared"):
        load_manifest(artifact_copy)
    # a concat graph rolls back with its kv_slice graph: the manifest must name it
    _edit(artifact_copy, lambda d: (d["target"].__setitem__("kv_buffer", "concat"), d["target"].pop("kv_slice_file")))
    with pytest.raises(ManifestError, match="missing field 'target.kv_slice_file'"):
        load_manifest(artifact_copy)


def test_runtime_defaults_round_trip_and_keep_unknown_keys(artifact_copy):
    from specdec.models.manifest import update_runtime_defaults

    _edit(artifact_copy, lambda d: d.__setitem__("runtime_defaults", {"num_draft_tokens": "auto", "future_key": 7}))
    updated = update_runtime_defaults(artifact_copy, {"drafter": "ngram", "target_call_costs": [1.0, 1.2]})
    assert updated.runtime_defaults.num_draft_tokens == "auto" and updated.runtime_defaults.drafter == "ngram"
    assert updated.runtime_defaults.target_call_costs == (1.0, 1.2)
    assert load_manifest(artifact_copy).runtime_defaults.to_dict() == {
        "num_draft_tokens": "auto", "drafter": "ngram", "target_call_costs": [1.0, 1.2], "future_key": 7}
