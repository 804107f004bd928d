"""The attention heads' split Transpose sunk past what is computed per head, so that the attention reads its
q, k and v as the [B, S, H, D] views of the linear layers' outputs.

Decoder-only text encoders (transformers' Llama, Qwen2, Qwen3) split the heads first and compute on the split:

    x [B, S, C] -> Reshape [B, S, H, D] -> Transpose(0, 2, 1, 3) [B, H, S, D]
      -> q * cos + rotate_half(q) * sin           (the rotary: the canonical rotary step made rotate_half a
                                                   MatMul by a signed permutation; cos / sin constant tables)
      -> repeat_kv: Reshape [B, Hkv, 1, S, D] -> Expand [B, Hkv, r, S, D] -> Reshape [B, H, S, D]
                                                  (grouped-query attention's key and value heads, k and v only)
      -> the attention's products

The Transpose is a real data movement (the registry has none), and the attention rule reads q, k and v through
movement only, so it would stop at the rotary's Add. Everything between the Transpose and the attention is
per-head arithmetic that commutes with the Transpose:

    T(x) (*, +, -, /) c      ==  T(x (*, +, -, /) T⁻¹(c))     c a constant (broadcast to rank 4 offline)
    T(a) (*, +, -, /) T(b)   ==  T(a (*, +, -, /) b)
    T(x) · W                 ==  T(x · W)                     W a constant [D, E]: T keeps the last axis
    repeat(T(x), axis h, r)  ==  T(repeat(x, axis T[h], r))   the head repeat (Reshape, Expand, Reshape)

so the Transpose moves below it, one reader at a time, until it meets what reads two activations (the
attention's products), where the attention rule's head split absorbs it. It moves only where *every* reader of
the Transpose takes it (else a copy would stay behind for the others), and only the head split's perm
(0, 2, 1, 3) on a rank-4 value: the heads' axis and the tokens' trade places, the last axis stays. The same
numbers, bit for bit: every element is computed by the same op from the same operands.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes.canonical.driver import ONNX_DOMAINS, RULE
from sdnpu.passes.irutil import Builder, const, remove_dead_nodes, reroute, static_shape
from sdnpu.passes.manager import PassResult
from sdnpu.passes.provenance import step

HEAD_PERM = (0, 2, 1, 3)  # [B, S, H, D] <-> [B, H, S, D]; its own inverse
_BINARY = frozenset({"Add", "Sub", "Mul", "Div"})
_ROUNDS = 64  # a Transpose moves one op down per round; the rotary's chain is 3 deep, the repeat 1 more


def _onnx(node: ir.Node | None, *ops: str) -> bool:
    return node is not None and node.domain in ONNX_DOMAINS and node.op_type in ops


def _head_transpose(v: ir.Value | None) -> ir.Node | None:
    """The head split's Transpose writing ``v`` (a rank-4, non-constant value), else None."""
    p = v.producer() if v is not None else None
    if not _onnx(p, "Transpose") or p is None or p.inputs[0] is None or static_shape(p.inputs[0]) is None:
        return None
    perm = p.attributes.get("perm")
    if perm is None or tuple(int(i) for i in perm.value) != HEAD_PERM or p.inputs[0].const_value is not None:
        return None
    return p


