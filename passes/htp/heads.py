"""An attention's scores in head groups (``group_attention_heads``): an attention whose score tensor passes
``SCORES_LIMIT`` is computed as several attentions over groups of its heads, concatenated.

Each head's attention is independent of the others', so ``softmax(Q Kᵀ s + mask) V`` over ``[B, H, M, N]``
scores is the concatenation, along the heads, of the same computed over ``[B, h, M, N]`` for groups of ``h``
heads: the same ops on the same numbers, in float32 and on the HTP alike. What it changes is the largest tensor
of the graph. SD 3.5's joint attention at 1024 px and batch 2 has ``[2, 24, 4429, 4429]`` scores, 3.5 GB in
float32, 1.9 GB in fp16: more than half of what the HTP's address space holds for a context (about 3.5 GB, the
weights included). Qualcomm's own SD recipe (qai-hub-models) computes attention head by head for the same
reason. (QNN's compile of SD 3.5's pieces was killed for this machine's 24 GB with or without the groups: that
was its odd token count, which ``sdnpu.passes.htp.tokens`` pads.)

The form taken, as diffusers' attentions export (``F.scaled_dot_product_attention`` and the eager ones):
``MatMul(Q, Kᵀ)`` over ``[B, H, M, D] x [B, H, D, N]`` (rank 3 ``[B·H, ...]`` too), then any of ``Mul`` /
``Div`` / ``Add`` / ``Sub`` with an operand that is broadcast along the heads or has them all (a mask, a
scale, a bias: sliced with the heads where it has them), ``Softmax`` over the last axis, ``MatMul`` with ``V``.
The scores and probabilities are read by nothing else (an attention whose probabilities are a graph output
keeps its form). Q, Kᵀ and V are split along the heads once each (``Split``), the groups as even as the heads
allow, the fewest whose scores each fit the limit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import RULE_TAG
from sdnpu.passes.htp.common import RULE, constant, node_name, unique_name
from sdnpu.passes.manager import PassResult

# a score tensor past this many bytes (as the graph holds it, float32) is computed in head groups: SDXL's largest
# (1.34 GB at 1024 px, batch 2) compiled whole on this machine, SD 3.5's (3.47 GB) did not; 1 GiB puts SDXL's in
# two groups, SD 3.5's in four, Flux.1's (2.04 GB, batch 1) in three
SCORES_LIMIT = 1 << 30

_ELEMENTWISE = ("Mul", "Div", "Add", "Sub")


def static_shape(v: ir.Value | None) -> list[int] | None:
    if v is None or v.shape is None or not v.shape.is_static():
        return None
    return [int(d) for d in v.shape]


def _only_reader(v: ir.Value) -> ir.Node | None:
    users = list(v.uses())
    if len(users) != 1 or v.is_graph_output():
        return None
    return users[0].node


def _from_product(v: ir.Value | None, scores: list[int], depth: int = 4) -> bool:
    """Whether ``v`` is the scores' product (a MatMul of their shape), or computed from it by the element-wise
    ops between it and the softmax."""
    p = v.producer() if v is not None else None
    if p is None or p.domain not in ("", "ai.onnx") or static_shape(p.outputs[0]) != scores:
        return False
    if p.op_type == "MatMul":
        return True
    return depth > 0 and p.op_type in _ELEMENTWISE and any(_from_product(x, scores, depth - 1) for x in p.inputs)


class _Attention:
    """One attention's nodes between Q, Kᵀ, V and its output, and the axis of its heads."""

    def __init__(self, qk: ir.Node, between: list[ir.Node], softmax: ir.Node, pv: ir.Node, axis: int) -> None:
        self.qk, self.between, self.softmax, self.pv, self.axis = qk, between, softmax, pv, axis

    @property
    def nodes(self) -> list[ir.Node]:
        return [self.qk, *self.between, self.softmax, self.pv]


def match_attention(softmax: ir.Node) -> _Attention | None:
    """The attention around ``softmax``, where it is in the form the module's docstring names."""
    scores = static_shape(softmax.inputs[0])
    if scores is None or len(scores) not in (3, 4):
        return None
    rank = len(scores)
    axis_attr = softmax.attributes.get("axis")
    if (int(axis_attr.value) if axis_attr is not None else -1) % rank != rank - 1:
        return None
    pv = _only_reader(softmax.outputs[0])
    if pv is None or pv.op_type != "MatMul" or pv.domain not in ("", "ai.onnx") or pv.inputs[0] is not softmax.outputs[0]:
        return None
    between: list[ir.Node] = []
    v = softmax.inputs[0]
    while True:
        p = v.producer() if v is not None else None
        if p is None or p.domain not in ("", "ai.onnx"):
            return None
        if p.op_type == "MatMul":
            break
        if p.op_type not in _ELEMENTWISE or len(p.inputs) != 2 or _only_reader(p.outputs[0]) is None:
            return None
        between.append(p)
        sides = [i for i, x in enumerate(p.inputs) if _from_product(x, scores)]
        if len(sides) != 1 or (p.op_type in ("Div", "Sub") and sides[0] != 0):
            return None  # both sides computed from products, or k / scores: not a scale or mask of the scores
        side = sides[0]
        v = p.inputs[side]
    qk = p
    if _only_reader(qk.outputs[0]) is None or static_shape(qk.outputs[0]) != scores:
        return None
    axis = rank - 3  # the heads: the last of the products' batch axes
    for m in (qk, pv):
        for x in m.inputs:
            s = static_shape(x)
            if s is None or len(s) != rank or s[axis] != scores[axis]:
                return None
    return _Attention(qk, list(reversed(between)), softmax, pv, axis)


