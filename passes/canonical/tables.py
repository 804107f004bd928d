"""Tables: the CPU work on a graph's inputs written in as few nodes as it takes.

Some values are computed from the graph's inputs alone, with no layer between (no weight-bearing op, no
norm): the rotary embeddings' cos and sin tables from Flux's position ids, a timestep's scaling. They run on
the CPU (Sin and Cos have no dispatch op), at the graph's edge, and exporters write them op by op: per
position axis, a Gather of the ids' column, a Reshape, a Cast to float64, a Mul by the frequencies, Cos and
Sin, repeat_interleave as Reshape, Expand and Reshape, a Cast back, and a Concat of the axes. Three rewrites
make them the few ops they are, each exact:

- *unary ops below a Concat*: ``Concat(u(move(a)), u(move(b))) == u(Concat(move(a), move(b)))`` for the same
  element-wise unary ops ``u`` (Cos, Sin, Cast, ...) on every part, and data movement or broadcasts ``move``
  (Reshape, Transpose, Expand, a Slice or Gather with constant indices), which commute with them: the
  trigonometry then runs once on the whole table;
- *one value computed twice* (the same op on the same inputs) is computed once;
- *a per-row gather and scale*: a value reached from one input by data movement, Casts and products with
  constants, where each element is one element of the input's same row times a constant of its column, is
  ``Gather(input, columns, axis=-1) * scale`` (found by running that subgraph on probe inputs: ones give
  each element's constant, 1, 2, 3, ... which element it reads; a random input checks the result). A table
  that repeats along an axis its readers broadcast anyway (a key mask repeated over the heads) is written
  once and expanded; the canonical ``broadcast_expands`` after the tables drops the Expand.

Only values in the edge region change: nothing that a dispatch op computes, nothing a rule matches.

Each rewrite is a step of its own (``sink_unary_ops``, ``compute_repeats_once``, ``collapse_table_chains``, and
``demote_float64_tables`` for the float64 islands), declared in order with their fixpoint loop in
``sdnpu.passes.pipeline`` (the ``tables`` group of ``CANONICAL``). Each reads the edge region afresh
(``edge_values``): the region is a function of the graph, and a rewrite only puts edge values in the place of
edge values, so reading it again finds what one reading kept up to date would.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.nodeeval import run_node
from sdnpu.passes.canonical.noops import BROADCASTING
from sdnpu.passes.irutil import Builder, attr, reroute, static_shape
from sdnpu.passes.manager import PassResult
from sdnpu.passes.provenance import step

RULE = "Tables"
UNARY = frozenset({"Cos", "Sin", "Cast", "Neg", "Exp", "Sqrt", "Reciprocal", "Abs", "Tanh", "Sigmoid", "Erf"})
MOVES = frozenset({"Reshape", "Transpose", "Expand", "Slice", "Gather", "Unsqueeze", "Squeeze", "Flatten"})
LINEAR = MOVES | {"Concat", "Cast", "Mul", "Div", "Neg", "Split"}
WEIGHTED = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "LayerNormalization", "GroupNormalization",
                      "InstanceNormalization", "Softmax", "Einsum", "RMSNormalization"})
_MAX_PROBE = 1 << 22  # elements of a table the collapse runs on probes


def _onnx(node: ir.Node | None) -> bool:
    return node is not None and node.domain in ("", "ai.onnx")


def edge_values(graph: ir.Graph) -> set[ir.Value]:
    """The values computed from the graph's inputs and constants alone, through no weight-bearing op or norm
    (graph order is topological, so one pass finds them); constants themselves are not in the set."""
    edge: set[ir.Value] = {v for v in graph.inputs if v.const_value is None}
    for node in graph:
        if not _onnx(node) or node.op_type in WEIGHTED or node.op_type in ("If", "Loop", "Scan"):
            continue
        ins = [v for v in node.inputs if v is not None and v.const_value is None]
        if ins and all(v in edge for v in ins):
            edge.update(node.outputs)
    return edge


def _params_constant(node: ir.Node) -> bool:
    return all(v is None or v.const_value is not None for v in node.inputs[1:])


def _unary_chain(v: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes): ``v`` made from ``x`` by element-wise unary ops and data movement (each node read by the next
    alone), the nodes from ``x`` down; None where no unary op is among them."""
    nodes: list[ir.Node] = []
    while True:
        p = v.producer()
        if not _onnx(p) or len(p.outputs) != 1 or (nodes and (len(v.uses()) != 1 or v.is_graph_output())):  # type: ignore[union-attr]
            break
        if p.op_type in UNARY and len(p.inputs) == 1 or p.op_type in MOVES and _params_constant(p):  # type: ignore[union-attr]
            nodes.append(p)  # type: ignore[arg-type]
            v = p.inputs[0]  # type: ignore[union-attr,assignment]
            if v is None:
                return None
            continue
        break
    nodes.reverse()
    if not any(n.op_type in UNARY for n in nodes):
        return None
    return v, nodes


