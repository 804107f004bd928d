"""Joint attention (SD3's MMDiT, Flux, AuraFlow) into the form SDMHA takes: three rewrites, the joint pass (right
after the canonical steps, before the fusions).

1. *One attention per query part* (``passes/streams.py``). MMDiT attends over the image and text tokens
   together: Q, K and V are each a Concat of the two streams' heads along the sequence, and the merged output is
   cut back into the two streams. Each query row attends on its own, so

       Slice_i(merge(Attention(Concat(q_1, q_2), K, V))) == merge(Attention(q_i, K, V))

   exactly, for the same MACs; the cuts go (DD's SDSlice is keyed on shapes alone and has no offsets, so it
   cannot say which part it takes) and each part becomes an SDMHA of its own over the joint keys and values.
   The streams pass does this for any cut of the sequence, through any ops that work row by row.

2. *Heads below the row ops* (``sink_head_transposes``). A head split ends in ``Transpose(0, 2, 1, 3)``
   ([B, S, H, D] -> [B, H, S, D]); SD3.5 normalizes each head's Q and K over D after it (RMSNorm: Pow,
   ReduceMean over the last axis, Add, Sqrt, Reciprocal, Mul) and concatenates the streams along S. Both
   commute with that Transpose, which moves below them: the norm then runs on [B, S, H, D] rows, and the
   Concat on the streams' [B, S_i, H * D] views along the sequence (axis 1), so the attention rule finds
   rank-3 sources behind plain head splits. Only Transposes that reach a norm (Pow / ReduceMean, or x * x)
   or a Concat start moving; an element-wise op passes one on only when it came from such a move (a UNet's
   head split scaled by a constant stays as it is).

3. *The head merge above per-head arithmetic* (``hoist_merge_transposes``). Lumina-Next gates its cross-attention's
   output per head and adds its self-attention's while both are [B, H, M, D], then merges the heads once. The
   merge's ``Transpose(0, 2, 1, 3)`` commutes with that arithmetic and moves above it onto each attention's
   output, so each attention ends in a merge of its own, which the attention rule reads as [B, M, H, D].
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from sdnpu.passes.streams import split_rows
from sdnpu.passes.provenance import step
from sdnpu.passes.irutil import Builder, attr, const, producer, remove_dead_nodes, replace, scalar, static_shape
from sdnpu.passes.rules.attention_masks import nan_guard
from sdnpu.passes.manager import PassResult

RULE = "JointAttention"
HEADS = (0, 2, 1, 3)  # [B, S, H, D] <-> [B, H, S, D]; its own inverse
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Pow"})


# --- heads below the row ops ------------------------------------------------------------------------------

def _row_perm(node: ir.Node | None) -> tuple[int, ...] | None:
    """The perm of a 4-D Transpose that keeps the last axis in place (it moves rows, each row whole): the head
    split's (0, 2, 1, 3), and the permutes exporters write around a slice assignment (2, 1, 0, 3)."""
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm = tuple(int(i) for i in attr(node, "perm") or ())
    return perm if len(perm) == 4 and perm[3] == 3 and len(static_shape(node.outputs[0]) or ()) == 4 else None


def _moved_constant(b: Builder, v: ir.Value, perm: tuple[int, ...]) -> ir.Value | None:
    """A constant operand of an op on a transposed value, as the same op on the value before the Transpose
    reads it: broadcast to rank 4 and permuted back (offline); None where it is not a constant of rank <= 4."""
    a = const(v)
    if a is None or a.ndim > 4:
        return None
    if all(n == 1 for n in a.shape[:-1]):
        return v  # along the last axis only: the same either way
    full = (1,) * (4 - a.ndim) + tuple(a.shape)
    back = [int(i) for i in np.argsort(perm)]
    return b.derived(v, [step("reshape", shape=list(full)), step("transpose", perm=back)], [full[i] for i in back],
                     f"{v.name}_rows")


