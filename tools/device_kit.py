"""Packs what a lent CUDA machine needs for `device_check` into pieces its tool can carry.

The device tool carries at most 64 MiB per call, the onnxruntime-gpu wheel is ~256 MB, an
fp16 SmolLM2 artifact ~270 MB, and that machine reaches no package index. So `python
tools/device_kit.py` (`make device-kit`) writes, under `.device/` (git-ignored):
- part01/, part02/, ...: the onnxruntime-gpu wheel for the machine's Python and a tar of the
  fp16 SmolLM2 artifact, cut in pieces of at most PART_BYTES, one folder per call;
- kit/: the specdec wheel (runtime only; the machine's image already has numpy,
  tokenizers, click and jinja2) and two tiny llama draft+target artifacts: fp32 with a
  concat KV cache (the slice graph's rollback on the device), and fp16 with one shared
  KV buffer per tensor (CUDA's GroupQueryAttention writing the cache in place);
- plan.json and PLAN.md: the calls to make, in order, each with its `carry` list and
  command: one per piece, then one carrying the kit that joins the pieces, checks their
  sha256, installs both wheels and runs the whole check (placement, KV addresses, logits
  against the CPU, greedy equality, tokens/s target-only and with every drafter the
  SmolLM2 artifact has, the batch engine's run) on CUDA, within RUN_SECONDS, printing one
  JSON report.
The SmolLM2 artifact is exported here (`--dtype fp16`, target-only: n-gram drafts; a
`specdec distill` head in it is checked too) when `--smollm2` does not exist yet.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
from dataclasses import asdict, dataclass
from pathlib import Path

from specdec.models.manifest import sha256_of_file

PART_BYTES = 62 * 2**20  # leaves ~2 MiB of the 64 MiB carry for the working tree itself
ORT_GPU = "onnxruntime-gpu==1.31.1"  # built for CUDA 13 and cuDNN 9, as the lent machine's image has
DEVICE_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
RUN_SECONDS = 480  # the check's own limit on the device (the tool's is 600): 8 minutes
MAX_NEW_TOKENS = 64  # per generation: long enough for a decode rate, short enough for the limit
SMOLLM2 = Path("artifacts/gpu-smollm2-fp16")
SMOLLM2_NAME = "smollm2-fp16"  # the folder's name on the device


@dataclass(frozen=True)
class DeviceCall:
    """One call of the device tool: what to carry and what to run."""

    carry: list[str]
    command: str


@dataclass(frozen=True)
class Packed:
    """A file carried in pieces: its name, its sha256 and the pieces in order."""

    name: str
    sha256: str
    pieces: list[Path]


def split_file(path: Path, folder: Path, part_bytes: int = PART_BYTES, first_folder: int = 1) -> list[Path]:
    """Cut `path` into pieces `folder/partNN/<name>.KK` of at most part_bytes (NN counts from first_folder,
    KK from 1); return their paths."""
    parts = []
    with open(path, "rb") as source:
        index = 1
        while chunk := source.read(part_bytes):
            # padded numbers: the device's glob `part*/<name>.*` lists the pieces in order
            part = folder / f"part{first_folder + index - 1:02d}" / f"{path.name}.{index:02d}"
            part.parent.mkdir(parents=True, exist_ok=True)
            part.write_bytes(chunk)
            parts.append(part)
            index += 1
    return parts


def tar_folder(folder: Path, tar_path: Path, name: str) -> Path:
    """Write `folder` as an uncompressed tar whose top folder is `name` (fp16 weights barely compress)."""
    with tarfile.open(tar_path, "w") as archive:
        archive.add(folder, arcname=name)
    return tar_path


def join_commands(root: str, packed: Packed) -> list[str]:
    """Return the shell commands that rejoin `packed` as /tmp/<name> on the device and check its sha256."""
    joined = f"/tmp/{packed.name}"
    return [f"cat {root}/part*/{packed.name}.* > {joined}", f"echo '{packed.sha256}  {joined}' | sha256sum -c --quiet"]


def check_command(root: str, wheel: Packed, specdec_wheel: str, tiny_artifacts: list[str],
                  smollm2: Packed | None) -> str:
    """Return the last call's command: join, verify, install, then the check printing one JSON report."""
    lib_dirs = "import glob,site;print(':'.join(glob.glob(site.getsitepackages()[0]+'/nvidia/*/lib')))"
    artifacts = [f"{root}/kit/{name}" for name in tiny_artifacts]
    steps = ["set -o pipefail", "nvidia-smi -L >&2", *join_commands(root, wheel)]
    if smollm2 is not None:
        steps += [*join_commands(root, smollm2), f"tar -xf /tmp/{smollm2.name} -C /tmp"]
        artifacts.append(f"/tmp/{SMOLLM2_NAME}")
    steps += [
        f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/{wheel.name} "
        f"{root}/kit/{specdec_wheel} >&2",
        # CUDA 13 puts its libraries in nvidia/cu13/lib, cuDNN in nvidia/cudnn/lib: the glob finds both
        f'export LD_LIBRARY_PATH="$(python3 -c "{lib_dirs}")"',
        f"PYTHONPATH=/tmp/site timeout {RUN_SECONDS} python3 -m specdec.certify.device_check "
        + " ".join(artifacts)
        + f" --provider cuda --reference cpu --max-new-tokens {MAX_NEW_TOKENS} --output $OUT/device_check.json",
    ]
    return " && ".join(steps)


