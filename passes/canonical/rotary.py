"""Rotary: the rotary embeddings' rotation as the constant matrix it is.

A value computed from one tensor by data movement and negation alone (Reshape, Transpose, Slice, Split, Gather,
Concat with constant parameters, Neg), of the tensor's own shape and mixing the elements of each row of its last
axis the same way for every row, is that tensor times a constant signed permutation matrix: ``rotate_half``
(cat(-x2, x1)) and the interleaved pairs' stack(-x_odd, x_even) become one [D, D] MatMul, which the Gemm rule
puts on the NPU. The subgraph is read by running it on x = 1, 2, 3, ...: each output is plus or minus one input.

A rotation written with its tables as constants is a linear map of one tensor x whose every output element
reads at most two elements of its row of x: ``sum_k (x @ P_k) * A_k``, P_k a [D, D] movement of the row (the
identity for x itself), A_k a table in x's shape (each axis along which it does not vary kept as 1: the heads,
the batch). The map is read by running its nodes (movements, Neg, Mul by a constant, Add, Sub, Concat,
ScatterND) on arrays that name, for each element, the element of x it reads and its coefficient, in float64
(a coefficient that is a product of constants is taken once, rounded to float32; one table's, as it is). That
takes every spelling seen: the tables as 2 x 2 matrices (BFL's ``apply_rope``, HiDream's: x viewed [.., D/2,
1, 2], ``f[..., 0] * x[..., 0] + f[..., 1] * x[..., 1]``), the halves' products joined (``cat(x1 c - x2 s,
x1 s + x2 c)``) or interleaved (Wan's ``out[..., 0::2] = x1 c - x2 s``, an interleave once
``movement.interleave_row_scatters`` has read its ScatterNDs), and ``x cos + rotate_half(x) sin``. Of two
terms, the first takes each column's own element (a + b is b + a, exactly): x * A + (x @ P) * B, one MatMul.
A table the CPU computes from the graph's inputs leaves the products as they are (their rotation alone is
the signed permutation's MatMul).

A function of the whole graph, not a node rewrite: it reads the edge region (``tables.edge_values``: a table
the CPU computes from the graph's inputs stays as it is, as a MatMul it would cost MACs there) once for every
rotation, and sorts the graph after its rewrites.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.nodeeval import run_node
from sdnpu.passes.canonical.driver import RULE
from sdnpu.passes.canonical.tables import edge_values
from sdnpu.passes.irutil import Builder, attr, remove_dead_nodes, reroute, static_shape
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
    values = {id(x): np.arange(1, int(np.prod(shape)) + 1, dtype=np.float64).reshape(shape)}
    try:
        for node in sorted(nodes, key=lambda n: order.get(id(n), 0)):
            outs = _run_node(node, [values.get(id(w)) if w is not None else None for w in node.inputs])
            values.update((id(o), out) for o, out in zip(node.outputs, outs))
    except Exception:  # an op the reference evaluator takes otherwise: not a rotation we can read
        return None
    return values.get(id(y))


def _viewed(b: Builder, x: ir.Value, shape: tuple[int, ...]) -> ir.Value:
    """``x`` in ``shape``: the value up its chain of Reshapes that has that shape (x itself, or the heads x's
    pairs view), else a Reshape of the chain's start (a view the reader absorbs)."""
    up: ir.Value | None = x
    while up is not None:
        if static_shape(up) == shape:
            return up
        x = up  # else the chain's start, viewed: its other views go where nothing else reads them
        p = up.producer()
        up = p.inputs[0] if p is not None and p.op_type == "Reshape" and p.domain in ("", "ai.onnx") else None
    return b.op("Reshape", [x, b.const(np.array(shape, np.int64), "shape")], dtype=x.dtype, shape=shape).outputs[0]


def write_rotations_as_matmuls(model: ir.Model) -> PassResult:
    """Every rotation outside the edge region as a MatMul by its signed permutation (``_rotations``)."""
    graph = model.graph
    edge = edge_values(graph)
    done = _rotations(graph, edge)  # first: a signed permutation keeps its signs in its matrix
    sums = _linear_rotations(graph, edge_values(graph) if done else edge)
    return PassResult(modified=bool(done or sums), counts={
        "signed permutations (rotary embeddings) -> MatMul": done,
        "rotations by constant tables -> x * A + (x @ P) * B": sums})


def _smallest_broadcast(a: np.ndarray) -> np.ndarray:
    """``a`` with every axis along which it does not vary kept as 1 (it broadcasts back to ``a``)."""
    for axis in range(a.ndim):
        if a.shape[axis] > 1 and np.all(a == a.take([0], axis=axis)):
            a = a.take([0], axis=axis)
    return np.ascontiguousarray(a)


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


