"""Long calls take onnxruntime's causal attention kernel, short ones keep the flash kernel, chosen per call."""

import numpy as np
import onnx
import pytest

from specdec.exporter.long_call_attention import LONG_CALL_NAME, add_long_call_attention
from specdec.models.manifest import load_manifest
from specdec.runtime.engine import Engine, GenerationConfig
from specdec.runtime.session import LONG_CALL_ROWS, ModelSession

NEVER, ALWAYS = 10**9, 0  # ModelSession.long_call_rows that keep every call on one kernel


@pytest.fixture(scope="module")
def tiny_target(tiny_artifacts):
    artifact = tiny_artifacts["llama"]
    return artifact, load_manifest(artifact).target


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(5, 250, length).tolist()


def _held_sessions(artifact, spec) -> dict[str, ModelSession]:
    """Return {"short": a session whose calls all keep the flash kernel, "long": one whose calls all take the other}."""
    held = {}
    for name, rows in (("short", NEVER), ("long", ALWAYS)):
        held[name] = ModelSession(artifact, spec, provider="cpu")
        held[name].long_call_rows = rows
    return held


def test_every_attention_is_wrapped_with_a_minus_inf_sink_on_its_long_branch(tiny_target):
    artifact, spec = tiny_target
    graph = onnx.load(str(artifact / spec.graph_file)).graph
    assert spec.long_call_name == LONG_CALL_NAME
    assert [i.type.tensor_type.elem_type for i in graph.input if i.name == LONG_CALL_NAME] == [onnx.TensorProto.BOOL]
    assert not [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    wrapped = [n for n in graph.node if n.op_type == "If"]
    assert len(wrapped) == spec.num_layers
    for node in wrapped:
        assert list(node.input) == [LONG_CALL_NAME]
        branches = {a.name: a.g for a in node.attribute}
        long_attention = [n for n in branches["then_branch"].node if n.op_type == "GroupQueryAttention"]
        short_attention = [n for n in branches["else_branch"].node if n.op_type == "GroupQueryAttention"]
        assert len(long_attention) == len(short_attention) == 1
        sink = long_attention[0].input[11]
        constant = next(n for n in branches["then_branch"].node if n.output[0] == sink)
        assert np.all(onnx.numpy_helper.to_array(constant.attribute[0].t) == -np.inf)
        # the short branch is the op as it was: the same inputs and attributes, no sink
        assert list(short_attention[0].input) == list(long_attention[0].input[:9])
        assert short_attention[0].attribute == long_attention[0].attribute


def test_the_rewrite_applies_once_and_leaves_graphs_without_the_op(tiny_target, tiny_artifacts):
    artifact, spec = tiny_target
    model = onnx.load(str(artifact / spec.graph_file))
    assert add_long_call_attention(model) == 0  # already rewritten
    gpt2 = load_manifest(tiny_artifacts["gpt2"]).target
    assert gpt2.long_call_name is None  # a concat cache has no GroupQueryAttention to wrap
    assert add_long_call_attention(onnx.load(str(tiny_artifacts["gpt2"] / gpt2.graph_file))) == 0


def test_both_kernels_score_a_long_prompt_alike_and_write_the_same_cache(tiny_target):
    artifact, spec = tiny_target
    sessions = _held_sessions(artifact, spec)
    prompt = _prompt(LONG_CALL_ROWS + 40)
    caches = {name: s.new_cache() for name, s in sessions.items()}
    logits = {name: s.forward(caches[name], prompt) for name, s in sessions.items()}
    assert np.allclose(logits["long"], logits["short"], atol=1e-4)
    assert (logits["long"].argmax(-1) == logits["short"].argmax(-1)).all()
    length = len(prompt)
    for short, long in zip(caches["short"].tensors, caches["long"].tensors):
        assert np.allclose(short.numpy()[:, :, :length], long.numpy()[:, :, :length], atol=1e-5)
    # steps after either prefill (both on the short kernel here) continue alike
    token = {name: int(logits[name][-1].argmax()) for name in sessions}
    for _ in range(6):
        step = {name: sessions[name].forward(caches[name], [token[name]])[-1] for name in sessions}
        assert np.allclose(step["long"], step["short"], atol=1e-4)
        token = {name: int(step[name].argmax()) for name in sessions}


def test_the_runtime_picks_the_kernel_by_call_length(tiny_target):
    """A default session's calls equal, to the bit, a session held on the kernel their length selects."""
    artifact, spec = tiny_target
    held = _held_sessions(artifact, spec)
    default = ModelSession(artifact, spec, provider="cpu")
    assert default.long_call_rows == LONG_CALL_ROWS > 33  # above any verify call (K <= 32, plus the bonus row)
    for length, kernel in ((LONG_CALL_ROWS, "short"), (LONG_CALL_ROWS + 1, "long"), (200, "long")):
        prompt = _prompt(length, seed=length)
        got = default.forward(default.new_cache(), prompt)
        assert np.array_equal(got, held[kernel].forward(held[kernel].new_cache(), prompt)), (length, kernel)


def test_speculative_greedy_equals_target_only_after_a_long_prefill(tiny_close_artifacts):
    engine = Engine.load(tiny_close_artifacts["llama"], provider="cpu")
    assert engine.target.spec.long_call_name
    prompt = _prompt(LONG_CALL_ROWS + 60, seed=3)
    reference = engine.generate(prompt, GenerationConfig(max_new_tokens=32, drafter="none"))
    for drafter in ("model", "ngram"):
        result = engine.generate(prompt, GenerationConfig(max_new_tokens=32, drafter=drafter, num_draft_tokens=4,
                                                          ngram_min=1))
        assert result.token_ids == reference.token_ids, drafter
        assert result.stats.drafted > 0


def test_the_export_validates_the_long_call_kernel_against_pytorch(tiny_target):
    from click.testing import CliRunner

    from specdec.cli.main import main

    artifact, _ = tiny_target
    validation = load_manifest(artifact).validation["target"]
    assert validation["max_logit_diff_long_call"] is not None
    assert validation["max_logit_diff_long_call"] <= validation["max_logit_diff_prefill"] <= validation["atol"]
    shown = CliRunner().invoke(main, ["inspect", str(artifact)]).output
    assert f"calls over {LONG_CALL_ROWS} tokens (prefills) take onnxruntime's causal kernel" in shown


def test_an_export_without_long_call_attention_has_one_kernel_and_no_if(export_tiny_llama):
    artifact = export_tiny_llama("no-long-call", long_call_attention=False)
    manifest = load_manifest(artifact)
    spec = manifest.target
    graph = onnx.load(str(artifact / spec.graph_file)).graph
    assert spec.long_call_name is None and LONG_CALL_NAME not in {i.name for i in graph.input}
    assert not [n for n in graph.node if n.op_type == "If"]
    assert len([n for n in graph.node if n.op_type == "GroupQueryAttention"]) == spec.num_layers
    assert "long_call_attention" not in spec.optimization
    assert manifest.validation["target"]["max_logit_diff_long_call"] is None
    engine = Engine.load(artifact, provider="cpu")
    prompt = _prompt(LONG_CALL_ROWS + 20, seed=3)
    reference = engine.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="none"))
    result = engine.generate(prompt, GenerationConfig(max_new_tokens=24, drafter="ngram", num_draft_tokens=4,
                                                      ngram_min=1))
    assert result.token_ids == reference.token_ids and result.stats.drafted > 0