def plan_calls(root: str, packed: list[Packed], specdec_wheel: str, tiny_artifacts: list[str],
               smollm2: Packed | None = None) -> list[DeviceCall]:
    """Return the device calls: one per piece (of `packed`, the wheel first), then one carrying the kit.

    Paths in commands are relative to the repository root, where the device tool runs them;
    pieces carried by earlier calls stay there (ignored paths are kept between calls).
    """
    calls = [DeviceCall([f"{root}/{piece.parent.name}"], f"ls -l {root}/{piece.parent.name}")
             for item in packed for piece in item.pieces]
    calls.append(DeviceCall([f"{root}/kit"], check_command(root, packed[0], specdec_wheel, tiny_artifacts, smollm2)))
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


def ensure_smollm2(folder: Path) -> Path:
    """Return `folder`, exporting the bundled SmolLM2 GGUF there (fp16, target-only) if it has no manifest, or one
    from before fp16 exports had the batch engine's ragged-rows graph."""
    from specdec.models.manifest import load_manifest

    if not (folder / "specdec.json").is_file() or not load_manifest(folder, check_files=False).target.ragged_file:
        from specdec.exporter.bundled import smollm2_gguf_path
        from specdec.exporter.pipeline import ExportConfig, run_export

        print(f"exporting SmolLM2 fp16 to {folder} (a few minutes)", file=sys.stderr)
        run_export(ExportConfig(target=str(smollm2_gguf_path()), draft=None, output=folder, dtype="fp16", force=True),
                   progress=lambda message: print(message, file=sys.stderr))
    return folder


def _download_wheel(download: Path) -> Path:
    pip = [sys.executable, "-m", "pip", "-q"]
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
                    "--implementation", "cp", *platforms, "-d", str(download), ORT_GPU], check=True)
    return next(download.glob("onnxruntime_gpu-*.whl"))


def build_kit(root: Path, repo: Path, smollm2: Path | None, download_wheel=_download_wheel) -> list[DeviceCall]:
    """Write the pieces, the kit and the plan under `root`; return the planned calls.

    `smollm2`: an fp16 SmolLM2 artifact folder to carry (None: the tiny artifacts only).
    """
    root.mkdir(parents=True, exist_ok=True)
    download = root / "download"
    download.mkdir(exist_ok=True)
    for old in root.glob("part*"):
        for piece in old.iterdir():
            piece.unlink()
        old.rmdir()
    wheel = download_wheel(download)
    files = [wheel] + ([tar_folder(smollm2, download / f"{SMOLLM2_NAME}.tar", SMOLLM2_NAME)] if smollm2 else [])
    packed, next_folder = [], 1
    for path in files:
        pieces = split_file(path, root, first_folder=next_folder)
        packed.append(Packed(path.name, sha256_of_file(path), pieces))
        next_folder += len(pieces)
    kit = root / "kit"
    kit.mkdir(exist_ok=True)
    for old in kit.glob("specdec-*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "-q", "wheel", "--no-deps", "-w", str(kit), str(repo)], check=True)
    specdec_wheel = next(kit.glob("specdec-*.whl")).name
    tiny = _export_tiny_pairs(kit)
    name = root.name if root.parent == repo else str(root)
    calls = plan_calls(name, packed, specdec_wheel, tiny, packed[1] if smollm2 else None)
    (root / "plan.json").write_text(json.dumps([asdict(call) for call in calls], indent=2))
    (root / "PLAN.md").write_text(plan_text(calls, repo))
    return calls


def plan_text(calls: list[DeviceCall], repo: Path) -> str:
    """Return PLAN.md: which commit the kit holds, and each call's carry and command."""
    commit = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    lines = ["# Device check plan", "", f"The kit holds specdec as of `{commit}`: rebuild it (`make device-kit`) "
             "after changing the runtime.", "", f"{len(calls)} calls of the device tool, back to back (it stays "
             "warm about 30 s after each), each with this `carry` and command. The last prints one JSON "
             f"report (also in $OUT/device_check.json) and ends within {RUN_SECONDS} s.", ""]
    for number, call in enumerate(calls, 1):
        lines += [f"{number}. carry `{json.dumps(call.carry)}`", "", "   ```", f"   {call.command}", "   ```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Build the kit; print the plan. Return 0 (1 with a one-line error when a step fails)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(".device"), help="where to write (default: .device)")
    parser.add_argument("--smollm2", type=Path, default=SMOLLM2,
                        help=f"fp16 SmolLM2 artifact to carry, exported there if missing (default: {SMOLLM2})")
    parser.add_argument("--no-smollm2", action="store_true", help="carry the tiny artifacts only (fewer calls)")
    args = parser.parse_args(argv)
    repo = Path.cwd().resolve()
    try:
        args.root.resolve().mkdir(parents=True, exist_ok=True)  # a root it cannot write fails before the export
        smollm2 = None if args.no_smollm2 else ensure_smollm2(args.smollm2)
        calls = build_kit(args.root.resolve(), repo, smollm2)
    except (subprocess.CalledProcessError, OSError, StopIteration) as err:
        print(f"error: the kit was not built: {err}", file=sys.stderr)
        return 1
    print((args.root / "PLAN.md").read_text())
    longest = max(len(call.command) for call in calls)
    print(f"{len(calls)} calls; each command is {longest} characters at most (limit 2000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
