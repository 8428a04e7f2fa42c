"""The device kit builds: its pieces rejoin to the same files, its plan fits the device tool's limits,
and the last call's join-and-verify steps run as written."""

import hashlib
import subprocess
from pathlib import Path

from tools import device_kit
from tools.device_kit import PART_BYTES, Packed, plan_calls, split_file
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


def _packed(tmp_path, name, size, first_folder=1):
    path = tmp_path / "download" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(bytes(range(251)) * (size // 251) + b"x" * (size % 251))
    return Packed(name, sha256(path), split_file(path, tmp_path / ".device", 1000, first_folder))


def test_plan_carries_one_piece_per_call_then_runs_the_check(tmp_path):
    wheel = _packed(tmp_path, "w.whl", 2500)
    model = _packed(tmp_path, "smollm2-fp16.tar", 1500, first_folder=4)
    calls = plan_calls(".device", [wheel, model], "specdec-0.1.0-py3-none-any.whl", ["tiny"], model)
    assert [call.carry for call in calls] == [[".device/part01"], [".device/part02"], [".device/part03"],
                                               [".device/part04"], [".device/part05"], [".device/kit"]]
    last = calls[-1].command
    assert "cat .device/part*/w.whl.* > /tmp/w.whl" in last and "tar -xf /tmp/smollm2-fp16.tar -C /tmp" in last
    assert wheel.sha256 in last and model.sha256 in last and "sha256sum -c" in last
    assert ("-m specdec.certify.device_check .device/kit/tiny /tmp/smollm2-fp16 --provider cuda --reference cpu "
            "--max-new-tokens 64" in last)
    assert f"timeout {device_kit.RUN_SECONDS} " in last and device_kit.RUN_SECONDS <= 8 * 60
    assert all(len(call.command) <= 2000 for call in calls)  # the device tool's limit per command
    assert PART_BYTES < 64 * 2**20  # a piece leaves room for the working tree in one 64 MiB carry


def test_the_join_steps_rebuild_the_files_and_catch_a_bad_piece(tmp_path):
    """Run the last call's own join-and-verify commands in a shell, as the device would."""
    packed = _packed(tmp_path, "h21-kit-test.tar", 2600)
    script = " && ".join(device_kit.join_commands(str(tmp_path / ".device"), packed))
    assert subprocess.run(["bash", "-c", script]).returncode == 0
    assert sha256(tmp_path / "download" / packed.name) == hashlib.sha256(open(f"/tmp/{packed.name}", "rb").read()).hexdigest()
    packed.pieces[1].write_bytes(b"corrupt")
    assert subprocess.run(["bash", "-c", script], capture_output=True).returncode != 0
    Path(f"/tmp/{packed.name}").unlink()


def test_an_artifact_folder_round_trips_through_tar_and_pieces(tmp_path):
    import tarfile

    folder = tmp_path / "art"
    (folder / "target").mkdir(parents=True)
    (folder / "specdec.json").write_text("{}")
    (folder / "target" / "model.onnx").write_bytes(bytes(range(256)) * 20)
    tar = device_kit.tar_folder(folder, tmp_path / "a.tar", device_kit.SMOLLM2_NAME)
    pieces = split_file(tar, tmp_path / "pieces", part_bytes=4096)
    (tmp_path / "joined.tar").write_bytes(b"".join(p.read_bytes() for p in sorted(pieces)))
    with tarfile.open(tmp_path / "joined.tar") as archive:
        archive.extractall(tmp_path / "out")
    assert (tmp_path / "out" / "smollm2-fp16" / "target" / "model.onnx").read_bytes() == bytes(range(256)) * 20


def test_the_kit_covers_both_ways_a_cache_lives_on_cuda_and_both_pass_on_the_cpu(tmp_path):
    from specdec.certify import device_check
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
        # TF32 is turned off for the fp32 one only; the fp16 one's shared buffers keep their addresses
        assert device_check._tf32_off(tmp_path / "kit" / name).cuda_options == (
            {"use_tf32": "0"} if manifest.target.kv_dtype == "float32" else {})
        assert check.kv_addresses_stable is (True if manifest.target.kv_buffer == "shared" else None)
    assert sorted(layouts.values()) == [("concat", "float32"), ("shared", "float16")]


def test_build_kit_writes_pieces_kit_and_plan(tmp_path, monkeypatch):
    """The whole build with a stand-in for the onnxruntime-gpu download (the real one is ~256 MB)."""
    repo = tmp_path / "repo"
    monkeypatch.setattr(device_kit, "PART_BYTES", 4096)
    monkeypatch.setattr(device_kit.split_file, "__defaults__", (4096, 1))
    monkeypatch.setattr(device_kit, "_export_tiny_pairs", lambda kit: ["tiny-a"])
    built = []

    def fake_wheel_build(command, check):
        built.append(command)
        if "wheel" in command:
            (tmp_path / ".device" / "kit" / "specdec-0.1.0-py3-none-any.whl").write_bytes(b"wheel")

    monkeypatch.setattr(device_kit.subprocess, "run", lambda command, check=False, **kw:
                        fake_wheel_build(command, check) if "pip" in command else subprocess.CompletedProcess(command, 0, ""))

    def download(folder):
        path = folder / "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
        path.write_bytes(bytes(9000))
        return path

    smollm2 = tmp_path / "smollm2"
    smollm2.mkdir()
    (smollm2 / "specdec.json").write_text("{}")
    (smollm2 / "model.onnx").write_bytes(bytes(range(256)) * 40)  # 10 KiB
    calls = device_kit.build_kit(tmp_path / ".device", repo, smollm2, download_wheel=download)
    pieces = sorted(p.parent.name for p in (tmp_path / ".device").glob("part*/*"))
    tar_pieces = -(-(tmp_path / ".device" / "download" / "smollm2-fp16.tar").stat().st_size // 4096)
    assert pieces == [f"part{i:02d}" for i in range(1, len(pieces) + 1)] and len(pieces) == 3 + tar_pieces
    assert len(calls) == len(pieces) + 1 and calls[-1].carry == [str(tmp_path / ".device") + "/kit"]
    assert (tmp_path / ".device" / "plan.json").is_file() and "1. carry" in (tmp_path / ".device" / "PLAN.md").read_text()


def test_a_root_it_cannot_write_fails_in_one_line_before_any_export(monkeypatch, capsys):
    monkeypatch.setattr(device_kit, "ensure_smollm2", lambda path: (_ for _ in ()).throw(AssertionError("exported")))
    assert device_kit.main(["--root", "/proc/specdec-kit"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the kit was not built")
