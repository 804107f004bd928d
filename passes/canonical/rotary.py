"""Rotary: the rotary embeddings' rotation as the constant matrix it is.

A value computed from one tensor by data movement and negation alone (Reshape, Transpose, Slice, Split, Gather,
Concat with constant parameters, Neg), of the tensor's own shape and mixing the elements of each row of its last
axis the same way for every row, is that tensor times a constant signed permutation matrix: ``rotate_half``
(cat(-x2, x1)) and the interleaved pairs' stack(-x_odd, x_even) become one [D, D] MatMul, which the Gemm rule
puts on the NPU. The subgraph is read by running it on x = 1, 2, 3, ...: each output is plus or minus one input.

The rotation written with its tables as 2 x 2 matrices (BFL's ``apply_rope``, HiDream's: x viewed
[.., D/2, 1, 2], ``f[..., 0] * x[..., 0] + f[..., 1] * x[..., 1]`` with f [.., D/2, 2, 2]) is a sum of
constant tables times movements of x, each reading within x's row of its last axis: each term is
``(x @ P) * A``, P the [D, D] movement of the row (the identity for x itself), A the term's table in x's shape
(each axis along which it does not vary kept as 1: the heads, the batch), the terms added in their order. Of
two terms, the first takes each column's own element (a + b is b + a, exactly): x * A + (x @ P) * B, P the
pairs swapped, one MatMul. The same products and sums, exact; a table the CPU computes from the graph's inputs
leaves the rotation as it is.

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
    sources, nodes, _ = walk(None)  # else the one source of as many elements (the [B, S, C] projection a head
    whole = static_shape(sources[0]) if len(sources) == 1 else None  # split views as [.., D/2, 2]): y reads it
    if nodes and whole is not None and shape is not None and int(np.prod(whole)) == int(np.prod(shape)):
        return sources[0], list(nodes.values())  # viewed in y's shape, where each row reads a row of its own
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


def _viewed(b: Builder, x: ir.Value, shape: tuple[int, ...]) -> ir.Value:
    """``x`` in ``shape`` (a Reshape, a view the reader absorbs), or ``x`` itself where it has that shape."""
    if static_shape(x) == shape:
        return x
    return b.op("Reshape", [x, b.const(np.array(shape, np.int64), "shape")], dtype=x.dtype, shape=shape).outputs[0]


def write_rotations_as_matmuls(model: ir.Model) -> PassResult:
    """Every rotation outside the edge region as a MatMul by its signed permutation (``_rotations``)."""
    graph = model.graph
    edge = edge_values(graph)
    pairs = _table_rotations(graph, edge)
    done = _rotations(graph, edge_values(graph) if pairs else edge)
    return PassResult(modified=bool(done or pairs), counts={
        "signed permutations (rotary embeddings) -> MatMul": done,
        "rotations by tables of 2 x 2 matrices -> x * A + (x @ P) * B": pairs})


_ROW_MOVES = frozenset({"Reshape", "Transpose", "Slice", "Split", "Gather", "Neg"})  # one data input each


def _moved_term(v: ir.Value, shape: tuple[int, ...]) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes): ``v`` computed up a chain of one-input movements and negations with constant parameters
    (``_ROW_MOVES``) from the nearest value ``x`` of ``shape``, or else from the chain's start where it holds as
    many elements (the [B, S, C] projection a head split reshapes); None otherwise."""
    nodes: list[ir.Node] = []
    cur = v
    while True:
        if nodes and static_shape(cur) == shape:
            return cur, nodes
        p = cur.producer()
        if (p is None or p.op_type not in _ROW_MOVES or p.domain not in ("", "ai.onnx") or p.inputs[0] is None
                or any(w is not None and w.const_value is None for w in p.inputs[1:])):
            start = static_shape(cur)
            if nodes and start is not None and int(np.prod(start)) == int(np.prod(shape)):
                return cur, nodes
            return None
        nodes.append(p)
        cur = p.inputs[0]


def _terms(v: ir.Value, top: bool = True) -> list[ir.Node] | None:
    """The Muls whose sum ``v`` is (a tree of Adds, each inner one read by its parent alone), in the order they
    are added; None where it is not such a sum."""
    p = v.producer()
    if p is None or p.domain not in ("", "ai.onnx") or (not top and (len(v.uses()) != 1 or v.is_graph_output())):
        return None
    if p.op_type == "Mul":
        return [p]
    if p.op_type != "Add" or any(w is None for w in p.inputs):
        return None
    out: list[ir.Node] = []
    for w in p.inputs:
        sub = _terms(w, top=False)  # type: ignore[arg-type]
        if sub is None:
            return None
        out += sub
    return out


def _smallest_broadcast(a: np.ndarray) -> np.ndarray:
    """``a`` with every axis along which it does not vary kept as 1 (it broadcasts back to ``a``)."""
    for axis in range(a.ndim):
        if a.shape[axis] > 1 and np.all(a == a.take([0], axis=axis)):
            a = a.take([0], axis=axis)
    return np.ascontiguousarray(a)


