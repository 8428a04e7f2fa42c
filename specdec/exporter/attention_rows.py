"""Every attention call over two query rows at least, so a token's numbers do not depend on the call.

onnxruntime's GroupQueryAttention takes another path for a one-row query (a 1-token step)
than for several (a prefill, a verify call): its score and weighted-sum GEMMs use MLAS's
M = 1 kernel, which sums in another order. On SmolLM2 that moves a step's attention output
by ~6e-8 and its logits by ~3e-5 (fp32) against the same token scored inside a verify call;
an int4 graph at accuracy level 4 re-quantizes activations to int8 at every MatMul and turns
it into ~0.8 (enough to change greedy tokens on 5 of 6 bench prompts). Speculative decoding
is exact only if a token's logits are the same in both, so the 1-row path must not be taken.

The rewrite appends a copy of the last query row to each GroupQueryAttention's q/k/v (Pad,
mode "edge", one row on the sequence axis), tells the op one more position is there
(seqlens_k + 1, total_sequence_length + 1: the throwaway row's key and value land one past
the call's last position, beyond the cache's length, where the next call writes over them),
and drops the extra output row (Slice). Every real row then goes through the multi-row
kernels, whose rows are independent of each other: a step's logits equal that token's row in
any verify call, to the bit. It costs one attention row per layer and two small nodes per
layer, where padding the whole call (the runtime's `min_rows`) ran every MatMul on two rows.
The KV buffer needs one position beyond the sequence (`GraphSpec.attention_pad_rows`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

ATTENTION_PAD_ROWS = 1  # GraphSpec.attention_pad_rows of a rewritten graph
ATTENTION_OPS = ("GroupQueryAttention",)
_SEQLENS_INPUT, _TOTAL_INPUT = 5, 6  # GroupQueryAttention's seqlens_k and total_sequence_length
_PADS, _ONE, _STARTS, _ENDS, _AXES = (f"specdec_attention_pad_{part}"
                                      for part in ("pads", "one", "starts", "ends", "axes"))


def pad_attention_queries(model: onnx.ModelProto) -> int:
    """Give every GroupQueryAttention one throwaway query row after the real ones (in place).

    Returns how many attention nodes were rewritten: 0 (graph untouched) when it has none,
    or when it was rewritten already.
    """
    graph = model.graph
    attention = [n for n in graph.node if n.op_type in ATTENTION_OPS and n.domain == "com.microsoft"]
    if not attention or any(init.name == _PADS for init in graph.initializer):
        return 0
    graph.initializer.extend([
        # [batch, sequence, width]: nothing before, one row after on the sequence axis.
        numpy_helper.from_array(np.array([0, 0, 0, 0, 1, 0], dtype=np.int64), _PADS),
        numpy_helper.from_array(np.array(1, dtype=np.int32), _ONE),
        numpy_helper.from_array(np.array([0], dtype=np.int64), _STARTS),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), _ENDS),
        numpy_helper.from_array(np.array([1], dtype=np.int64), _AXES),
    ])
    counts: dict[str, str] = {}  # seqlens_k / total_sequence_length (int32 by the op's schema) -> plus one
    first = list(graph.node).index(attention[0])
    added_first: list[onnx.NodeProto] = []
    for k, node in enumerate(attention):
        position = list(graph.node).index(node)
        before: list[onnx.NodeProto] = []
        for slot in (0, 1, 2):  # query (or packed q/k/v), key, value: "" when packed
            if slot >= len(node.input) or not node.input[slot]:
                continue
            padded = f"{node.input[slot]}_attention_pad_{k}"
            before.append(helper.make_node("Pad", [node.input[slot], _PADS], [padded], mode="edge",
                                           name=f"specdec_attention_pad_{k}_{slot}"))
            node.input[slot] = padded
        for slot in (_SEQLENS_INPUT, _TOTAL_INPUT):
            name = node.input[slot]
            if name not in counts:
                counts[name] = f"{name}_plus_attention_pad"
                added_first.append(helper.make_node("Add", [name, _ONE], [counts[name]],
                                                    name=f"specdec_attention_pad_count_{len(counts)}"))
            node.input[slot] = counts[name]
        output = node.output[0]
        node.output[0] = f"{output}_with_attention_pad"
        after = helper.make_node("Slice", [node.output[0], _STARTS, _ENDS, _AXES], [output],
                                 name=f"specdec_attention_pad_drop_{k}")
        for offset, extra in enumerate(before):
            graph.node.insert(position + offset, extra)
        graph.node.insert(position + len(before) + 1, after)
    # The counts read graph inputs only: computed once, before the first attention.
    for offset, extra in enumerate(added_first):
        graph.node.insert(first + offset, extra)
    return len(attention)


def strip_attention_pad(model: onnx.ModelProto) -> int:
    """Undo `pad_attention_queries` (in place): every attention reads its own rows again; return the nodes restored.

    For the ragged-rows rewrite, which splits each attention per row and then pads every row's own op.
    """
    graph = model.graph
    made = {n.name for n in graph.node if n.name.startswith("specdec_attention_pad_")}
    if not made:
        return 0
    original = {}  # a rewrite's output -> the tensor it stood for
    for node in graph.node:
        if node.name in made and node.op_type in ("Pad", "Add"):
            original[node.output[0]] = node.input[0]
    restored = 0
    for node in graph.node:
        if node.name in made and node.op_type == "Slice":  # the attention's real output name comes back
            original[node.input[0]] = node.output[0]
    for node in graph.node:
        if node.op_type in ATTENTION_OPS and node.name not in made:
            node.input[:] = [original.get(name, name) for name in node.input]
            if node.output[0] in original:
                node.output[0] = original[node.output[0]]
                restored += 1
    kept = [n for n in graph.node if n.name not in made]
    del graph.node[:]
    graph.node.extend(kept)
    ours = {_PADS, _ONE, _STARTS, _ENDS, _AXES}
    initializers = [i for i in graph.initializer if i.name not in ours]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    return restored


def pad_attention_file(graph_path: Path) -> int:
    """Rewrite the graph at `graph_path` with `pad_attention_queries`, replaced atomically; return the nodes rewritten."""
    model = onnx.load(str(graph_path))
    rewritten = pad_attention_queries(model)
    if rewritten:
        temporary = graph_path.with_suffix(".padded.onnx")
        onnx.save(model, str(temporary))
        os.replace(temporary, graph_path)
    return rewritten