_MOVES = frozenset({"Reshape", "Transpose", "Slice", "Split", "Gather", "Squeeze", "Unsqueeze", "Identity"})
_LINEAR = _MOVES | {"Neg", "Mul", "Add", "Sub", "Concat", "ScatterND"}  # a linear map of one tensor, tables constant
_MAX_TERMS = 2  # a rotation's output element reads two of its input's
_MIN_HEAD = 8  # rows narrower than this are a rotation's pairs, not a head's channels
_MAX_MAP_NODES = 64  # the most nodes a rotation's map is read through


class _Constants:
    """Values computed from constants alone, within a few nodes: a table the folder left for its size (Wan's
    ``freqs_cos[..., 0::2]``, a Slice of a buffer of 4096 x 128), evaluated once."""

    _DEPTH = 8
    _LIMIT = 1 << 24  # elements

    def __init__(self) -> None:
        self._memo: dict[int, np.ndarray | None] = {}

    def of(self, v: ir.Value | None, depth: int = 0) -> np.ndarray | None:
        if v is None:
            return None
        if v.const_value is not None:
            return v.const_value.numpy()
        if id(v) in self._memo:
            return self._memo[id(v)]
        self._memo[id(v)] = None
        p, shape = v.producer(), static_shape(v)
        if p is None or p.domain not in ("", "ai.onnx") or depth >= self._DEPTH or shape is None or \
                int(np.prod(shape)) > self._LIMIT or any(w is None for w in p.inputs):
            return None
        args = [self.of(w, depth + 1) for w in p.inputs]
        if any(a is None for a in args):
            return None
        try:
            outs = _run_node(p, args)  # type: ignore[arg-type]
        except Exception:  # an op the reference evaluator takes otherwise: not a table we can read
            return None
        for o, out in zip(p.outputs, outs):
            self._memo[id(o)] = out
        return self._memo[id(v)]


def _linear_inputs(node: ir.Node, consts: _Constants) -> list[ir.Value] | None:
    """The inputs through which ``node`` is linear in a tensor (its other inputs constant), or None where it is
    not such a node: movements with constant parameters, Neg, Mul by a constant (or a value computed from
    constants alone: ``consts``), Add, Sub, Concat, a ScatterND with constant indices onto data that is a
    region value or zeros."""
    if node.op_type not in _LINEAR or node.domain not in ("", "ai.onnx") or any(w is None for w in node.inputs):
        return None
    ins: list[ir.Value] = list(node.inputs)  # type: ignore[arg-type]
    if node.op_type in ("Add", "Sub", "Concat"):
        data = ins
    elif node.op_type == "Mul":
        data = [w for w in ins if consts.of(w) is None]
        if len(data) != 1:
            return None
        return data
    elif node.op_type == "ScatterND":
        base = ins[0].const_value
        if attr(node, "reduction", "none") not in ("none", b"none") or ins[1].const_value is None:
            return None
        data = [ins[2]] if base is not None and not np.any(base.numpy()) else [ins[0], ins[2]]
    else:
        data = [ins[0]]
    if any(w.const_value is not None for w in data) or any(
            w.const_value is None for w in ins if w not in data and not (node.op_type == "ScatterND" and w is ins[0])):
        return None
    return data