def _repeat_chain(v: ir.Value) -> tuple[list[ir.Node], int, int] | None:
    """(nodes, axis, r) where ``v``'s one reader starts grouped-query attention's head repeat, rank 4 to rank 4:
    Reshape inserting an axis of 1 after ``axis``, Expand of it to r, Reshape merging it into ``axis`` (each
    slice along ``axis`` repeated r times in place: ``repeat_kv``, torch's repeat_interleave), read from the
    three shapes; else None."""
    uses = list(v.uses())
    shape = static_shape(v)
    if len(uses) != 1 or shape is None or len(shape) != 4:
        return None
    nodes: list[ir.Node] = []
    cur = v
    for want in ("Reshape", "Expand", "Reshape"):
        readers = list(cur.uses())
        if cur.is_graph_output() or len(readers) != 1 or not _onnx(readers[0].node, want) \
                or readers[0].idx != 0 or const(readers[0].node.inputs[1]) is None:
            return None
        nodes.append(readers[0].node)
        cur = readers[0].node.outputs[0]
    mid, out = static_shape(nodes[0].outputs[0]), static_shape(cur)
    if mid is None or out is None or len(mid) != 5 or len(out) != 4:
        return None
    target = tuple(int(d) for d in const(nodes[1].inputs[1]).reshape(-1))  # type: ignore[union-attr]
    try:
        wide = tuple(np.broadcast_shapes(tuple(mid), target))
    except ValueError:
        return None
    for axis in range(4):  # the Expand widens the axis of 1 after ``axis`` alone, to r; the Reshape merges it
        # into ``axis``: each slice along it r times in place (row-major: slice i's copies are rows i*r .. i*r+r-1)
        if mid != (*shape[:axis + 1], 1, *shape[axis + 1:]) or not shape[axis] or out[axis] % shape[axis]:
            continue
        r = out[axis] // shape[axis]
        if r >= 2 and wide == (*shape[:axis + 1], r, *shape[axis + 1:]) \
                and tuple(out) == (*shape[:axis], shape[axis] * r, *shape[axis + 1:]):
            return nodes, axis, r
    return None


def _sinkable(t: ir.Node) -> list[tuple[str, ir.Node]] | None:
    """How each reader of the head Transpose ``t`` takes it below itself, or None where one does not."""
    y = t.outputs[0]
    if y.is_graph_output() or not y.uses():
        return None
    ways: list[tuple[str, ir.Node]] = []
    for use in y.uses():
        node = use.node
        if any(w[1] is node for w in ways):
            continue
        if _onnx(node, *_BINARY) and len(node.inputs) == 2 and static_shape(node.outputs[0]) is not None:
            other = node.inputs[1 - use.idx]
            c = const(other)
            if c is not None and c.ndim <= 4:
                moved = [1] * (4 - c.ndim) + list(c.shape)
                try:  # T(x) op c == T(x op T(c)): the shapes broadcast alike, the axes traded
                    fits = np.broadcast_shapes(tuple(static_shape(t.inputs[0])),  # type: ignore[arg-type]
                                               tuple(moved[i] for i in HEAD_PERM)) == \
                        tuple(static_shape(node.outputs[0])[i] for i in HEAD_PERM)  # type: ignore[index]
                except ValueError:
                    fits = False
                if not fits:
                    return None
                ways.append(("constant", node))
                continue
            if node.inputs[0] is node.inputs[1] and static_shape(node.outputs[0]) == static_shape(y):
                ways.append(("pair", node))
                continue
            pt = _head_transpose(other)
            if pt is not None and static_shape(pt.inputs[0]) == static_shape(t.inputs[0]) \
                    and static_shape(node.outputs[0]) == static_shape(t.outputs[0]):
                ways.append(("pair", node))
                continue
            return None
        w = const(node.inputs[1]) if _onnx(node, "MatMul") and use.idx == 0 else None
        if w is not None and w.ndim == 2 and static_shape(node.outputs[0]) is not None:
            ways.append(("matmul", node))
            continue
        if _onnx(node, "Reshape") and _repeat_chain(y) is not None:
            ways.append(("repeat", node))
            continue
        if _onnx(node, "Slice") and use.idx == 0 and _last_axis_slice(node):
            ways.append(("slice", node))  # a part of each head's D (Allegro's 3-D rotary, an axis a part)
            continue
        if _onnx(node, "Concat") and int(node.attributes["axis"].value) % 4 == 3 and all(
                _head_transpose(v) is not None and static_shape(v.producer().inputs[0]) is not None  # type: ignore[union-attr]
                for v in node.inputs):
            ways.append(("concat", node))  # the parts of each head's D put back together
            continue
        return None
    return ways


def _last_axis_slice(node: ir.Node) -> bool:
    """A Slice of the last axis of a rank-4 value alone, its starts, ends and steps constants."""
    if len(node.inputs) < 4 or any(const(v) is None for v in node.inputs[1:] if v is not None):
        return False
    axes = const(node.inputs[3])
    return axes is not None and axes.size == 1 and int(axes.reshape(-1)[0]) % 4 == 3


