"""The device kit's pieces rejoin to the same wheel, and its plan fits the device tool's limits."""

import hashlib

from tools.device_kit import PART_BYTES, plan_calls, split_file
from specdec.models.manifest import sha256_of_file as sha256


def test_pieces_rejoin_in_glob_order(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    data = bytes(range(256)) * 50  # 12800 bytes
    wheel.write_bytes(data)
    parts = split_file(wheel, tmp_path / "kit", part_bytes=1000)
    assert len(parts) == 13 and all(part.stat().st_size <= 1000 for part in parts)
    # what the device's `cat root/part*/name.*` reads: sorted paths, two-digit numbers keep the order
    joined = b"".join(path.read_bytes() for path in sorted((tmp_path / "kit").glob(f"part*/{wheel.name}.*")))
    assert joined == data
    assert sha256(wheel) == hashlib.sha256(data).hexdigest()


def test_plan_carries_one_piece_per_call_then_runs_the_check(tmp_path):
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(b"x" * 2500)
    parts = split_file(wheel, tmp_path / ".device", part_bytes=1000)
    calls = plan_calls(".device", parts, wheel.name, sha256(wheel), "specdec-0.1.0-py3-none-any.whl", ["tiny"])
    assert [call.carry for call in calls] == [[".device/part01"], [".device/part02"], [".device/part03"],
                                               [".device/kit"]]
    last = calls[-1].command
    assert f"cat .device/part*/{wheel.name}.* > /tmp/{wheel.name}" in last
    assert sha256(wheel) in last and "sha256sum -c" in last
    assert "device_check .device/kit/tiny --provider cuda --reference cpu" in last
    assert all(len(call.command) <= 2000 for call in calls)  # the device tool's limit per command
    assert PART_BYTES < 64 * 2**20  # a piece leaves room for the working tree in one 64 MiB carry


def test_the_kit_covers_both_ways_a_cache_lives_on_cuda_and_both_pass_on_the_cpu(tmp_path):
    from specdec.benchmarks import device_check
    from tools.device_kit import _export_tiny_pairs
    from specdec.models.manifest import load_manifest
    from specdec.runtime.session import check_kv_buffer_device

    names = _export_tiny_pairs(tmp_path / "kit")
    layouts = {}
    for name in names:
        manifest = load_manifest(tmp_path / "kit" / name)
        layouts[name] = (manifest.target.kv_buffer, manifest.target.kv_dtype)
        for spec in manifest.graphs():
            check_kv_buffer_device(spec, "cuda")  # neither is refused on CUDA
        check = device_check.check_artifact(tmp_path / "kit" / name, "cpu", max_new_tokens=8)
        assert check.failures == []
        assert all(run["greedy_equals_target_only"] for run in check.runs if run["drafter"] != "none")
    assert sorted(layouts.values()) == [("concat", "float32"), ("shared", "float16")]