def _sink_unary(graph: ir.Graph, edge: set[ir.Value]) -> int:
    """Concat(u(move(a)), u(move(b)), ...) -> u(Concat(move(a), move(b), ...)) for the same element-wise unary
    ops ``u`` (in the same order) on every part: the trigonometry and casts of a table run once on the whole."""
    done = 0
    for node in list(graph):
        if node.graph is None or not _onnx(node) or node.op_type != "Concat" or len(node.inputs) < 2 \
                or node.outputs[0] not in edge:
            continue
        rank = len(static_shape(node.outputs[0]) or ())
        if not rank or int(attr(node, "axis", 0)) % rank != rank - 1:
            continue  # along the rows: the streams' parts (Flux.2's text and image tables), which a cut reads apart
        chains = [_unary_chain(v) if v is not None else None for v in node.inputs]
        if any(c is None for c in chains):
            continue

        def signature(nodes: list[ir.Node]) -> list[tuple[str, str]]:
            return [(n.op_type, repr(sorted((k, str(a.value)) for k, a in n.attributes.items())))
                    for n in nodes if n.op_type in UNARY]

        sig = signature(chains[0][1])  # type: ignore[index]
        if any(signature(c[1]) != sig for c in chains):  # type: ignore[index]
            continue
        b = Builder(graph, RULE)
        parts = []
        for x, nodes in chains:  # type: ignore[misc]
            for n in nodes:
                if n.op_type in MOVES:
                    out = static_shape(n.outputs[0])
                    x = b.op(n.op_type, [x, *n.inputs[1:]], {k: a.value for k, a in n.attributes.items()},
                             dtype=x.dtype, shape=out).outputs[0]
            parts.append(x)
        shape = static_shape(node.outputs[0])
        y = b.op("Concat", parts, {"axis": attr(node, "axis", 0)}, dtype=parts[0].dtype, shape=shape).outputs[0]
        for n in chains[0][1]:  # type: ignore[index]
            if n.op_type in UNARY:
                dtype = n.outputs[0].dtype
                y = b.op(n.op_type, [y], {k: a.value for k, a in n.attributes.items()}, dtype=dtype, shape=shape).outputs[0]
        graph.insert_before(node, b.nodes)
        edge.update(n.outputs[0] for n in b.nodes)
        reroute(graph, node.outputs[0], y)
        done += 1
    return done


def _identity(v: ir.Value | None) -> object:
    """What makes two inputs the same: the value itself, or for a small constant its contents (exporters write
    each Reshape's shape as a constant of its own)."""
    if v is None:
        return None
    if v.const_value is not None and v.const_value.size <= 64:
        a = v.const_value.numpy()
        return ("const", a.dtype.str, a.shape, a.tobytes())
    return id(v)


