"""Packs what a lent CUDA machine needs for `device_check` into pieces its tool can carry.

The device tool carries at most 64 MiB per call, the onnxruntime-gpu wheel is ~256 MB, and
that machine reaches no package index. So `python tools/device_kit.py` (`make
device-kit`) writes, under `.device/` (git-ignored):
- part01/, part02/, ...: the onnxruntime-gpu wheel for the machine's Python, cut in pieces of
  at most PART_BYTES, one folder per call;
- kit/: the specdec wheel (runtime only; the machine's image already has numpy,
  tokenizers, click and jinja2) and two tiny llama draft+target artifacts: fp32 with a
  concat KV cache (the slice graph's rollback on the device), and fp16 with one shared
  KV buffer per tensor (CUDA's GroupQueryAttention writing the cache in place: the default
  for a llama-family model exported `--dtype fp16`, converted on this CPU);
- plan.json and PLAN.md: the calls to make, in order, each with its `carry` list and
  command: one per piece, then one carrying the kit, which joins the pieces, checks the
  wheel's sha256, installs both wheels and runs the checks on CUDA against a CPU reference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.models.manifest import sha256_of_file

PART_BYTES = 62 * 2**20  # leaves ~2 MiB of the 64 MiB carry for the working tree itself
ORT_GPU = "onnxruntime-gpu==1.31.1"  # built for CUDA 13 and cuDNN 9, as the lent machine's image has
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


@dataclass(frozen=True)
class DeviceCall:
    """One call of the device tool: what to carry and what to run."""

    carry: list[str]
    command: str


def split_file(path: Path, folder: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut `path` into numbered pieces `folder/partKK/<name>.KK` of at most part_bytes; return their paths."""
    parts = []
    with open(path, "rb") as source:
        index = 1
        while chunk := source.read(part_bytes):
            part = folder / f"part{index:02d}" / f"{path.name}.{index:02d}"  # padded: globs keep the order
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(chunk)
            parts.append(part)
            index += 1
    return parts


def plan_calls(root: str, parts: list[Path], wheel_name: str, wheel_sha256: str, specdec_wheel: str,
               artifacts: list[str]) -> list[DeviceCall]:
    """Return the device calls: one per piece, then one carrying the kit that runs the check.

    Paths in commands are relative to the repository root, where the device tool runs them;
    pieces carried by earlier calls stay there (ignored paths are kept between calls).
    """
    calls = [DeviceCall([f"{root}/{part.parent.name}"], f"ls -l {root}/{part.parent.name}") for part in parts]
    joined = f"/tmp/{wheel_name}"
    lib_dirs = "import glob,site;print(':'.join(glob.glob(site.getsitepackages()[0]+'/nvidia/*/lib')))"
    command = " && ".join([
        "set -o pipefail",
        "nvidia-smi -L",
        f"cat {root}/part*/{wheel_name}.* > {joined}",
        f"echo '{wheel_sha256}  {joined}' | sha256sum -c",
        f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {joined} "
        f"{root}/kit/{specdec_wheel}",
        # onnxruntime-gpu finds CUDA 13 and cuDNN 9 in the image's nvidia-* packages (PyTorch's)
        f'export LD_LIBRARY_PATH="$(python3 -c "{lib_dirs}")"',
        "PYTHONPATH=/tmp/site python3 -m specdec.benchmarks.device_check "
        + " ".join(f"{root}/kit/{name}" for name in artifacts)
        + " --provider cuda --reference cpu --output $OUT/device_check.json",
    ])
    calls.append(DeviceCall([f"{root}/kit"], command))
    return calls


# name -> export settings of the tiny llama pairs the check runs: both ways the runtime keeps a KV cache on CUDA
TINY_ARTIFACTS = {"tiny-llama-concat": {"shared_kv": False}, "tiny-llama-fp16-shared": {"dtype": "fp16"}}


def _export_tiny_pairs(folder: Path) -> list[str]:
    """Export the TINY_ARTIFACTS into `folder`; return their names."""
    from specdec.exporter.pipeline import ExportConfig, run_export
    from specdec.exporter.tiny_models import build_tiny_pair

    target, draft = build_tiny_pair(folder.parent / "tiny-sources", "llama", seed=0)  # not carried
    for name, settings in TINY_ARTIFACTS.items():
        run_export(ExportConfig(target=str(target), draft=str(draft), output=folder / name, force=True, **settings),
                   progress=lambda message: None)
    return list(TINY_ARTIFACTS)


def build_kit(root: Path, repo: Path) -> list[DeviceCall]:
    """Write the pieces, the kit and the plan under `root`; return the planned calls."""
    root.mkdir(parents=True, exist_ok=True)
    download = root / "download"
    pip = [sys.executable, "-m", "pip", "-q"]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
                    "--implementation", "cp", *platforms, "-d", str(download), ORT_GPU], check=True)
    wheel = next(download.glob("onnxruntime_gpu-*.whl"))
    for old in root.glob("part*"):
        for piece in old.iterdir():
            piece.unlink()
    parts = split_file(wheel, root)
    kit = root / "kit"
    kit.mkdir(exist_ok=True)
    for old in kit.glob("specdec-*.whl"):
        old.unlink()
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(kit), str(repo)], check=True)
    specdec_wheel = next(kit.glob("specdec-*.whl")).name
    artifacts = _export_tiny_pairs(kit)
    calls = plan_calls(root.name if root.parent == repo else str(root), parts, wheel.name, sha256_of_file(wheel),
                       specdec_wheel, artifacts)
    (root / "plan.json").write_text(json.dumps([asdict(call) for call in calls], indent=2))
    commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    lines = ["# Device check plan", "", f"The kit holds specdec as of `{commit}`: rebuild it (`make device-kit`) "
             "after changing the runtime.", "", f"{len(calls)} calls of the device tool, back to back (it stays "
             "warm about 30 s after each), each with this `carry` and command:", ""]
    for number, call in enumerate(calls, 1):
        lines += [f"{number}. carry `{json.dumps(call.carry)}`", "", "   ```", f"   {call.command}", "   ```", ""]
    (root / "PLAN.md").write_text("\n".join(lines))
    return calls


def main(argv: list[str] | None = None) -> int:
    """Build the kit; print the plan. Return 0."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(".device"), help="where to write (default: .device)")
    args = parser.parse_args(argv)
    repo = Path.cwd()
    calls = build_kit(args.root.resolve(), repo.resolve())
    print((args.root / "PLAN.md").read_text())
    longest = max(len(call.command) for call in calls)
    print(f"{len(calls)} calls; each command is {longest} characters at most (limit 2000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