def _table_rotations(graph: ir.Graph, edge: set[ir.Value]) -> int:
    """Each sum of constant tables times movements of one tensor x within its rows (``y = Add(Mul(t0, m0(x)),
    Mul(t1, m1(x)), ...)``, maybe through a Reshape back to x's shape) as ``sum_k (x @ P_k) * A_k``: the rotary
    with its tables written as 2 x 2 matrices (module docstring). The movements are read by running them on
    x = 1, 2, 3, ...; the tables broadcast to the sum's shape."""
    done = 0
    for node in list(graph):
        if node.graph is None or node.op_type not in ("Add", "Reshape") or node.domain not in ("", "ai.onnx"):
            continue
        y = node.outputs[0]
        shape = static_shape(y)
        if shape is None or not shape or y.dtype != ir.DataType.FLOAT or shape[-1] > _MAX_ROTATION:
            continue
        total = node if node.op_type == "Add" else node.inputs[0].producer()  # type: ignore[union-attr]
        if total is None or total.op_type != "Add" or (total is not node and len(total.outputs[0].uses()) != 1):
            continue
        if node.op_type == "Add" and any(u.node.op_type in ("Add", "Reshape") for u in y.uses()):
            continue  # the outermost node of the sum is the one rewritten
        sum_shape = static_shape(total.outputs[0])
        muls = _terms(total.outputs[0])
        if sum_shape is None or muls is None or len(muls) < 2 or int(np.prod(sum_shape)) != int(np.prod(shape)):
            continue
        d, n = shape[-1], int(np.prod(shape))
        terms: list[tuple[np.ndarray, np.ndarray]] = []  # (column map of a row, table in y's shape)
        x = None
        for mul in muls:
            sides = [i for i, w in enumerate(mul.inputs) if w is not None and w.const_value is not None]
            if len(sides) != 1 or static_shape(mul.outputs[0]) != sum_shape:
                break
            table = mul.inputs[sides[0]].const_value.numpy()  # type: ignore[union-attr]
            found = _moved_term(mul.inputs[1 - sides[0]], shape)  # type: ignore[arg-type]
            if found is None or (x is not None and found[0] is not x) or found[0] in edge:
                break
            x = found[0]
            moved = _probe(x, mul.inputs[1 - sides[0]], found[1])  # type: ignore[arg-type]
            if moved is None or table.dtype != np.float32:
                break
            try:
                at = np.broadcast_to(moved, sum_shape).reshape(-1)
                coef = np.broadcast_to(table, sum_shape).reshape(shape)
            except ValueError:
                break
            src = np.abs(at).astype(np.int64) - 1
            cols = (src % d).reshape(-1, d)
            if np.any(src // d != np.arange(n) // d) or not np.all(cols == cols[:1]):
                break
            terms.append((cols[0], coef * np.sign(at).reshape(shape).astype(np.float32)))
        else:
            if x is None or all(np.array_equal(c, np.arange(d)) for c, _ in terms):
                continue
            if len(terms) == 2:  # each column's own element read by the first term (a + b is b + a, exactly)
                (c0, a0), (c1, a1) = terms
                swap = (c1 == np.arange(d)) & (c0 != np.arange(d))
                terms = [(np.where(swap, c1, c0), np.where(swap, a1, a0)),
                         (np.where(swap, c0, c1), np.where(swap, a0, a1))]
            b = Builder(graph, RULE)
            x = _viewed(b, x, shape)  # the flat order is the rows'
            acc = None
            for cols, coef in terms:
                moved_x = x
                if not np.array_equal(cols, np.arange(d)):
                    rows = np.zeros((d, d), np.float32)
                    rows[cols, np.arange(d)] = 1.0
                    moved_x = b.op("MatMul", [x, b.const(rows, "rotation")], dtype=y.dtype, shape=shape).outputs[0]
                term = b.op("Mul", [moved_x, b.const(_smallest_broadcast(coef), "rotary_table")], dtype=y.dtype,
                            shape=shape).outputs[0]
                acc = term if acc is None else b.op("Add", [acc, term], dtype=y.dtype, shape=shape).outputs[0]
            graph.insert_before(node, b.nodes)
            reroute(graph, y, acc)  # type: ignore[arg-type]
            done += 1
    if done:
        remove_dead_nodes(graph)
        graph.sort()
    return done


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
                if static_shape(x) != shape:
                    continue  # a view of x: the layout's to read
                reroute(graph, y, x)
                done += 1
                continue
            rotation = np.zeros((d, d), np.float32)
            rotation[cols[0], np.arange(d)] = sign[0]
            b = Builder(graph, RULE)
            x = _viewed(b, x, shape)  # rows in x's flat order
            mm = b.op("MatMul", [x, b.const(rotation, "rotation")], dtype=y.dtype, shape=shape)
            graph.insert_before(node, b.nodes)
            reroute(graph, y, mm.outputs[0])
            done += 1
    if done:
        remove_dead_nodes(graph)
        graph.sort()
    return done