def attentions(graph: ir.Graph) -> Iterator[tuple[ir.Node, _Attention, list[int]]]:
    """Each attention of ``graph`` in the form ``match_attention`` takes: its softmax, its nodes, its scores'
    shape (the graph may be rewritten between one and the next: a softmax already replaced is passed over)."""
    for node in list(graph):
        if node.graph is None or node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        att = match_attention(node)
        scores = static_shape(node.inputs[0])
        if att is not None and scores is not None:
            yield node, att, scores


def _groups(heads: int, per_head: int) -> list[int]:
    """The fewest even groups of ``heads`` whose scores each take at most ``SCORES_LIMIT`` bytes."""
    count = min(heads, max(1, math.ceil(heads * per_head / SCORES_LIMIT)))
    while count < heads and math.ceil(heads / count) * per_head > SCORES_LIMIT:
        count += 1
    base, extra = divmod(heads, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def _split(graph: ir.Graph, anchor: ir.Node, v: ir.Value, axis: int, sizes: list[int], hint: str
           ) -> list[ir.Value]:
    """``v`` split along ``axis`` into ``sizes`` (a Split before ``anchor``)."""
    shape = static_shape(v)
    assert shape is not None
    split = constant(graph, np.asarray(sizes, np.int64), f"{hint}_sizes")
    node = ir.node("Split", [v, split], attributes={"axis": axis}, num_outputs=len(sizes),
                   name=node_name(graph, f"{hint}_split"))
    node.metadata_props[RULE_TAG] = RULE
    graph.insert_before(anchor, node)
    for i, (out, size) in enumerate(zip(node.outputs, sizes, strict=True)):
        out.name = unique_name(graph, f"{hint}_{i}")
        out.dtype = v.dtype
        out.shape = ir.Shape([size if d == axis else s for d, s in enumerate(shape)])
    return list(node.outputs)


def _rewrite(graph: ir.Graph, att: _Attention, sizes: list[int]) -> None:
    axis, anchor = att.axis, att.pv  # before the last node: every operand of the attention is defined by then
    name = att.softmax.name or "attention"
    parts: dict[ir.Value, list[ir.Value]] = {}  # a value computed over all heads -> its parts, group by group

    def sliced(v: ir.Value, rank: int, heads: int) -> list[ir.Value] | None:
        """``v``'s parts along the heads (None: ``v`` is broadcast along them, every group reads it whole)."""
        if v in parts:
            return parts[v]
        shape = static_shape(v)
        assert shape is not None
        aligned = [1] * (rank - len(shape)) + shape
        if aligned[axis] == 1:
            return None
        assert aligned[axis] == heads
        parts[v] = _split(graph, anchor, v, axis - (rank - len(shape)), sizes, f"{name}_{v.name or 'operand'}")
        return parts[v]

    out = att.pv.outputs[0]
    shape = static_shape(out)
    assert shape is not None
    rank, heads = len(shape), shape[axis]
    results: list[ir.Value] = []
    for g in range(len(sizes)):
        made: dict[ir.Value, ir.Value] = {}
        for node in att.nodes:
            ins = []
            for x in node.inputs:
                assert x is not None
                if x in made:
                    ins.append(made[x])
                    continue
                got = sliced(x, rank, heads)
                ins.append(x if got is None else got[g])
            copy = ir.Node(node.domain, node.op_type, ins, attributes=list(node.attributes.values()),
                           name=node_name(graph, f"{node.name or node.op_type}_heads{g}"))
            copy.metadata_props[RULE_TAG] = RULE
            graph.insert_before(att.pv, copy)
            y, orig = copy.outputs[0], node.outputs[0]
            y.name = unique_name(graph, f"{orig.name}_heads{g}")
            y.dtype = orig.dtype
            full = static_shape(orig)
            assert full is not None
            y.shape = ir.Shape([sizes[g] if d == axis else s for d, s in enumerate(full)])
            made[orig] = y
        results.append(made[out])
    concat = ir.node("Concat", results, attributes={"axis": axis}, name=node_name(graph, f"{name}_heads"))
    concat.metadata_props[RULE_TAG] = RULE
    graph.insert_before(att.pv, concat)
    y = concat.outputs[0]
    y.dtype, y.shape = out.dtype, out.shape
    keep = out.name
    out.replace_all_uses_with(y, replace_graph_outputs=True)
    for node in reversed(att.nodes):
        graph.remove(node, safe=True)
    y.name = keep


def group_attention_heads(model: ir.Model) -> PassResult:
    """Every attention whose scores pass ``SCORES_LIMIT`` in head groups (see the module's docstring)."""
    graph = model.graph
    done = groups = 0
    for node, att, scores in attentions(graph):
        dtype = node.inputs[0].dtype
        itemsize = dtype.itemsize if dtype is not None else 4
        heads = scores[att.axis]
        per_head = int(np.prod(scores, dtype=np.int64)) // heads * itemsize
        if per_head * heads <= SCORES_LIMIT or heads < 2:
            continue
        sizes = _groups(heads, per_head)
        _rewrite(graph, att, sizes)
        done += 1
        groups += len(sizes)
    return PassResult(modified=done > 0, counts={"attentions in head groups": done, "head groups": groups})
