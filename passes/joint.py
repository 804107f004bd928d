"""Joint attention (SD3's MMDiT, Flux, AuraFlow) into the form SDMHA takes: two rewrites, the joint pass (right
after canonicalize, before the fusions).

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
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from sdnpu.passes.streams import split_rows
from sdnpu.passes.irutil import Builder, attr, const, remove_dead_nodes, replace, scalar, static_shape

RULE = "JointAttention"
HEADS = (0, 2, 1, 3)  # [B, S, H, D] <-> [B, H, S, D]; its own inverse
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Pow"})


def _is_heads_transpose(node: ir.Node | None) -> bool:
    return (node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx")
            and tuple(attr(node, "perm") or ()) == HEADS and len(static_shape(node.outputs[0]) or ()) == 4)


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
    counts["sequence cuts computed as their parts"] = split_rows(graph)
    counts["head transposes moved below row ops"] = sink_head_transposes(graph)
    return counts