def _transposed(b: Builder, v: ir.Value, shape: list[int]) -> ir.Node:
    return b.op("Transpose", [v], {"perm": list(HEAD_PERM)}, dtype=v.dtype, shape=shape)


def _sink(graph: ir.Graph, t: ir.Node) -> bool:
    ways = _sinkable(t)
    if ways is None:
        return False
    x = t.inputs[0]
    assert x is not None
    xs = list(static_shape(x))  # type: ignore[arg-type]
    for kind, node in ways:
        b = Builder(graph, RULE)
        if kind == "repeat":
            nodes, axis, r = _repeat_chain(t.outputs[0])  # type: ignore[misc]
            a = HEAD_PERM[axis]  # the axis of x that becomes the repeated one
            mid = [*xs[:a + 1], 1, *xs[a + 1:]]
            wide = [*xs[:a + 1], r, *xs[a + 1:]]
            out = [*xs[:a], xs[a] * r, *xs[a + 1:]]
            v = b.op("Reshape", [x, b.const(np.asarray(mid, np.int64), "shape")], dtype=x.dtype, shape=mid)
            v = b.op("Expand", [v.outputs[0], b.const(np.asarray(wide, np.int64), "shape")], dtype=x.dtype, shape=wide)
            v = b.op("Reshape", [v.outputs[0], b.const(np.asarray(out, np.int64), "shape")], dtype=x.dtype, shape=out)
            last = nodes[-1]
            new = _transposed(b, v.outputs[0], [out[i] for i in HEAD_PERM])
            graph.insert_before(last, b.nodes)
            reroute(graph, last.outputs[0], new.outputs[0])
            continue
        y = node.outputs[0]
        ys = [list(static_shape(y))[i] for i in HEAD_PERM]  # type: ignore[arg-type]
        attrs: dict[str, object] = {}
        if kind == "matmul":
            operands = [x, node.inputs[1]]
        elif kind == "slice":
            operands = [x, *node.inputs[1:]]  # the last axis stays the last: the same starts, ends, axes
        elif kind == "concat":
            operands = [(t if v is t.outputs[0] else _head_transpose(v)).inputs[0] for v in node.inputs]  # type: ignore[union-attr]
            attrs = {"axis": 3}
        elif kind == "pair":
            operands = []
            for v in node.inputs:
                pt = t if v is t.outputs[0] else _head_transpose(v)
                operands.append(pt.inputs[0])  # type: ignore[union-attr]
        else:
            operands = []
            for v in node.inputs:
                if v is t.outputs[0]:
                    operands.append(x)
                    continue
                c = const(v)
                assert v is not None and c is not None
                full = [1] * (4 - c.ndim) + list(c.shape)
                if full[1] == full[2] == 1:  # a scalar, a per-channel or per-batch constant: the same either way
                    operands.append(v)
                    continue
                steps = [*([step("reshape", shape=full)] if c.ndim < 4 else []),
                         step("transpose", perm=list(HEAD_PERM))]
                operands.append(b.derived(v, steps, [full[i] for i in HEAD_PERM], f"{v.name}_heads"))
        op = b.op(node.op_type, operands, attrs, dtype=y.dtype, shape=ys)
        new = _transposed(b, op.outputs[0], list(static_shape(y)))  # type: ignore[arg-type]
        graph.insert_before(node, b.nodes)
        reroute(graph, y, new.outputs[0])
    return True


def sink_head_transposes(model: ir.Model) -> PassResult:
    """Every head split's Transpose moved below the per-head arithmetic that reads it (see the module's
    docstring), round after round until none moves."""
    graph = model.graph
    done = 0
    for _ in range(_ROUNDS):
        moved = 0
        for node in list(graph):
            if node.graph is None or _head_transpose(node.outputs[0]) is not node:
                continue
            if _sink(graph, node):
                moved += 1
        if not moved:
            break
        done += moved
        remove_dead_nodes(graph)
    if done:
        graph.sort()
    return PassResult(modified=bool(done), counts={"head transposes sunk past per-head arithmetic": done})