def _once(graph: ir.Graph, edge: set[ir.Value]) -> int:
    """The same op on the same inputs in the edge region, computed once."""
    seen: dict[tuple, ir.Node] = {}
    done = 0
    for node in list(graph):
        if node.graph is None or not _onnx(node) or not all(o in edge for o in node.outputs) or len(node.outputs) != 1:
            continue
        key = (node.op_type, tuple(_identity(v) for v in node.inputs),
               tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items())))
        other = seen.get(key)
        if other is None:
            seen[key] = node
            continue
        out = node.outputs[0]
        if out.is_graph_output():
            continue
        out.replace_all_uses_with(other.outputs[0])
        done += 1
    return done


def _linear_source(v: ir.Value, edge: set[ir.Value]) -> tuple[ir.Value, list[ir.Node]] | None:
    """(u, nodes): ``v`` computed from the one value ``u`` by movement, Casts between floats and products with
    constants. ``u`` is the farthest value up through which every path goes (Flux's position ids: the
    Concat of the text and image ids, not the two inputs)."""

    def walk(stop: ir.Value | None) -> tuple[list[ir.Value], dict[int, ir.Node], list[ir.Value]]:
        nodes: dict[int, ir.Node] = {}
        sources: dict[int, ir.Value] = {}
        seen: list[ir.Value] = []
        todo = [v]
        while todo:
            w = todo.pop(0)
            seen.append(w)
            p = w.producer()
            data = [] if w is stop or not _onnx(p) or p.op_type not in LINEAR else (  # type: ignore[union-attr]
                [x for x in p.inputs] if p.op_type == "Concat" else  # type: ignore[union-attr]
                [x for x in p.inputs if x is not None and x.const_value is None] if p.op_type in ("Mul", "Div") else
                [p.inputs[0]])  # type: ignore[union-attr]
            ok = bool(data) and all(x is not None and x in edge for x in data) and (
                p.op_type in ("Mul", "Concat") or (p.op_type == "Div" and p.inputs[1].const_value is not None)  # type: ignore[union-attr]
                or _params_constant(p))  # type: ignore[arg-type]
            if ok and p.op_type == "Mul" and len(data) != 1:  # type: ignore[union-attr]
                ok = False  # a product of two tables is not linear
            if ok and p.op_type == "Cast" and attr(p, "to") not in (1, 10, 11, 16):  # type: ignore[arg-type]
                ok = False
            if not ok:
                sources[id(w)] = w
                continue
            if id(p) not in nodes:
                nodes[id(p)] = p  # type: ignore[index,assignment]
                todo += data  # type: ignore[arg-type]
        return list(sources.values()), nodes, seen

    sources, nodes, seen = walk(None)
    for stop in [None, *reversed(seen[1:])]:
        if stop is not None:
            sources, nodes, _ = walk(stop)
        if len(sources) == 1 and len(nodes) >= 2:
            return sources[0], list(nodes.values())
    return None


def _run(u: ir.Value, v: ir.Value, nodes: list[ir.Node], probe: np.ndarray) -> np.ndarray | None:
    """``v`` computed by ``nodes`` (in the graph's order) from ``probe`` in place of ``u``, node by node; None
    where a node reads a value that is neither u, a constant nor another's output, or the evaluator cannot run
    it (leave the subgraph as it is)."""
    order = {id(n): i for i, n in enumerate(u.graph or [])} if u.graph is not None else {}
    values = {id(u): probe.astype(np.float32 if u.dtype == ir.DataType.FLOAT else np.float64)}  # exact: n <= 2^24
    try:
        for n in sorted(nodes, key=lambda n: order.get(id(n), 0)):
            ins = [None if w is None else values[id(w)] if id(w) in values
                   else w.const_value.numpy() for w in n.inputs]  # type: ignore[union-attr]
            values.update((id(o), a) for o, a in zip(n.outputs, run_node(ir.serde.serialize_node(n), ins), strict=True))
        return np.asarray(values[id(v)], np.float64)
    except Exception:  # noqa: BLE001 - an op the evaluator takes otherwise, a value from elsewhere: left as it is
        return None


