"""Joint attention (SD3's MMDiT) into the form SDMHA takes: two rewrites, run by canonicalize before the
fusions.

1. *One attention per query part* (``split_joint_queries``). MMDiT attends over the image and text tokens
   together: Q, K and V are each a Concat of the two streams' heads along the sequence, and the merged output is
   sliced back into the two streams. Each query row attends on its own, so

       Slice_i(merge(Attention(Concat(q_1, q_2), K, V))) == merge(Attention(q_i, K, V))

   exactly, for the same MACs; the Slices go (DD's SDSlice is keyed on shapes alone and has no offsets, so it
   cannot say which part it takes) and each part becomes an SDMHA of its own over the joint keys and values.

2. *Heads below the row ops* (``sink_head_transposes``). A head split ends in ``Transpose(0, 2, 1, 3)``
   ([B, S, H, D] -> [B, H, S, D]); SD3.5 normalizes each head's Q and K over D after it (RMSNorm: Pow,
   ReduceMean over the last axis, Add, Sqrt, Reciprocal, Mul) and concatenates the streams along S. Both
   commute with that Transpose, which moves below them: the norm then runs on [B, S, H, D] rows, and the
   Concat on the streams' [B, S_i, H * D] views along the sequence (axis 1), so the attention rule finds
   rank-3 sources behind plain head splits. Only Transposes that reach a norm (Pow / ReduceMean, or x * x)
   or a Concat start moving; an element-wise op passes one on only when it came from such a move (a UNet's
   head split scaled by a constant stays as it is).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from sdnpu.passes import movement
from sdnpu.passes.irutil import Builder, attr, const, remove_dead_nodes, replace, scalar, static_shape

RULE = "JointAttention"
HEADS = (0, 2, 1, 3)  # [B, S, H, D] <-> [B, H, S, D]; its own inverse
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Pow"})


def _is_heads_transpose(node: ir.Node | None) -> bool:
    return (node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx")
            and tuple(attr(node, "perm") or ()) == HEADS and len(static_shape(node.outputs[0]) or ()) == 4)


def _scalar_chain_up(v: ir.Value) -> tuple[ir.Value, list[ir.Node]]:
    """From ``v`` up through Mul/Div by a scalar constant: the value above them and the nodes, top first."""
    nodes: list[ir.Node] = []
    while True:
        p = v.producer()
        if p is None or p.op_type not in ("Mul", "Div") or p.domain not in ("", "ai.onnx") or len(p.inputs) != 2:
            break
        side = 1 if scalar(p.inputs[1]) is not None else 0 if p.op_type == "Mul" and scalar(p.inputs[0]) is not None \
            else None
        if side is None or len(v.uses()) != 1:
            break
        nodes.append(p)
        v = p.inputs[1 - side]  # type: ignore[assignment]
    nodes.reverse()
    return v, nodes


def _single_use(v: ir.Value, op_type: str) -> ir.Node | None:
    uses = list(v.uses())
    if v.is_graph_output() or len(uses) != 1 or uses[0].node.op_type != op_type:
        return None
    return uses[0].node


def _slice_range(node: ir.Node, length: int) -> tuple[int, int] | None:
    """(start, stop) of a Slice over axis 1 of a rank-3 value, steps of one; None for anything else."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 3:
        return None
    starts, ends = const(node.inputs[1]), const(node.inputs[2])
    axes = const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or ends is None or starts.size != 1 or (axes is not None and axes.size != 1):
        return None
    if axes is not None and int(axes.reshape(-1)[0]) % 3 != 1:
        return None
    if steps is not None and int(steps.reshape(-1)[0]) != 1:
        return None
    start, stop = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    start = max(0, start + length if start < 0 else start)
    stop = min(length, stop + length if stop < 0 else stop)
    return (start, stop) if start < stop else None


