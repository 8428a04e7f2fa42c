"""What the device check reads as proof, as pure functions: where nodes ran, whether buffers
moved, whether two providers' logits agree within rounding, whether TF32 was off.

Nothing here touches a session; `device_check` gathers the inputs (profiles, logs, logits,
addresses) and these decide. Each is tested on the CPU with inputs that must fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
FLOAT_TYPES = ("float", "float16", "bfloat16", "double")  # as the profiler names tensor types
MEMCPY_OPS = ("MemcpyToHost", "MemcpyFromHost")
# Allowed |device logit - CPU logit| in fp16 steps (spacing of float16 at the row's largest
# |logit|), per KV dtype. fp16 graphs round every op's output to fp16 on both sides, with
# different kernels and summation orders: a few steps. fp32 graphs with TF32 off differ by
# summation order only; a quarter step (~2.4e-4 of the row's scale) is far above that and
# below what TF32's 10-bit mantissa leaves. Chosen, not yet measured on a GPU (docs/GPU.md).
FP16_STEPS = {"float16": 8.0, "float32": 0.25}


def fp16_step(magnitude: float) -> float:
    """Return the spacing of float16 numbers at `magnitude` (0.015625 at 16, 2**-24 near 0)."""
    return float(np.spacing(np.float16(min(abs(magnitude), 65504.0))))


def logit_bound(reference_row: np.ndarray, kv_dtype: str) -> float:
    """Return the largest |device - reference| allowed in a logit row [vocab]: FP16_STEPS[kv_dtype]
    fp16 steps at the row's largest |logit| (a flat 1e-2 is below one step for logits >= 16)."""
    return FP16_STEPS[kv_dtype] * fp16_step(float(np.abs(reference_row).max()))


def logit_excess(device: np.ndarray, reference: np.ndarray, kv_dtype: str) -> list[dict]:
    """Return one {"row", "max_diff", "bound", "steps"} per row [rows, vocab] beyond logit_bound; [] if none.

    `steps` is the row's largest difference in fp16 steps of its scale.
    """
    if device.shape != reference.shape:
        raise ValueError(f"logit shapes differ: {device.shape} vs {reference.shape}")
    excess = []
    for row, (got, want) in enumerate(zip(device.astype(np.float64), reference.astype(np.float64))):
        diff, bound = float(np.abs(got - want).max()), logit_bound(want, kv_dtype)
        if not diff <= bound:  # NaN fails too
            excess.append({"row": row, "max_diff": diff, "bound": bound,
                           "steps": diff / fp16_step(float(np.abs(want).max()))})
    return excess


def max_steps(device: np.ndarray, reference: np.ndarray) -> float:
    """Return the largest row difference [rows, vocab] in fp16 steps of the row's scale (for the report)."""
    return max(float(np.abs(d.astype(np.float64) - r).max()) / fp16_step(float(np.abs(r).max()))
               for d, r in zip(device, reference.astype(np.float64)))


@dataclass(frozen=True)
class NodeRun:
    """One node's kernel as onnxruntime's profiler recorded it."""

    name: str
    op: str
    provider: str
    types: tuple[str, ...]  # element types of its inputs and outputs

    @property
    def moves_floats(self) -> bool:
        """Return whether any of its tensors is floating point (not shape arithmetic)."""
        return any(t in FLOAT_TYPES for t in self.types)


def profile_nodes(events: list[dict]) -> list[NodeRun]:
    """Return the distinct node kernels in a profile's events (the JSON list `end_profiling` writes)."""
    runs = {}
    for event in events:
        args = event.get("args", {})
        if event.get("cat") != "Node" or "provider" not in args:
            continue
        types = tuple(t for key in ("input_type_shape", "output_type_shape")
                      for entry in args.get(key, []) for t in entry)
        run = NodeRun(event["name"].removesuffix("_kernel_time"), args.get("op_name", "?"), args["provider"], types)
        runs[(run.name, run.provider)] = run
    return list(runs.values())


def placement_failures(nodes: list[NodeRun], expected: str) -> tuple[list[str], list[str]]:
    """Return (failures, tolerated) for the nodes of a profile that should run on `expected`.

    A node elsewhere fails when it touches a floating-point tensor (the work fell back);
    one that handles only integers is tolerated and listed: the CUDA provider places shape
    arithmetic on the CPU on purpose. A Memcpy of a floating-point tensor fails too: the
    data crossed devices. A profile with no node at all fails (nothing was proven).
    """
    if not nodes:
        return ["the profile recorded no node"], []
    failures, tolerated = [], []
    for node in nodes:
        types = "/".join(sorted(set(node.types))) or "no types"
        if node.op in MEMCPY_OPS and node.moves_floats:
            failures.append(f"{node.op} {node.name} copies {types} across devices")
        elif node.provider != expected:
            (failures if node.moves_floats or not node.types else tolerated).append(
                f"{node.op} {node.name} ran on {node.provider} ({types})")
    return failures, tolerated


_PLACED = re.compile(r"(?:All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)")
_WARNINGS = ("were not assigned to the preferred execution providers", "Memcpy nodes are added")


def log_placements(log: str) -> dict[str, int]:
    """Return {provider: nodes} from onnxruntime's VERBOSE session-creation log ({} if it has none)."""
    placed: dict[str, int] = {}
    for provider, count in _PLACED.findall(log):
        placed[provider] = placed.get(provider, 0) + int(count)
    return placed


def log_warnings(log: str) -> list[str]:
    """Return the log's lines that say nodes fell to another provider or Memcpy nodes were added."""
    return [line.split("] ", 1)[-1].strip() for line in log.splitlines() if any(w in line for w in _WARNINGS)]


def moved_buffers(before: list[int], after: list[int]) -> list[int]:
    """Return the indices of KV buffers whose device address changed between two steps."""
    if len(before) != len(after):
        return list(range(max(len(before), len(after))))
    return [i for i, (a, b) in enumerate(zip(before, after)) if a != b]


def tf32_failures(provider_options: dict[str, dict[str, str]], kv_dtype: str) -> list[str]:
    """Return a failure if a CUDA session of an fp32 graph may use TF32 (its 10-bit mantissa
    would be measured as the graph's error); [] for fp16 graphs and non-CUDA sessions."""
    cuda = provider_options.get(CUDA)
    if cuda is None or kv_dtype != "float32":
        return []
    if str(cuda.get("use_tf32", "1")) != "0":
        return [f"an fp32 graph runs with use_tf32={cuda.get('use_tf32', 'unset')}: TF32 must be off to check it"]
    return []
