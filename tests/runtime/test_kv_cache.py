import numpy as np
import pytest

from specdec.models.manifest import load_manifest
from specdec.runtime.session import ModelSession


def _session(artifact, role="target"):
    manifest = load_manifest(artifact)
    return ModelSession(artifact, manifest.target if role == "target" else manifest.draft, provider="cpu")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("keep, rejected", [(5, 4), (1, 1), (7, 6), (0, 3)])
def test_step_after_rollback_equals_fresh_forward(tiny_artifacts, family, keep, rejected):
    session = _session(tiny_artifacts[family])
    rng = np.random.default_rng(keep * 10 + rejected)
    tokens = rng.integers(0, 300, size=12).tolist()
    garbage = rng.integers(0, 300, size=rejected).tolist()

    fresh = session.forward(session.new_cache(), tokens)

    cache = session.new_cache()
    if keep:
        session.forward(cache, tokens[:keep])
    session.forward(cache, garbage)  # a verify step whose drafts get rejected
    cache.rollback(keep)
    assert cache.length == keep and cache.token_ids == tokens[:keep]
    stepped = session.forward(cache, tokens[keep:])
    np.testing.assert_allclose(stepped, fresh[keep:], atol=1e-4)


def test_rollback_shapes_and_bounds(tiny_artifacts):
    session = _session(tiny_artifacts["llama"])
    cache = session.new_cache()
    session.forward(cache, [1, 2, 3, 4, 5])
    assert cache.tensors[0].shape() == [1, session.spec.num_kv_heads, 5, session.spec.head_dim]
    cache.rollback(2)
    assert all(t.shape()[2] == 2 for t in cache.tensors)
    cache.rollback(2)  # no-op
    with pytest.raises(ValueError):
        cache.rollback(3)
    with pytest.raises(ValueError):
        cache.rollback(-1)


def test_caches_of_two_requests_are_independent(tiny_artifacts):
    session = _session(tiny_artifacts["gpt2"])
    a, b = session.new_cache(), session.new_cache()
    la = session.forward(a, [5, 6, 7])
    session.forward(b, [9, 9, 9, 9])
    b.rollback(1)
    np.testing.assert_allclose(session.forward(a, [8]), session.forward(session.new_cache(), [5, 6, 7, 8])[-1:],
                               atol=1e-4)
    assert la.shape == (3, session.vocab_limit)