def _split_one(graph: ir.Graph, sm: ir.Node) -> bool:
    """``sm``: a Softmax; the attention around it split by query part when it has the joint form."""
    pv = _single_use(sm.outputs[0], "MatMul")
    if pv is None or pv.inputs[0] is not sm.outputs[0] or attr(sm, "axis", -1) not in (-1, 3):
        return False  # a softmax over the keys (the last axis) only: the rows are the queries
    scores, between = _scalar_chain_up(sm.inputs[0])  # type: ignore[arg-type]
    qk = scores.producer()
    if qk is None or qk.op_type != "MatMul" or len(scores.uses()) != 1:
        return False
    q, q_chain = _scalar_chain_up(qk.inputs[0])  # type: ignore[arg-type]
    cat = q.producer()
    q_shape = static_shape(q)
    if cat is None or cat.op_type != "Concat" or q_shape is None or len(q_shape) != 4 or len(q.uses()) != 1:
        return False
    if attr(cat, "axis", 0) % 4 != 2 or len(cat.inputs) < 2:
        return False
    parts = [static_shape(v) for v in cat.inputs]
    if any(p is None or len(p) != 4 for p in parts):
        return False
    t = _single_use(pv.outputs[0], "Transpose")
    r = _single_use(t.outputs[0], "Reshape") if t is not None and tuple(attr(t, "perm") or ()) == HEADS else None
    b_, h, s, d = q_shape
    if r is None or static_shape(r.outputs[0]) != (b_, s, h * (static_shape(pv.outputs[0]) or (0,) * 4)[3]):
        return False
    c = static_shape(r.outputs[0])[2]  # type: ignore[index]
    bounds, start = [], 0
    for p in parts:
        bounds.append((start, start + p[2]))  # type: ignore[index]
        start += p[2]  # type: ignore[index]
    users = [u.node for u in r.outputs[0].uses()]
    if r.outputs[0].is_graph_output() or not users:
        return False
    cut = [_slice_range(u, s) for u in users]
    if any(rng is None or rng not in bounds for rng in cut):
        return False
    b = Builder(graph, RULE)
    merged: dict[tuple[int, int], ir.Value] = {}
    # each part's attention gets its own copy of the key's and value's head chains (views of the joint K and
    # V, absorbed by its SDMHA), so that no attention shares an intermediate with another
    k_src, k_chain, _ = movement.trace_up(qk.inputs[1])  # type: ignore[arg-type]
    v_src, v_chain, _ = movement.trace_up(pv.inputs[1], allow_scale=False)  # type: ignore[arg-type]
    for part, (lo, hi) in zip(cat.inputs, bounds, strict=True):
        if (lo, hi) not in cut:
            continue
        n = hi - lo
        x: ir.Value = part  # type: ignore[assignment]
        for node in q_chain:
            x = _clone_scalar_op(b, node, x, (b_, h, n, d))
        keys, values = _clone_chain(b, k_chain, k_src), _clone_chain(b, v_chain, v_src)
        y = b.op("MatMul", [x, keys], dtype=qk.outputs[0].dtype,
                 shape=(b_, h, n, static_shape(qk.outputs[0])[3])).outputs[0]  # type: ignore[index]
        for node in between:
            y = _clone_scalar_op(b, node, y, static_shape(y))  # type: ignore[arg-type]
        y = b.op("Softmax", [y], {"axis": -1}, dtype=y.dtype, shape=static_shape(y)).outputs[0]
        o_shape = (b_, h, n, static_shape(pv.outputs[0])[3])  # type: ignore[index]
        y = b.op("MatMul", [y, values], dtype=pv.outputs[0].dtype, shape=o_shape).outputs[0]
        y = b.op("Transpose", [y], {"perm": list(HEADS)}, dtype=y.dtype, shape=(b_, n, h, o_shape[3])).outputs[0]
        shape = b.const(np.asarray([b_, n, c], np.int64), "shape")
        merged[(lo, hi)] = b.op("Reshape", [y, shape], dtype=y.dtype, shape=(b_, n, c)).outputs[0]
    graph.insert_before(users[0], b.nodes)
    for u, rng in zip(users, cut, strict=True):
        out = u.outputs[0]
        if out.is_graph_output():
            replace(graph, u, [u], [], [out], [merged[rng]])  # type: ignore[index]
        else:
            out.replace_all_uses_with(merged[rng])  # type: ignore[index]
    return True


def _clone_chain(b: Builder, chain: list[ir.Node], x: ir.Value) -> ir.Value:
    """A copy of a chain of movement and scalar-scale nodes (``movement.trace_up``'s) applied to ``x``."""
    for node in chain:
        if node.op_type in ("Mul", "Div"):
            x = _clone_scalar_op(b, node, x, static_shape(node.outputs[0]))  # type: ignore[arg-type]
        else:
            attrs = {k: a.value for k, a in node.attributes.items()}
            x = b.op(node.op_type, [x, *node.inputs[1:]], attrs, dtype=x.dtype,
                     shape=static_shape(node.outputs[0])).outputs[0]
    return x


def _clone_scalar_op(b: Builder, node: ir.Node, x: ir.Value, shape: tuple[int, ...]) -> ir.Value:
    side = 1 if scalar(node.inputs[1]) is not None else 0
    inputs = [x, node.inputs[1]] if side == 1 else [node.inputs[0], x]
    return b.op(node.op_type, inputs, dtype=x.dtype, shape=shape).outputs[0]


