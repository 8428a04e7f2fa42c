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
    session = _session(tiny_artifacts["gpt2"])  # a concat cache: the tensors are the positions
    assert session.spec.kv_buffer == "concat"
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


def test_shared_buffer_rolls_back_without_copying(tiny_artifacts):
    session = _session(tiny_artifacts["llama"])
    assert session.spec.kv_buffer == "shared" and session.slicer is None
    cache = session.new_cache(capacity=16)
    session.forward(cache, [1, 2, 3, 4, 5])
    buffers = list(cache.tensors)
    assert cache.length == 5 and buffers[0].shape() == [1, session.spec.num_kv_heads, 16, session.spec.head_dim]
    cache.rollback(2)
    assert cache.length == 2 and all(a is b for a, b in zip(cache.tensors, buffers))  # same memory, shorter
    with pytest.raises(ValueError):
        cache.rollback(3)


def test_shared_buffer_grows_past_its_capacity(tiny_artifacts):
    session = _session(tiny_artifacts["llama"])
    tokens = list(range(3, 40))
    fresh = session.forward(session.new_cache(capacity=64), tokens)
    cache = session.new_cache(capacity=4)
    stepped = [session.forward(cache, tokens[:3])]
    for start in range(3, len(tokens), 5):  # crosses 4, 8, 16 and 32 positions
        stepped.append(session.forward(cache, tokens[start:start + 5]))
    assert cache.capacity >= len(tokens) and cache.length == len(tokens)
    np.testing.assert_allclose(np.concatenate(stepped), fresh, atol=1e-4)


def test_caches_of_two_requests_are_independent(tiny_artifacts):
    session = _session(tiny_artifacts["gpt2"])
    a, b = session.new_cache(), session.new_cache()
    la = session.forward(a, [5, 6, 7])
    session.forward(b, [9, 9, 9, 9])
    b.rollback(1)
    np.testing.assert_allclose(session.forward(a, [8]), session.forward(session.new_cache(), [5, 6, 7, 8])[-1:],
                               atol=1e-4)
    assert la.shape == (3, session.vocab_limit)


def test_fp32_shared_buffer_is_refused_on_cuda(tiny_artifacts):
    from dataclasses import replace

    from specdec.models.errors import GenerationError
    from specdec.runtime.session import check_kv_buffer_device

    shared = load_manifest(tiny_artifacts["llama"]).target
    check_kv_buffer_device(shared, "cpu")
    check_kv_buffer_device(replace(shared, kv_dtype="float16"), "cuda")
    check_kv_buffer_device(load_manifest(tiny_artifacts["gpt2"]).target, "cuda")  # concat: fine
    with pytest.raises(GenerationError, match="fp16/bf16 only.*--no-shared-kv"):
        check_kv_buffer_device(shared, "cuda")


def test_reserve_doubles_keeps_the_valid_prefix_and_stops_at_max_positions():
    from specdec.runtime.kv_cache import KVCache
    from specdec.runtime.providers import ort

    data = np.arange(2 * 3 * 4, dtype=np.float32).reshape(1, 2, 3, 4)
    cache = KVCache(tensors=[ort.OrtValue.ortvalue_from_numpy(data, "cpu", 0)], slicer=None, max_positions=10)
    cache.token_ids = [7, 8]  # two valid positions of three
    cache.reserve(3)
    assert cache.capacity == 3  # enough already: untouched
    cache.reserve(4)
    grown = cache.tensors[0].numpy()
    assert cache.capacity == 6 and np.array_equal(grown[:, :, :2], data[:, :, :2])
    assert not grown[:, :, 2:].any()  # past the valid length: zeros, not the stale third position
    cache.reserve(9)
    assert cache.capacity == 10  # doubling would pass the model's limit


def test_requests_reuse_pooled_buffers_and_decode_the_same(tiny_artifacts):
    session = _session(tiny_artifacts["llama"])
    tokens = [5, 9, 2, 7, 7, 1]
    cache = session.new_cache(capacity=32)
    first = session.forward(cache, tokens)
    addresses = [t.data_ptr() for t in cache.tensors]
    other = session.new_cache(capacity=32)  # a concurrent request: its own set
    other_addresses = [t.data_ptr() for t in other.tensors]
    assert not set(addresses) & set(other_addresses)
    cache.release()
    del other  # dropped without release: its set goes back too
    again = session.new_cache(capacity=20)  # 20 <= 32 <= 40: a pooled set fits
    assert [t.data_ptr() for t in again.tensors] in (addresses, other_addresses)
    assert session.pool.allocated == 2 and again.length == 0
    np.testing.assert_array_equal(session.forward(again, tokens), first)  # stale positions are never read
    small = session.new_cache(capacity=8)  # 32 > 2 * 8: a pooled set that large is not handed out
    assert small.capacity == 8 and session.pool.allocated == 3


def test_pool_keeps_the_largest_sets_only():
    from specdec.runtime.kv_cache import BufferPool

    pool = BufferPool((1, 2, 4), np.dtype(np.float32), "cpu", count=2, keep=2)
    sets = [pool.take(n) for n in (4, 8, 16)]
    assert pool.allocated == 3 and [s[0].shape() for s in sets[:1]] == [[1, 2, 4, 4]]
    for taken in sets:
        pool.give(taken)
    assert pool.take(16) is sets[2] and pool.take(8) is sets[1]  # both kept; the 4-position set was dropped
    assert pool.take(4) is not sets[0] and pool.allocated == 4


def test_device_inputs_write_into_one_tensor_per_shape():
    import onnxruntime as ort

    from specdec.runtime.kv_cache import DeviceInputs

    class Binding:
        def __init__(self):
            self.bound = {}

        def bind_ortvalue_input(self, name, value):
            self.bound[name] = value

    inputs, binding = DeviceInputs("cpu"), Binding()
    inputs.bind(binding, "ids", np.array([[3]], dtype=np.int64))
    first = binding.bound["ids"]
    inputs.bind(binding, "ids", np.array([[8]], dtype=np.int64))
    assert binding.bound["ids"] is first and first.numpy().tolist() == [[8]]  # updated in place
    inputs.bind(binding, "ids", np.array([[1, 2]], dtype=np.int64))
    assert binding.bound["ids"] is not first and binding.bound["ids"].numpy().tolist() == [[1, 2]]
    assert isinstance(first, ort.OrtValue) and first.device_name().lower() == "cpu"
