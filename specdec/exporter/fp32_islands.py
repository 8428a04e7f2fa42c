"""The parts of an fp16 graph that must compute in fp32: rotary angles and norm statistics.

onnxruntime's float16 converter turns every float tensor into fp16, including the ones
PyTorch keeps in fp32 inside a half-precision model (transformers computes the rotary
angles under `autocast(enabled=False)` and RMSNorm's statistics after `x.to(float32)`).
In fp16, a position id above 2048 is rounded to a multiple of 2, the angle
`position * inv_freq` to steps of up to 2 rad, and `Pow(x, 2)` overflows once |x| > 256.
Families whose graph keeps these as plain ops (qwen2, mistral, phi3: MatMul/Cos/Sin and
Pow/ReduceMean) need them back in fp32; fused ops (RotaryEmbedding with a precomputed cos
cache, SimplifiedLayerNormalization) already compute their statistics in fp32 inside.

An *island* is a set of nodes restored to fp32 after the conversion: their constants and
initializers get their original fp32 values back, a Cast to fp32 is put in front of each
fp16 input from outside, and a Cast to fp16 after each output used outside.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from specdec.exporter.grouped_attention import producers_and_consumers

ROTARY = "rotary_angles"
NORM = "norm_statistics"
# Where a norm's statistics end: these take the chain's value and, past them, it is the normalised
# activation again (in the range fp16 holds).
_STAT_CHAIN = ("Add", "Sqrt", "Reciprocal", "Div")


def name_every_node(model: onnx.ModelProto) -> None:
    """Give every node of the main graph a unique name (in place): islands are kept by node name."""
    seen: set[str] = set()
    for index, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            node.name = f"specdec_node_{index}_{node.op_type}"
        seen.add(node.name)


def find_islands(model: onnx.ModelProto) -> dict[str, list[str]]:
    """Return {ROTARY: node names, NORM: node names} of `model` (fp32, nodes named) to keep in fp32.

    ROTARY: Cos and Sin nodes and every float-valued node their input is computed from
    (position ids cast to float, inv_freq, the MatMul giving the angles, Concat/Transpose).
    NORM: per ReduceMean of Pow(x, 2) (or Mul(x, x)): the Pow, the ReduceMean and the chain
    after it up to the inverse standard deviation (Add eps, Sqrt, Reciprocal or Div(1, .)).
    """
    graph = model.graph
    producers, consumers = producers_and_consumers(graph)
    types = _tensor_types(model)
    rotary: list[str] = []
    for node in graph.node:
        if node.op_type in ("Cos", "Sin"):
            rotary += [n.name for n in _float_ancestors(node, producers, types)] + [node.name]
    norm: list[str] = []
    for node in graph.node:
        if node.op_type == "ReduceMean" and (square := _square_of(producers.get(node.input[0]))) is not None:
            norm += [square.name, node.name] + [n.name for n in _statistics_chain(node, consumers)]
    return {ROTARY: _unique(rotary + _constants_feeding(graph, set(rotary), consumers)),
            NORM: _unique(norm + _constants_feeding(graph, set(norm), consumers))}


def restore_islands(converted: onnx.ModelProto, original: onnx.ModelProto, island: set[str],
                    initializers: dict[str, onnx.TensorProto] | None = None) -> int:
    """Make the nodes named in `island` compute in fp32 again in `converted` (in place); return Casts added.

    `original` is the fp32 model `converted` came from (same node names; its weights may be
    left out), the source of the exact fp32 constants; `initializers` (default: original's)
    holds the fp32 initializers island nodes read. Tensors passed between two island nodes stay fp32.
    """
    if not island:
        return 0
    graph = converted.graph
    original_nodes = {node.name: node for node in original.graph.node}
    original_inits = initializers if initializers is not None else {i.name: i for i in original.graph.initializer}
    original_types = _tensor_types(original)
    _, consumers = producers_and_consumers(graph)
    inits = {init.name: init for init in graph.initializer}
    nodes = [node for node in graph.node if node.name in island]
    produced_inside = {out for node in nodes for out in node.output}
    added: list[onnx.NodeProto] = []
    to_fp32: dict[str, str] = {}

    for node in nodes:
        source = original_nodes[node.name]
        del node.attribute[:]
        node.attribute.extend(source.attribute)  # Constant values, Cast targets: as in the fp32 graph
        for index, tensor in enumerate(node.input):
            if not tensor or tensor in produced_inside:
                continue
            if tensor in inits and tensor in original_inits and \
                    all(user.name in island for user in consumers.get(tensor, [])):
                inits[tensor].CopyFrom(original_inits[tensor])
                continue
            if original_types.get(tensor) != TensorProto.FLOAT:
                continue  # integer inputs (position ids, axes) are the same in both graphs
            if tensor not in to_fp32:
                to_fp32[tensor] = f"{tensor}_specdec_fp32"
                added.append(helper.make_node("Cast", [tensor], [to_fp32[tensor]], to=TensorProto.FLOAT,
                                              name=f"{to_fp32[tensor]}_cast"))
            node.input[index] = to_fp32[tensor]
    graph_outputs = {output.name for output in graph.output}
    for node in nodes:
        for index, tensor in enumerate(node.output):
            outside = [user for user in consumers.get(tensor, []) if user.name not in island]
            if original_types.get(tensor) != TensorProto.FLOAT or not (outside or tensor in graph_outputs):
                continue
            inner = f"{tensor}_specdec_fp32_out"
            for user in consumers.get(tensor, []):
                if user.name in island:
                    user.input[:] = [inner if name == tensor else name for name in user.input]
            node.output[index] = inner
            added.append(helper.make_node("Cast", [inner], [tensor], to=TensorProto.FLOAT16, name=f"{inner}_cast"))
    # the converter typed every island tensor fp16; onnxruntime infers the right types itself
    stale = produced_inside | set(to_fp32.values())
    kept = [info for info in graph.value_info if info.name not in stale]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    _insert_in_order(graph, added)
    return len(added)


def fp16_sensitive_nodes(model: onnx.ModelProto) -> list[str]:
    """Return the names of Cos, Sin, and Pow/ReduceMean-of-a-square nodes whose float input is fp16.

    Empty for a graph whose rotary angles and norm statistics are computed in fp32 (or fused).
    """
    types = _tensor_types(model)
    producers, _ = producers_and_consumers(model.graph)
    sensitive = []
    for node in model.graph.node:
        square = node.op_type == "ReduceMean" and _square_of(producers.get(node.input[0])) is not None
        if (node.op_type in ("Cos", "Sin") or square) and types.get(node.input[0]) == TensorProto.FLOAT16:
            sensitive.append(node.name)
    return sensitive


def _tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """Return {tensor name: elem_type} from the graph and onnx's type inference (contrib ops stay unknown)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is a help: without it only declared types are known
        inferred = model
    graph = inferred.graph
    types = {info.name: info.type.tensor_type.elem_type
             for info in [*graph.input, *graph.output, *graph.value_info]}
    types.update({init.name: init.data_type for init in graph.initializer})
    for node in graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    types[node.output[0]] = attribute.t.data_type
        if node.op_type == "Cast":  # the target type needs no inference
            types.setdefault(node.output[0], helper.get_attribute_value(node.attribute[0]))
    return types


def _float_ancestors(node: onnx.NodeProto, producers: dict[str, onnx.NodeProto],
                     types: dict[str, int]) -> list[onnx.NodeProto]:
    """Return the nodes producing `node`'s float inputs, transitively, through float tensors only."""
    found: dict[str, onnx.NodeProto] = {}
    stack = list(node.input)
    while stack:
        tensor = stack.pop()
        producer = producers.get(tensor)
        if producer is None or producer.name in found or types.get(tensor) != TensorProto.FLOAT:
            continue
        found[producer.name] = producer
        stack.extend(producer.input)
    return list(found.values())


def _square_of(node: onnx.NodeProto | None) -> onnx.NodeProto | None:
    """Return `node` if it squares its input (Pow(x, 2) or Mul(x, x)), else None."""
    if node is None:
        return None
    if node.op_type == "Mul" and len(node.input) == 2 and node.input[0] == node.input[1]:
        return node
    return node if node.op_type == "Pow" else None


def _statistics_chain(reduce_mean: onnx.NodeProto, consumers: dict[str, list[onnx.NodeProto]]) -> list[onnx.NodeProto]:
    """Return the nodes after a variance's ReduceMean up to the inverse standard deviation."""
    chain = []
    tensor = reduce_mean.output[0]
    while len(users := consumers.get(tensor, [])) == 1 and users[0].op_type in _STAT_CHAIN:
        user = users[0]
        if user.op_type == "Div" and user.input[1] != tensor:
            break  # x / std: the normalised activation, no longer a statistic
        chain.append(user)
        tensor = user.output[0]
    return chain


def _constants_feeding(graph: onnx.GraphProto, names: set[str], consumers) -> list[str]:
    """Return the Constant nodes whose users all lie in `names`: their values belong to the island."""
    return [node.name for node in graph.node if node.op_type == "Constant"
            and (users := consumers.get(node.output[0], [])) and all(user.name in names for user in users)]


def _unique(names: list[str]) -> list[str]:
    return list(dict.fromkeys(names))


def _insert_in_order(graph: onnx.GraphProto, added: list[onnx.NodeProto]) -> None:
    """Put each added Cast right after the node producing its input (first, for graph inputs and initializers)."""
    nodes = list(graph.node)
    by_output = {out: node.name for node in nodes for out in node.output}
    after: dict[str, list[onnx.NodeProto]] = {}
    for cast in added:
        after.setdefault(by_output.get(cast.input[0], ""), []).append(cast)
    ordered = after.get("", [])[:]
    for node in nodes:
        ordered.append(node)
        ordered.extend(after.get(node.name, []))
    del graph.node[:]
    graph.node.extend(ordered)