def _gather_scale(graph: ir.Graph, edge: set[ir.Value]) -> int:
    done = 0
    for node in list(graph):
        if node.graph is None or not _onnx(node) or node.op_type not in LINEAR or len(node.outputs) != 1:
            continue
        v = node.outputs[0]
        if v not in edge or v.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
            continue
        readers = [u.node for u in v.uses()]
        if readers and all(_onnx(r) and r.op_type in LINEAR and r.outputs[0] in edge for r in readers) \
                and not v.is_graph_output():
            continue  # not the end of its linear chain
        found = _linear_source(v, edge)
        if found is None:
            continue
        u, nodes = found
        if all(n.op_type in MOVES for n in nodes):
            continue  # data movement alone: the layout pass's (it cancels and merges what a gather would not)
        u_shape, v_shape = static_shape(u), static_shape(v)
        if u_shape is None or v_shape is None or not u_shape or not v_shape or u.dtype not in (
                ir.DataType.FLOAT, ir.DataType.DOUBLE) or int(np.prod(v_shape)) > _MAX_PROBE or int(np.prod(u_shape)) > 1 << 24:
            continue
        n = int(np.prod(u_shape))
        up = np.arange(1, n + 1, dtype=np.float64).reshape(u_shape)
        v1, scale = _run(u, v, nodes, up), _run(u, v, nodes, np.ones(u_shape))  # scale: each element's constant
        if v1 is None or scale is None or v1.shape != tuple(v_shape):
            continue
        with np.errstate(all="ignore"):
            src = np.where(scale != 0, v1 / scale, 1.0)
        rounded = np.round(src)  # the range is checked on the indices: 13824 * f / f may be 13824.000000000002
        # a float32 chain rounds i * f to float32 (TorchScript's rotary: 216 * f / f = 216.00001): a few of its
        # units of i's size; the random input below checks the columns whatever the rounding
        tol = 1e-6 + (np.abs(rounded) * 2.0 ** -20 if u.dtype == ir.DataType.FLOAT else 0.0)
        if np.any(np.abs(src - rounded) > tol) or np.any(rounded < 1) or np.any(rounded > n):
            continue
        src = rounded.astype(np.int64) - 1
        full_shape = tuple(v_shape)
        repeats = _repeat_axes(v, src, scale)
        if repeats:  # the table repeated along axes its readers broadcast: the table once, then an Expand
            keep = tuple(slice(0, 1) if a in repeats else slice(None) for a in range(len(v_shape)))
            src, scale, v1 = src[keep], scale[keep], v1[keep]
            v_shape = list(src.shape)
        cu = u_shape[-1]
        rows_u = n // cu
        flat_src, flat_scale = src.reshape(-1), scale.reshape(-1)
        cv = int(np.prod(v_shape)) // rows_u if int(np.prod(v_shape)) % rows_u == 0 else 0
        if not cv:
            continue
        src2, scale2 = flat_src.reshape(rows_u, cv), flat_scale.reshape(rows_u, cv)
        row = np.arange(rows_u)[:, None]
        cols = src2 - row * cu
        if np.any(src2 // cu != row) or not (np.all(cols == cols[:1]) and np.all(scale2 == scale2[:1])):
            continue
        check = _run(u, v, nodes, np.random.default_rng(0).standard_normal(u_shape))
        if check is not None and repeats:
            check = check[keep]
        u_rand = np.random.default_rng(0).standard_normal(u_shape).reshape(rows_u, cu)
        want = u_rand[:, cols[0]] * scale2[0]
        if check is None or not np.allclose(check.reshape(rows_u, cv), want, rtol=1e-6, atol=0):
            continue
        in_order = cv == cu and np.array_equal(cols[0], np.arange(cu))  # every column, in order: no Gather
        if cu == 1:
            spread = np.broadcast_shapes(tuple(u_shape), (1,) * (len(v_shape) - 1) + (cv,)) == tuple(v_shape)
            need = 1 + (v.dtype != u.dtype) + (not spread)
        else:
            need = (not in_order) + (v.dtype != u.dtype) + bool(np.any(scale2[0] != 1)) + (
                tuple(v_shape) != (*u_shape[:-1], cv))
        if len(nodes) <= need and not repeats:
            continue  # already as short
        b = Builder(graph, RULE)
        if cu == 1 or in_order:  # one column: the table is that value spread, times the constants (a broadcast
            y = u  # Mul); every column in order: that value
        else:
            y = b.op("Gather", [u, b.const(cols[0].astype(np.int64), "table_columns")], {"axis": len(u_shape) - 1},
                     dtype=u.dtype, shape=[*u_shape[:-1], cv]).outputs[0]
        if v.dtype != u.dtype:
            y = b.op("Cast", [y], {"to": int(v.dtype)}, dtype=v.dtype, shape=static_shape(y)).outputs[0]  # type: ignore[arg-type]
        np_dtype = np.float64 if v.dtype == ir.DataType.DOUBLE else np.float32
        scale_shape = [1] * (len(v_shape) - 1) + [cv]
        if cu == 1:  # y [.., 1] * scale shaped as v: the broadcast makes the columns
            if tuple(np.broadcast_shapes(tuple(static_shape(y) or ()), tuple(scale_shape))) != tuple(v_shape):
                y = b.op("Reshape", [y, b.const(np.asarray([*v_shape[:-1], 1], np.int64), "shape")], dtype=y.dtype,
                         shape=[*v_shape[:-1], 1]).outputs[0]
            y = b.op("Mul", [y, b.const(scale2[0].astype(np_dtype).reshape(scale_shape),
                                        "table_scale")], dtype=v.dtype, shape=list(v_shape)).outputs[0]
        elif np.any(scale2[0] != 1):
            y = b.op("Mul", [y, b.const(scale2[0].astype(np_dtype), "table_scale")], dtype=v.dtype,
                     shape=[*u_shape[:-1], cv]).outputs[0]
        if tuple(static_shape(y) or ()) != tuple(v_shape):
            y = b.op("Reshape", [y, b.const(np.asarray(v_shape, np.int64), "shape")], dtype=v.dtype,
                     shape=list(v_shape)).outputs[0]
        if repeats:
            y = b.op("Expand", [y, b.const(np.asarray(full_shape, np.int64), "shape")], dtype=v.dtype,
                     shape=list(full_shape)).outputs[0]
        graph.insert_before(node, b.nodes)
        reroute(graph, v, y)
        edge.update(n.outputs[0] for n in b.nodes)
        done += 1
    return done


def _repeat_axes(v: ir.Value, src: np.ndarray, scale: np.ndarray) -> set[int]:
    """The axes (of size > 1) along which a table reads the same element times the same constant, where every
    reader of the table broadcasts its inputs (``noops.BROADCASTING``): a mask repeated over the heads
    (diffusers' ``prepare_attention_mask``: repeat_interleave by the head count, then a [B, H, 1, N] view; as
    TorchScript writes it), before the Add of the scores. Those axes are an Expand the canonical
    ``broadcast_expands`` drops, so the reader sees the row it is: one key row per batch. Empty where a reader
    does not broadcast (the repeat stays a part of the table)."""
    if v.is_graph_output() or not all(_onnx(u.node) and u.node.op_type in BROADCASTING for u in v.uses()):
        return set()
    return {a for a in range(src.ndim) if src.shape[a] > 1 and np.all(src == src.take([0], axis=a))
            and np.all(scale == scale.take([0], axis=a))}


_DOUBLE_OK = UNARY | MOVES | {"Concat", "Mul", "Div", "Add", "Sub", "Split"}


def _single_precision(graph: ir.Graph, edge: set[ir.Value]) -> int:
    """A table computed in float64 between a Cast up and Casts back to float32 (diffusers' rotary tables:
    ``get_1d_rotary_pos_embed`` with float64 frequencies) computed in float32. The dispatch ops read it
    rounded to bf16 (8 bits): float32's error on the arguments (half an ulp: 3.8e-6 rad at 64, Flux's largest
    position at 1024 px) is far below a bf16 step of the cos and sin it yields. The float64 constants become
    float32 (offline)."""
    done = 0
    for cast in list(graph):
        if cast.graph is None or cast.op_type != "Cast" or not _onnx(cast) or attr(cast, "to") != int(ir.DataType.DOUBLE):
            continue
        x = cast.inputs[0]
        if x is None or x.dtype != ir.DataType.FLOAT or cast.outputs[0] not in edge:
            continue
        island: list[ir.Node] = []
        exits: list[ir.Node] = []
        todo, seen, ok = [cast.outputs[0]], set(), True
        while todo and ok:
            v = todo.pop()
            if id(v) in seen:
                continue
            seen.add(id(v))
            if v.is_graph_output():
                ok = False
                break
            for use in v.uses():
                n = use.node
                if n.op_type == "Cast" and attr(n, "to") == int(ir.DataType.FLOAT) and _onnx(n):
                    exits.append(n)
                elif _onnx(n) and n.op_type in _DOUBLE_OK and all(
                        w is None or w.const_value is not None or w.dtype != ir.DataType.DOUBLE or id(w) in seen
                        or w.producer() in island or w is v for w in n.inputs):
                    if n not in island:
                        island.append(n)
                        todo += [o for o in n.outputs if o.dtype == ir.DataType.DOUBLE]
                else:
                    ok = False
                    break
        if not ok or not exits or any(o.dtype != ir.DataType.DOUBLE for n in island for o in n.outputs
                                      if n.op_type != "Cast"):
            continue
        b = Builder(graph, RULE)
        for n in island:
            for i, w in enumerate(n.inputs):
                if w is not None and w.const_value is not None and w.dtype == ir.DataType.DOUBLE:
                    n.replace_input_with(i, b.derived(w, [step("astype", dtype="float32")], list(w.shape or []),
                                                      f"{w.name}_f32", dtype=ir.DataType.FLOAT))
            for o in n.outputs:
                o.dtype = ir.DataType.FLOAT
        cast.outputs[0].replace_all_uses_with(x)
        for e in exits:
            reroute(graph, e.outputs[0], e.inputs[0])  # type: ignore[arg-type]
        done += 1
    return done


def sink_unary_ops(model: ir.Model) -> PassResult:
    """Concat(u(move(a)), u(move(b)), ...) -> u(Concat(move(a), move(b), ...)) in the edge region
    (``_sink_unary``)."""
    done = _sink_unary(model.graph, edge_values(model.graph))
    return PassResult(modified=bool(done), counts={"unary ops moved below data movement": done})


def compute_repeats_once(model: ir.Model) -> PassResult:
    """The same op on the same inputs in the edge region computed once (``_once``)."""
    done = _once(model.graph, edge_values(model.graph))
    return PassResult(modified=bool(done), counts={"repeated table ops computed once": done})


def collapse_table_chains(model: ir.Model) -> PassResult:
    """A per-row gather and scale written as one (``_gather_scale``)."""
    done = _gather_scale(model.graph, edge_values(model.graph))
    return PassResult(modified=bool(done), counts={"table chains -> gather and scale": done})


def demote_float64_tables(model: ir.Model) -> PassResult:
    """A float64 island of the edge region computed in float32 (``_single_precision``)."""
    done = _single_precision(model.graph, edge_values(model.graph))
    return PassResult(modified=bool(done), counts={"float64 tables computed in float32": done})