def _sink_into(graph: ir.Graph, node: ir.Node, moved: set[int]) -> bool:
    """``node`` on values a row Transpose made, as the same node before the Transpose and the Transpose after
    it: a per-head norm (RMSNorm's Pow and ReduceMean, a LayerNormalization over the last axis), a Concat of
    the streams, an element-wise op (its constants permuted offline), a product with a constant [D, D] (the
    rotary embedding's rotation), another row Transpose (the two composed: nothing where they cancel)."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return False
    out_shape = static_shape(node.outputs[0])
    if out_shape is None or len(out_shape) != 4:
        return False
    data = node.inputs[:1] if op in ("ReduceMean", "Pow", "LayerNormalization", "MatMul", "Transpose") else node.inputs
    sources = [v.producer() for v in data if v is not None and _row_perm(v.producer()) is not None]
    perms = {_row_perm(t) for t in sources}
    if len(perms) != 1:
        return False
    perm = next(iter(perms))
    assert perm is not None
    was_moved = any(id(t) in moved for t in sources)
    if op == "Concat":
        if len(sources) != len(data):
            return False
    elif op == "Transpose":
        pass
    elif op in ("Pow", "ReduceMean", "LayerNormalization"):
        if len(sources) != 1 or (op == "Pow" and scalar(node.inputs[1]) is None):
            return False
        if op == "ReduceMean" and (attr(node, "keepdims", 1) != 1 or len(node.inputs) < 2
                                   or const(node.inputs[1]) is None):
            return False
        if op == "LayerNormalization" and (int(attr(node, "axis", -1)) % 4 != 3 or len(node.outputs) != 1):
            return False
    elif op == "MatMul":
        w = static_shape(node.inputs[1])
        if not was_moved or node.inputs[1] is None or node.inputs[1].const_value is None or w is None or len(w) != 2:
            return False
    elif op in _ELEMENTWISE or op in ("Cast", "Neg", "Sigmoid", "Tanh", "Erf", "Gelu"):
        if len(sources) < 2 and not was_moved:  # on values a move brought here, or on row-moved values alone
            return False
    else:
        return False
    b = Builder(graph, RULE)
    inputs: list[ir.Value | None] = []
    for v in (data if op != "Concat" else node.inputs):
        if v is not None and _row_perm(v.producer()) is not None:
            inputs.append(v.producer().inputs[0])  # type: ignore[union-attr]
        elif v is None or op in ("Pow", "ReduceMean", "LayerNormalization", "MatMul", "Transpose"):
            inputs.append(v)
        else:
            moved_c = _moved_constant(b, v, perm)
            if moved_c is None:
                return False
            inputs.append(moved_c)
    attrs = {k: a.value for k, a in node.attributes.items()}
    new_shape = tuple(out_shape[i] for i in np.argsort(perm))
    if op == "Transpose":  # T2(T1(x)) = T(x) with the two perms composed
        composed = [perm[i] for i in attr(node, "perm")]
        x = inputs[0]
        assert x is not None
        if composed == list(range(4)) and not node.outputs[0].is_graph_output():
            node.outputs[0].replace_all_uses_with(x)
            return True
        y = b.op("Transpose", [x], {"perm": composed}, dtype=node.outputs[0].dtype, shape=out_shape).outputs[0]
        replace(graph, node, [node], b.nodes, [node.outputs[0]], [y])
        return True
    if op == "ReduceMean":
        axes = const(node.inputs[1])
        inputs.append(b.const(np.asarray([perm[int(a) % 4] for a in axes.reshape(-1)], np.int64), "axes"))  # type: ignore[union-attr]
    elif op in ("Pow", "LayerNormalization", "MatMul"):
        inputs += node.inputs[1:]
    if op == "Concat" and perm == HEADS and perm[attrs.get("axis", 0) % 4] == 1:
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
            attrs["axis"] = perm[attrs.get("axis", 0) % 4]
        y = b.op(op, inputs, attrs, dtype=node.outputs[0].dtype, shape=new_shape).outputs[0]
    t = b.op("Transpose", [y], {"perm": list(perm)}, dtype=y.dtype, shape=out_shape)
    moved.add(id(t))
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [t.outputs[0]])
    return True


def sink_head_transposes(graph: ir.Graph) -> int:
    moved: set[int] = set()
    done = 0
    for _ in range(64):  # one op further each round; an RMSNorm is seven
        step_count = 0
        for t in list(graph):
            if t.graph is None or _row_perm(t) is None:
                continue
            for use in list(t.outputs[0].uses()):
                node = use.node
                if node.graph is not None:
                    step_count += _sink_into(graph, node, moved)
        remove_dead_nodes(graph)
        done += step_count
        if not step_count:
            break
    return done


# --- the head merge above the per-head arithmetic on attention outputs ---------------------------------------

_MERGE_OPS = frozenset({"Add", "Sub", "Mul", "Div"})


def _attention_output(v: ir.Value | None, depth: int = 8) -> bool:
    """``v`` is an attention's output [B, H, M, D] (``MatMul(Softmax(..), V)``, maybe through the NaN guard
    after the softmax), or element-wise arithmetic of such outputs and of values broadcast over them."""
    p = v.producer() if v is not None else None
    if p is None or p.domain not in ("", "ai.onnx") or depth == 0:
        return False
    if p.op_type == "MatMul":
        a = p.inputs[0]
        guard = nan_guard(a)
        return producer(guard[2] if guard else a, "Softmax") is not None
    if p.op_type in _MERGE_OPS:
        return any(_attention_output(w, depth - 1) for w in p.inputs)
    return False


def _hoist_merge(graph: ir.Graph, t: ir.Node) -> bool:
    """``Transpose(0, 2, 1, 3)(op(a, b))`` -> ``op(T(a), T(b))`` for the element-wise ``op`` on attention
    outputs ([B, H, M, D]) that writes the head merge's input and nothing else: each attention's output then
    goes straight into the merge's Transpose (Lumina-Next gates its cross-attention per head and adds it to its
    self-attention before the merge), the form the attention rule reads. A constant operand is permuted offline,
    a computed one of a size-1 swapped axis viewed (a Reshape), another transposed."""
    x = t.inputs[0]
    op = x.producer() if x is not None else None
    out_shape = static_shape(t.outputs[0])
    if (op is None or op.domain not in ("", "ai.onnx") or op.op_type not in _MERGE_OPS or len(op.outputs) != 1
            or len(x.uses()) != 1 or x.is_graph_output() or out_shape is None or len(out_shape) != 4  # type: ignore[union-attr]
            or not _attention_output(x)):
        return False
    b = Builder(graph, RULE)
    inputs: list[ir.Value] = []
    for v in op.inputs:
        shape = static_shape(v)
        if v is None or shape is None:
            b.discard()
            return False
        if v.const_value is not None:
            moved = _moved_constant(b, v, HEADS)
            if moved is None:
                b.discard()
                return False
            inputs.append(moved)
            continue
        if len(shape) != 4:
            b.discard()
            return False
        swapped = (shape[0], shape[2], shape[1], shape[3])
        if 1 in (shape[1], shape[2]):  # the swap moves a size-1 axis: a view
            inputs.append(b.op("Reshape", [v, b.const(np.asarray(swapped, np.int64), "shape")], dtype=v.dtype,
                               shape=swapped).outputs[0])
        else:
            inputs.append(b.op("Transpose", [v], {"perm": list(HEADS)}, dtype=v.dtype, shape=swapped).outputs[0])
    y = b.op(op.op_type, inputs, {}, dtype=x.dtype, shape=out_shape).outputs[0]  # type: ignore[union-attr]
    replace(graph, t, [op, t], b.nodes, [t.outputs[0]], [y])
    return True


def hoist_merge_transposes(graph: ir.Graph) -> int:
    """Every head merge's Transpose moved above the element-wise arithmetic on attention outputs
    (``_hoist_merge``), one op a round, until each stands on an attention's output."""
    done = 0
    for _ in range(16):
        moved = 0
        for t in list(graph):
            if t.graph is not None and _row_perm(t) == HEADS:
                moved += _hoist_merge(graph, t)
        done += moved
        if not moved:
            break
    if done:
        remove_dead_nodes(graph)
        graph.sort()
    return done


def split_joint_attention(model: ir.Model) -> PassResult:
    """SD3's MMDiT attention in SDMHA's form: one attention per query part, the head Transposes below the
    per-head norms; a graph without joint attention is left as it is."""
    graph = model.graph
    counts: Counter[str] = Counter()
    counts["sequence cuts computed as their parts"] = split_rows(graph)
    counts["head transposes moved below row ops"] = sink_head_transposes(graph)
    counts["head merges moved above per-head arithmetic"] = hoist_merge_transposes(graph)
    common.RemoveUnusedNodesPass()(model)
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