def _dominator(y: ir.Value, order: dict[int, int], consts: _Constants) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes): the nearest value ``x`` that every path up from ``y`` through linear nodes
    (``_linear_inputs``) passes, above at least one node that sums or joins two of them, and the nodes
    between, in graph order (``order``: each node's position); None where there is none. Expanded from the
    latest value up, the frontier of values is one value at each such meeting point."""
    frontier: dict[int, ir.Value] = {id(y): y}
    nodes: dict[int, ir.Node] = {}
    joined = False
    while True:
        if len(frontier) == 1 and joined:
            return next(iter(frontier.values())), sorted(nodes.values(), key=lambda n: order[id(n)])
        latest = max(frontier.values(), key=lambda v: order.get(id(v.producer()), -1))
        p = latest.producer()
        data = _linear_inputs(p, consts) if p is not None and id(p) in order else None
        if not data or len(nodes) >= _MAX_MAP_NODES:
            return None
        nodes[id(p)] = p  # type: ignore[index]
        joined = joined or len(data) > 1
        del frontier[id(latest)]
        for w in data:
            frontier[id(w)] = w


def _run_node(node: ir.Node, arrays: list[np.ndarray | None]) -> list[np.ndarray]:
    """``node`` run on ``arrays`` in place of its inputs (None: the input's constant; an absent optional input
    stays absent) by the reference evaluator. Raises where it cannot."""
    return run_node(ir.serde.serialize_node(node), [  # type: ignore[union-attr]
        None if w is None else a if a is not None else w.const_value.numpy() for a, w in zip(arrays, node.inputs)])


def _linear_terms(x: ir.Value, y: ir.Value, nodes: list[ir.Node],
                  consts: _Constants) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """``y`` as terms (source, coefficient), arrays in y's shape: y = sum_t coefficient_t * x.flat[source_t - 1]
    (source 0: no element). Each node of the linear map from ``x`` runs on the terms' arrays (a movement moves
    both alike, a Mul scales the coefficients, a sum joins the terms, a ScatterND writes each term's arrays
    over zeros); exact, in float64. None where a node cannot run so."""
    shape = static_shape(x)
    if shape is None or int(np.prod(shape)) > 1 << 24:
        return None
    n = int(np.prod(shape))
    terms: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {
        id(x): [(np.arange(1, n + 1, dtype=np.float64).reshape(shape), np.ones(shape))]}
    readers: dict[int, int] = {}  # the region's nodes still to read each value: its arrays go after the last
    for node in nodes:
        for w in node.inputs:
            readers[id(w)] = readers.get(id(w), 0) + 1
    try:
        for node in nodes:
            ins = [terms.get(id(w)) if w is not None else None for w in node.inputs]
            out_shape = static_shape(node.outputs[0])
            op = node.op_type
            if op in ("Add", "Sub", "Mul"):
                if out_shape is None:
                    return None
                new = []
                for i, t in enumerate(ins):
                    if t is None:
                        continue
                    sign = -1.0 if op == "Sub" and i == 1 else 1.0
                    table = consts.of(node.inputs[1 - i]) if op == "Mul" else None
                    scale = table.astype(np.float64) if table is not None else sign
                    new += [(np.broadcast_to(s, out_shape), np.broadcast_to(c * scale, out_shape)) for s, c in t]
                terms[id(node.outputs[0])] = new
            elif op == "Neg":
                terms[id(node.outputs[0])] = [(s, -c) for s, c in ins[0]]  # type: ignore[union-attr]
            elif op == "Concat":
                k = max(len(t) for t in ins)  # type: ignore[arg-type]
                parts = [[t[j] if j < len(t) else (np.zeros_like(t[0][0]), np.zeros_like(t[0][0])) for j in range(k)]
                         for t in ins]  # type: ignore[union-attr]
                terms[id(node.outputs[0])] = [tuple(_run_node(node, [p[j][a] for p in parts])[0]  # type: ignore[misc]
                                                    for a in (0, 1)) for j in range(k)]
            elif op == "ScatterND":
                base, upd = ins[0], ins[2]
                zeros_upd = np.zeros(static_shape(node.inputs[2]) or (), np.float64)
                zeros_data = np.zeros(static_shape(node.inputs[0]) or (), np.float64)
                new = [tuple(_run_node(node, [a, None, zeros_upd])[0] for a in t) for t in base or []]
                new += [tuple(_run_node(node, [zeros_data, None, a])[0] for a in t)
                        for t in upd]  # type: ignore[union-attr]
                terms[id(node.outputs[0])] = new  # type: ignore[assignment]
            else:  # a movement: each of its outputs, of both arrays
                rest: list[np.ndarray | None] = [None] * (len(node.inputs) - 1)
                outs = [[_run_node(node, [a, *rest]) for a in pair] for pair in ins[0]]  # type: ignore[union-attr]
                for o, v in enumerate(node.outputs):
                    terms[id(v)] = [(s[o], c[o]) for s, c in outs]
            if sum(a.size for t in terms[id(node.outputs[0])] for a in t) > 1 << 27:
                return None
            for w in node.inputs:
                readers[id(w)] -= 1
                if not readers[id(w)] and w is not y:
                    terms.pop(id(w), None)
    except Exception:  # an op the reference evaluator takes otherwise: not a map we can read
        return None
    return terms.get(id(y))


def _rotation_of(terms: list[tuple[np.ndarray, np.ndarray]], d: int) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """[(cols, table)]: terms that read, for each row of the last axis (d wide, x viewed in y's shape), at most
    ``_MAX_TERMS`` columns of the same row of x, the same columns for every row: y = sum_k (x @ P_k) * A_k,
    P_k taking column cols_k[i] to i. The first term reads each column's own element where it reads it at all
    (a + b is b + a, exactly). None where the terms read across rows, or more columns."""
    src = np.stack([np.asarray(s, np.float64).reshape(-1) for s, _ in terms], axis=1).astype(np.int64)
    coef = np.stack([np.asarray(c, np.float64).reshape(-1) for _, c in terms], axis=1)
    src = np.where(coef != 0, src, 0)
    n = src.shape[0]
    if n % d:
        return None
    elem = np.arange(n)[:, None]
    live = src > 0
    if np.any(live & ((src - 1) // d != elem // d)):
        return None  # an element read from another row
    col = np.where(live, (src - 1) % d, -1)
    out_col = np.broadcast_to(elem % d, col.shape)
    used = np.zeros((d, d), bool)
    used[out_col[live], col[live]] = True
    if np.any(used.sum(axis=1) > _MAX_TERMS):
        return None
    cols = np.full((_MAX_TERMS, d), -1, np.int64)
    for i in range(d):
        read = list(np.nonzero(used[i])[0])
        if i in read:
            read.remove(i)
            read.insert(0, i)
        cols[:len(read), i] = read
    tables = np.zeros((_MAX_TERMS, n))
    for k in range(_MAX_TERMS):
        hit = live & (col == cols[k][out_col]) & (cols[k][out_col] >= 0)
        np.add.at(tables[k], np.nonzero(hit)[0], coef[hit])
    return [(np.where(cols[k] >= 0, cols[k], np.arange(d)), tables[k]) for k in range(_MAX_TERMS)
            if np.any(cols[k] >= 0)]


def _extends(reader: ir.Node, x: ir.Value, d: int, order: dict[int, int], consts: _Constants) -> bool:
    """Whether ``reader`` extends the map from ``x`` it reads, so that its output is the value to rewrite: a
    sum or a scaling of it (the same x above), or a view that widens rows narrower than any head (the pairs of
    an interleaved rotation, [.., D/2, 2], viewed [.., D]: one [D, D] rotation, as the other spellings'; a
    head's rows stay a head's, not the heads side by side)."""
    if reader.op_type == "Reshape":
        wide = static_shape(reader.outputs[0])
        return d < _MIN_HEAD and bool(wide) and d < wide[-1] <= _MAX_ROTATION  # type: ignore[index]
    if reader.op_type in _MOVES or _linear_inputs(reader, consts) is None:
        return False
    above = _dominator(reader.outputs[0], order, consts)
    return above is not None and above[0] is x


def _linear_rotations(graph: ir.Graph, edge: set[ir.Value]) -> int:
    """Each value ``y`` that is a linear map of the one value ``x`` every path up from it meets (movements, Neg,
    Mul by constant tables, Add, Sub, Concat, ScatterND with constant indices), that sums or joins two of its
    reads (a rotation), and reads, in each row of its last axis, at most two columns of the same row of x
    viewed in y's shape, the same columns in every row: ``sum_k (x @ P_k) * A_k`` (``_rotation_of``). The
    rotary in its other spellings: the halves' products joined (``cat(x1 c - x2 s, x1 s + x2 c)``) or
    interleaved (Wan's, after its ScatterNDs are an interleave). The value rewritten is the last of its map
    whose readers do not extend it (a movement may follow: the heads' Transpose)."""
    done = 0
    order = {id(n): i for i, n in enumerate(graph)}
    consts = _Constants()
    for node in list(graph):
        if node.graph is None or id(node) not in order or _linear_inputs(node, consts) is None:
            continue
        y = node.outputs[0]
        shape = static_shape(y)
        if shape is None or not shape or y.dtype != ir.DataType.FLOAT or shape[-1] > _MAX_ROTATION or y in edge:
            continue
        found = _dominator(y, order, consts)
        if found is None or found[0] in edge:
            continue
        x, nodes = found
        xs = static_shape(x)
        if xs is None or int(np.prod(xs)) != int(np.prod(shape)) or x.dtype != y.dtype:
            continue
        if any(_extends(u.node, x, shape[-1], order, consts) for u in y.uses()):
            continue
        terms = _linear_terms(x, y, nodes, consts)
        rotation = _rotation_of(terms, shape[-1]) if terms else None
        if rotation is None or (len(rotation) == 1 and np.array_equal(rotation[0][0], np.arange(shape[-1]))):
            continue
        d = shape[-1]
        b = Builder(graph, RULE)
        xv = _viewed(b, x, shape)  # the flat order is the rows'
        acc = None
        for cols, table in rotation:
            moved_x = xv
            if not np.array_equal(cols, np.arange(d)):
                rows = np.zeros((d, d), np.float32)
                rows[cols, np.arange(d)] = 1.0
                moved_x = b.op("MatMul", [xv, b.const(rows, "rotation")], dtype=y.dtype, shape=shape).outputs[0]
            coef = _smallest_broadcast(table.reshape(shape).astype(np.float32))
            term = b.op("Mul", [moved_x, b.const(coef, "rotary_table")], dtype=y.dtype, shape=shape).outputs[0]
            acc = term if acc is None else b.op("Add", [acc, term], dtype=y.dtype, shape=shape).outputs[0]
        graph.insert_before(node, b.nodes)
        reroute(graph, y, acc)  # type: ignore[arg-type]
        done += 1
    if done:
        remove_dead_nodes(graph)
        graph.sort()
    return done
