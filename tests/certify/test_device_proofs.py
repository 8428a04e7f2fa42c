"""The device check's proofs, fed inputs that must pass and inputs that must fail."""

import numpy as np
import pytest

from specdec.certify import device_proofs as proofs


def _event(name, op, provider, inputs, outputs):
    return {"cat": "Node", "name": f"{name}_kernel_time", "args": {
        "op_name": op, "provider": provider, "input_type_shape": [{t: [1]} for t in inputs],
        "output_type_shape": [{t: [1]} for t in outputs]}}


def test_fp16_steps_follow_the_logits_size():
    assert proofs.fp16_step(16.0) == proofs.fp16_step(31.0) == 2 ** -6
    assert proofs.fp16_step(1.0) == 2 ** -10 and proofs.fp16_step(0.0) == 2 ** -24
    row = np.array([20.0, -3.0, 0.5])
    # the old flat near-tie tolerance (1e-2) is below one fp16 step at 20: rounding alone could fail it
    assert proofs.logit_bound(row, "float16") == 8 * 2 ** -6 > 1e-2
    assert proofs.logit_bound(row, "float32") == 0.25 * 2 ** -6
    assert proofs.logit_bound(row / 16, "float16") == proofs.logit_bound(row, "float16") / 16  # relative


def test_logits_within_the_bound_pass_and_beyond_it_fail():
    reference = np.array([[20.0, 1.0, -2.0], [2.0, 0.5, 0.25]])
    within = reference + np.array([[0.12, -0.1, 0.0], [0.015, 0.0, 0.0]])  # < 8 steps of 2**-6 and 2**-9
    assert proofs.logit_excess(within, reference, "float16") == []
    beyond = reference.copy()
    beyond[1, 2] += 0.02  # at scale 2 a step is 2**-9: 10 steps
    (excess,) = proofs.logit_excess(beyond, reference, "float16")
    assert excess["row"] == 1 and excess["steps"] == pytest.approx(0.02 * 2 ** 9)
    assert len(proofs.logit_excess(within, reference, "float32")) == 2  # fp32 allows a quarter step only
    nan = reference.copy()
    nan[0, 0] = np.nan
    assert [e["row"] for e in proofs.logit_excess(nan, reference, "float16")] == [0]
    assert proofs.max_steps(beyond, reference) == pytest.approx(10.24)


def test_placement_tolerates_shape_arithmetic_on_the_cpu_only():
    events = [
        _event("MatMul_1", "MatMul", proofs.CUDA, ["float16", "float16"], ["float16"]),
        _event("Gather_shape", "Gather", proofs.CPU, ["int64", "int64"], ["int64"]),
        {"cat": "Session", "name": "model_run", "args": {}},
    ]
    nodes = proofs.profile_nodes(events + events)  # a node runs many times: listed once
    assert len(nodes) == 2
    failures, tolerated = proofs.placement_failures(nodes, proofs.CUDA)
    assert failures == [] and tolerated == ["Gather Gather_shape ran on CPUExecutionProvider (int64)"]


@pytest.mark.parametrize("event, reason", [
    (_event("norm", "SimplifiedLayerNormalization", proofs.CPU, ["float16", "float16"], ["float16"]), "ran on CPU"),
    (_event("Memcpy_3", "MemcpyToHost", proofs.CUDA, ["float16"], ["float16"]), "copies float16 across devices"),
    (_event("mystery", "Custom", proofs.CPU, [], []), "(no types)"),
])
def test_placement_fails_on_float_work_or_copies_off_the_device(event, reason):
    ok = _event("MatMul_1", "MatMul", proofs.CUDA, ["float16"], ["float16"])
    failures, _ = proofs.placement_failures(proofs.profile_nodes([ok, event]), proofs.CUDA)
    assert len(failures) == 1 and reason in failures[0]


def test_an_empty_profile_proves_nothing():
    assert proofs.placement_failures([], proofs.CUDA) == (["the profile recorded no node"], [])


LOG = """\
2026-12-01 [W:onnxruntime:, session_state.cc:1263 VerifyEachNodeIsAssignedToAnEp] Some nodes were not assigned to the preferred execution providers which may or may not have an negative impact on performance. e.g. ORT explicitly assigns shape related ops to CPU to improve perf.
2026-12-01 [W:onnxruntime:, transformer_memcpy.cc:74 ApplyImpl] 2 Memcpy nodes are added to the graph main_graph for CUDAExecutionProvider. It might have negative impact on performance (including unable to run CUDA graph).
2026-12-01 [V:onnxruntime:, session_state.cc:1598 VerifyEachNodeIsAssignedToAnEp] Node placements
2026-12-01 [V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CUDAExecutionProvider]. Number of nodes: 60
2026-12-01 [V:onnxruntime:, session_state.cc:1601 VerifyEachNodeIsAssignedToAnEp]  Node(s) placed on [CPUExecutionProvider]. Number of nodes: 5
"""


def test_the_session_log_gives_placements_and_fallback_warnings():
    assert proofs.log_placements(LOG) == {proofs.CUDA: 60, proofs.CPU: 5}
    warnings = proofs.log_warnings(LOG)
    assert len(warnings) == 2 and warnings[0].startswith("Some nodes were not assigned")
    assert proofs.log_placements("") == {} and proofs.log_warnings("") == []


def test_moved_buffers_are_named():
    assert proofs.moved_buffers([10, 20, 30], [10, 20, 30]) == []
    assert proofs.moved_buffers([10, 20, 30], [10, 25, 30]) == [1]
    assert proofs.moved_buffers([10, 20], [10, 20, 30]) == [0, 1, 2]


def test_tf32_must_be_off_for_fp32_graphs_on_cuda():
    assert proofs.tf32_failures({proofs.CUDA: {"use_tf32": "1"}}, "float32") != []
    assert proofs.tf32_failures({proofs.CUDA: {}}, "float32") != []  # onnxruntime's default is on
    assert proofs.tf32_failures({proofs.CUDA: {"use_tf32": "0"}}, "float32") == []
    assert proofs.tf32_failures({proofs.CUDA: {"use_tf32": "1"}}, "float16") == []
    assert proofs.tf32_failures({proofs.CPU: {}}, "float32") == []