def split_joint_queries(graph: ir.Graph) -> int:
    done = 0
    for node in list(graph):
        if node.graph is not None and node.op_type == "Softmax" and node.domain in ("", "ai.onnx"):
            done += _split_one(graph, node)
    if done:
        remove_dead_nodes(graph)
        graph.sort()
    return done


# --- heads below the row ops ------------------------------------------------------------------------------

def _row_constant(v: ir.Value | None) -> bool:
    """A constant that broadcasts along the last axis only (a scalar, or [.., 1, D]): the same on [B, H, S, D]
    and [B, S, H, D]."""
    a = const(v)
    return a is not None and a.ndim <= 4 and all(n == 1 for n in a.shape[:-1])


def _sink_into(graph: ir.Graph, node: ir.Node, moved: set[int]) -> bool:
    op = node.op_type
    if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return False
    out_shape = static_shape(node.outputs[0])
    if out_shape is None or len(out_shape) != 4:
        return False
    data = node.inputs[:1] if op in ("ReduceMean", "Pow") else node.inputs
    heads = [v.producer() for v in data if v is not None and _is_heads_transpose(v.producer())]
    if op == "Concat":
        if len(heads) != len(data):
            return False
    elif op in ("Pow", "ReduceMean"):
        if len(heads) != 1 or (op == "Pow" and scalar(node.inputs[1]) is None):
            return False
        if op == "ReduceMean" and (attr(node, "keepdims", 1) != 1 or len(node.inputs) < 2
                                   or const(node.inputs[1]) is None):
            return False
    elif op in _ELEMENTWISE:  # on values a move brought here, or on head-split values alone (x * x)
        if not heads or (len(heads) < 2 and not any(id(t) in moved for t in heads)):
            return False
        if any(v is not None and not _is_heads_transpose(v.producer()) and not _row_constant(v) for v in data):
            return False
    else:
        return False
    b = Builder(graph, RULE)
    inputs: list[ir.Value | None] = [v.producer().inputs[0] if v is not None and _is_heads_transpose(v.producer())  # type: ignore[union-attr]
                                     else v for v in data]
    attrs = {k: a.value for k, a in node.attributes.items()}
    new_shape = tuple(out_shape[i] for i in HEADS)
    if op == "ReduceMean":
        axes = const(node.inputs[1])
        inputs.append(b.const(np.asarray([HEADS[int(a) % 4] for a in axes.reshape(-1)], np.int64), "axes"))  # type: ignore[union-attr]
    elif op == "Pow":
        inputs.append(node.inputs[1])
    if op == "Concat" and HEADS[attrs.get("axis", 0) % 4] == 1:
        # the streams along the sequence, concatenated as the [B, S_i, H * D] views the attention reads
        views = [b.op("Reshape", [v, b.const(np.asarray([s[0], s[1], s[2] * s[3]], np.int64), "shape")],
                      dtype=v.dtype, shape=(s[0], s[1], s[2] * s[3])).outputs[0]  # type: ignore[union-attr]
                 for v, s in ((v, static_shape(v)) for v in inputs)]
        flat = (new_shape[0], new_shape[1], new_shape[2] * new_shape[3])
        cat = b.op("Concat", views, {"axis": 1}, dtype=node.outputs[0].dtype, shape=flat).outputs[0]
        y = b.op("Reshape", [cat, b.const(np.asarray(new_shape, np.int64), "shape")], dtype=cat.dtype,
                 shape=new_shape).outputs[0]
    else:
        if op == "Concat":
            attrs["axis"] = HEADS[attrs.get("axis", 0) % 4]
        y = b.op(op, inputs, attrs, dtype=node.outputs[0].dtype, shape=new_shape).outputs[0]
    t = b.op("Transpose", [y], {"perm": list(HEADS)}, dtype=y.dtype, shape=out_shape)
    moved.add(id(t))
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [t.outputs[0]])
    return True


def sink_head_transposes(graph: ir.Graph) -> int:
    moved: set[int] = set()
    done = 0
    for _ in range(64):  # one op further each round; an RMSNorm is seven
        step = 0
        for t in list(graph):
            if t.graph is None or not _is_heads_transpose(t):
                continue
            for use in list(t.outputs[0].uses()):
                node = use.node
                if node.graph is not None:
                    step += _sink_into(graph, node, moved)
        remove_dead_nodes(graph)
        done += step
        if not step:
            break
    return done


def joint_attention(graph: ir.Graph) -> Counter[str]:
    counts: Counter[str] = Counter()
    counts["joint attention split by query part"] = split_joint_queries(graph)
    counts["head transposes moved below row ops"] = sink_head_transposes(graph)
    return counts
