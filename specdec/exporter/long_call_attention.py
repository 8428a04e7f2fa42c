"""A second attention kernel for long calls (prefills), chosen per call by a boolean input.

onnxruntime's GroupQueryAttention (CPU, float32) runs every call over a past longer than one
position through a flash kernel (`MlasFlashAttentionGQA`) whose key/value block is sized from
the L2 cache: on a 2 MiB L2 that is one block of up to 1,024 positions, so a 285-token prefill
computes the whole 285 x 285 score square and masks the upper half. The op's other kernel
takes the softmax over the causal part only and runs such a prefill's attention in about half
the time (SmolLM2-135M, 285 tokens: 2.0 against 3.8 ms per layer), but it is the slower one
for 1-token steps. onnxruntime picks the other kernel whenever the op has a `head_sink` input
(per-head logits added to the softmax's denominator); a sink of -inf adds exp(-inf) = 0, so the
result is that kernel's, bit for bit.

The rewrite wraps each GroupQueryAttention in an If on one new graph input, `long_call` (bool
[1]): its then-branch is the same op with a -inf `head_sink`, its else-branch the op as it was.
Both branches read the same outer values (weights are not copied) and write the same present
tensors, so the shared KV buffer is still written in place. The runtime sets the input for calls
longer than any verify call (`specdec/runtime/session.py`, `LONG_CALL_ROWS`), so a prefill takes the
causal kernel and steps and verify calls keep the kernel they had: speculative greedy output is
unchanged, since target-only and speculative decoding prefill the same prompt alike.
The Ifs cost every call ~0.5 ms on SmolLM2 (30 of them; 0.4-2.9% of a step), against ~70 ms
saved in a 285-token prefill (docs/FAIR_ANCHORS.md, "The long-call kernel depends on the CPU").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

LONG_CALL_NAME = "long_call"  # GraphSpec.long_call_name of a rewritten graph
_HEAD_SINK_INPUT = 11  # GroupQueryAttention's head_sink (onnxruntime contrib schema)


def _branch(node: onnx.NodeProto, tag: str, with_sink: bool, heads: int) -> onnx.GraphProto:
    """Return a subgraph holding a copy of `node` (with a -inf head sink if asked), its outputs renamed."""
    outputs = [f"{name}_{tag}" if name else "" for name in node.output]
    inputs = list(node.input)
    body: list[onnx.NodeProto] = []
    if with_sink:
        sink = f"{node.name or node.output[0]}_head_sink"
        body.append(helper.make_node("Constant", [], [sink],
                                     value=numpy_helper.from_array(np.full(heads, -np.inf, np.float32))))
        inputs = inputs + [""] * (_HEAD_SINK_INPUT - len(inputs)) + [sink]
    copy = helper.make_node(node.op_type, inputs, outputs, name=f"{node.name}_{tag}", domain=node.domain)
    copy.attribute.extend(node.attribute)
    body.append(copy)
    return helper.make_graph(body, f"{node.name}_{tag}", [],
                             [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs if name])


def add_long_call_attention(model: onnx.ModelProto) -> int:
    """Wrap every GroupQueryAttention of a float32 graph in an If on a new `long_call` input (in place).

    Returns how many attention nodes were wrapped: 0 (graph untouched) when it has none, when
    one already carries inputs past the rewrite's head sink (sinks or position ids of its own),
    or when it was rewritten already.
    """
    graph = model.graph
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.domain == "com.microsoft"]
    if not attention or any(i.name == LONG_CALL_NAME for i in graph.input):
        return 0
    if any(len(n.input) > 9 and any(n.input[9:]) for n in attention):
        return 0  # position ids, a bias or sinks of its own: not a graph this rewrite was measured on
    graph.input.append(helper.make_tensor_value_info(LONG_CALL_NAME, TensorProto.BOOL, [1]))
    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:
        if node not in attention:
            graph.node.append(node)
            continue
        heads = next(a.i for a in node.attribute if a.name == "num_heads")
        graph.node.append(helper.make_node(
            "If", [LONG_CALL_NAME], [name for name in node.output if name], name=f"{node.name}_long_call",
            then_branch=_branch(node, "long", True, heads), else_branch=_branch(node, "short", False, heads)))
    return len(attention)


def add_long_call_attention_file(path: Path) -> int:
    """Rewrite the graph file at `path` in place (see add_long_call_attention); return the nodes wrapped.

    Weights in external data stay where they are: only the graph's structure is rewritten.
    """
    model = onnx.load(str(path), load_external_data=False)
    wrapped = add_long_call_attention(model)
    if wrapped:
        temporary = path.with_suffix(".long_call.onnx")
        onnx.save(model, str(temporary))
        temporary.replace(path)
    return wrapped
