"""Rotary: the rotary embeddings' rotation as the constant matrix it is.

A value computed from one tensor by data movement and negation alone (Reshape, Transpose, Slice, Split, Gather,
Concat with constant parameters, Neg), of the tensor's own shape and mixing the elements of each row of its last
axis the same way for every row, is that tensor times a constant signed permutation matrix: ``rotate_half``
(cat(-x2, x1)) and the interleaved pairs' stack(-x_odd, x_even) become one [D, D] MatMul, which the Gemm rule
puts on the NPU. The subgraph is read by running it on x = 1, 2, 3, ...: each output is plus or minus one input.

A function of the whole graph, not a node rewrite: it reads the edge region (``tables.edge_values``: a table
the CPU computes from the graph's inputs stays as it is, as a MatMul it would cost MACs there) once for every
rotation, and sorts the graph after its rewrites.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import helper
from onnx.reference import ReferenceEvaluator

from sdnpu.passes.canonical.constants import TARGET_OPSET
from sdnpu.passes.canonical.driver import RULE
from sdnpu.passes.canonical.tables import edge_values
from sdnpu.passes.irutil import Builder, remove_dead_nodes, reroute, static_shape
from sdnpu.passes.manager import PassResult

_SIGNED_MOVES = frozenset({"Reshape", "Transpose", "Slice", "Split", "Gather", "Neg", "Concat"})
_MAX_ROTATION = 512  # the widest last axis a signed permutation becomes a [D, D] MatMul for (a head's)


def _moved_from(y: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes) when ``y`` is computed from the one value ``x`` of its own shape by data movement and
    negation only (Reshape, Transpose, Slice, Split, Gather, Concat with constant parameters, Neg), else None.
    ``x`` is the nearest such value: a rotation applied after the streams' Concat (Flux's joint queries) reads
    the Concat's output, not the streams."""

    def walk(stop: ir.Value | None) -> tuple[list[ir.Value], dict[int, ir.Node], list[ir.Value]]:
        nodes: dict[int, ir.Node] = {}
        sources: dict[int, ir.Value] = {}
        seen: list[ir.Value] = []
        todo = [y]
        while todo:
            v = todo.pop(0)
            seen.append(v)
            p = v.producer()
            moved = v is not stop and p is not None and p.op_type in _SIGNED_MOVES and p.domain in ("", "ai.onnx")
            data = ([*p.inputs] if p.op_type == "Concat" else [p.inputs[0]]) if moved else []  # type: ignore[union-attr]
            params = [w for w in p.inputs if w is not None and w not in data] if moved else []  # type: ignore[union-attr]
            if not moved or any(w.const_value is None for w in params) or any(w is None for w in data):
                sources[id(v)] = v
                continue
            if id(p) not in nodes:
                nodes[id(p)] = p  # type: ignore[index]
                todo += data  # type: ignore[arg-type]
        return list(sources.values()), nodes, seen

    sources, nodes, seen = walk(None)
    shape = static_shape(y)
    candidates = [None] + [v for v in seen[1:] if static_shape(v) == shape]
    for stop in candidates:
        if stop is not None:
            sources, nodes, _ = walk(stop)
        if len(sources) == 1 and nodes and static_shape(sources[0]) == shape:
            return sources[0], list(nodes.values())
    return None


def _probe(x: ir.Value, y: ir.Value, nodes: list[ir.Node]) -> np.ndarray | None:
    """``nodes`` run on x = 1, 2, 3, ... (float64, in x's shape): y's elements as signed 1-based indices of
    x's, or None where the subgraph cannot be evaluated."""
    shape = static_shape(x)
    if shape is None or int(np.prod(shape)) > 1 << 26:
        return None
    order = {id(n): i for i, n in enumerate(x.graph or [])} if x.graph is not None else {}
    protos = [ir.serde.serialize_node(n) for n in sorted(nodes, key=lambda n: order.get(id(n), 0))]
    consts = {w.name: w.const_value.numpy() for n in nodes for w in n.inputs  # type: ignore[union-attr]
              if w is not None and w.const_value is not None}
    inits = [helper.make_tensor(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape, v.reshape(-1).tolist())
             for k, v in consts.items()]
    g = helper.make_graph(protos, "probe", [helper.make_tensor_value_info(x.name, 11, shape)],  # type: ignore[arg-type]
                          [helper.make_tensor_value_info(y.name, 0, None)], inits)  # type: ignore[arg-type]
    try:
        out = ReferenceEvaluator(helper.make_model(g, opset_imports=[helper.make_opsetid("", TARGET_OPSET)])).run(
            None, {x.name: np.arange(1, int(np.prod(shape)) + 1, dtype=np.float64).reshape(shape)})[0]
    except Exception:  # an op the reference evaluator takes otherwise: not a rotation we can read
        return None
    return np.asarray(out)


def write_rotations_as_matmuls(model: ir.Model) -> PassResult:
    """Every rotation outside the edge region as a MatMul by its signed permutation (``_rotations``)."""
    graph = model.graph
    done = _rotations(graph, edge_values(graph))
    return PassResult(modified=bool(done), counts={"signed permutations (rotary embeddings) -> MatMul": done})


def _rotations(graph: ir.Graph, edge: set[ir.Value]) -> int:
    """A value computed from one tensor by data movement and negation alone, of the tensor's own shape and
    mixing the elements of each row of its last axis the same way for every row, is that tensor times a
    constant signed permutation matrix: the rotary embeddings' rotation (``rotate_half``: cat(-x2, x1);
    interleaved pairs: stack(-x_odd, x_even)) as a [D, D] MatMul, which the Gemm rule puts on the NPU. Found by
    running the subgraph on x = 1, 2, 3, ...: each output is plus or minus one input."""
    done = 0
    for node in list(graph):
        if node.graph is None or node.op_type not in _SIGNED_MOVES or node.domain not in ("", "ai.onnx"):
            continue
        for y in node.outputs:
            shape = static_shape(y)
            readers = [u.node for u in y.uses()]
            inner = all(r.op_type in _SIGNED_MOVES and r.domain in ("", "ai.onnx") for r in readers)
            if shape is None or not shape or (readers and inner and not y.is_graph_output()) or y.dtype != ir.DataType.FLOAT:
                continue
            found = _moved_from(y)
            if found is None or found[0] in edge:
                continue
            x, nodes = found
            if shape[-1] > _MAX_ROTATION or not any(
                    n.op_type in ("Neg", "Concat") for n in nodes):
                continue
            out = _probe(x, y, nodes)
            if out is None or out.shape != shape:
                continue
            d = shape[-1]
            src = np.abs(out).astype(np.int64).reshape(-1, d) - 1
            sign = np.sign(out).reshape(-1, d)
            row = np.arange(src.shape[0])[:, None]
            cols = src - row * d
            if np.any(src < 0) or np.any(src // d != row) or not (np.all(cols == cols[:1]) and np.all(sign == sign[:1])):
                continue
            if np.array_equal(cols[0], np.arange(d)) and np.all(sign[0] == 1):  # moved back where it was
                reroute(graph, y, x)
                done += 1
                continue
            rotation = np.zeros((d, d), np.float32)
            rotation[cols[0], np.arange(d)] = sign[0]
            b = Builder(graph, RULE)
            mm = b.op("MatMul", [x, b.const(rotation, "rotation")], dtype=y.dtype, shape=shape)
            graph.insert_before(node, b.nodes)
            reroute(graph, y, mm.outputs[0])
            done += 1
    if done:
        remove_dead_nodes(graph)
        graph.sort()
    return done
