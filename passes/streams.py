"""Streams: a cut of the sequence (a Slice or Split along an axis other than the features) computed as the
parts it takes, so that no Slice is left between two dispatch ops. DD's SDSlice is keyed on shapes alone and
cannot say which part it takes; a part computed on its own needs no slice at all.

The diffusion transformers run their text and image tokens as one sequence for attention, then cut it back:

    SD3, Flux, AuraFlow, CogView4:  out = Attention(Concat(q_txt, q_img), K, V); (o_txt, o_img) = Split(out)
    Flux's last single block:       hidden[:, text:] (the image tokens of the joint stream)

Each op between the cut and where its parts come from works row by row along the cut axis: element-wise ops
(an operand of size 1 on the axis broadcasts to every part, a constant is cut offline), norms, the linear
layers, Softmax over another axis, and attention's queries (each query row attends on its own, over every
key and value). So a part of the output is the same ops on the parts of their inputs:

    Split_i(Attention(Q, K, V)) == Attention(Split_i(Q), K, V)
    Split_i(Concat(a, b)) == a, b                      (the parts meet where they were joined)

``split_rows`` takes every cut back through such ops, node by node, to where its parts are made: a Concat
along that axis (the streams' join), or a value computed from the graph's inputs alone on the CPU (Flux's
rotary tables: cut there, once, at the edge). Every value on the way is then computed as its parts; a reader
that needs the whole (attention's keys and values, the next block's input) reads the parts' Concat, which is
an SDConcat on the NPU. No row is computed twice: the same MACs, and the cut's Slices are gone. A cut whose
parts cannot be traced to such a source (a reshape that mixes the axis with another, a Gather) stays as it
is; nothing is changed for it. Nor does a cut go through a layer where a part has fewer than ``MIN_ROWS``
rows: each part reads the layer's weights again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
from sdnpu.passes.irutil import Builder, attr, const, remove_dead_nodes, reroute, static_shape
from sdnpu.passes.provenance import step

log = logging.getLogger(__name__)

RULE = "Streams"
# A layer computed on parts reads its weights once per part: a part of fewer rows than this would spend more
# time reading weights than multiplying (Chroma's modulation table: 6 rows per block out of 344), so the cut
# stays where it is instead.
MIN_ROWS = 8
Bounds = tuple[tuple[int, int], ...]

UNARY = frozenset({"Cast", "Neg", "Sigmoid", "Tanh", "Relu", "Gelu", "Erf", "Exp", "Log", "Sqrt", "Reciprocal",
                   "Abs", "Sin", "Cos", "Softplus", "HardSigmoid", "HardSwish", "LeakyRelu", "Elu", "Identity",
                   "IsNaN", "IsInf", "Not"})  # the last: a masked softmax's fully-masked rows set to 0 (dynamo's SDPA)
NARY = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Clip", "Equal", "Less", "Greater",
                  "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"})
REDUCE = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceL2"})
WEIGHTED = frozenset({"MatMul", "Gemm", "Conv", "LayerNormalization", "Softmax", "InstanceNormalization"})


class _Fail(Exception):
    pass


def _onnx(node: ir.Node | None) -> bool:
    return node is not None and node.domain in ("", "ai.onnx")


def cut_bounds(cut: ir.Node, axis: int, n: int) -> Bounds | None:
    """The parts a Split or Slice takes along ``axis`` (of length n), or None."""
    if cut.op_type == "Split":
        sizes = const(cut.inputs[1]) if len(cut.inputs) > 1 and cut.inputs[1] is not None else None
        if sizes is None:
            shapes = [static_shape(o) for o in cut.outputs]
            if any(s is None for s in shapes):
                return None
            sizes = np.asarray([s[axis] for s in shapes])  # type: ignore[index]
        ends = np.cumsum(sizes.reshape(-1))
        if ends[-1] != n:
            return None
        starts = np.concatenate([[0], ends[:-1]])
        return tuple((int(a), int(b)) for a, b in zip(starts, ends, strict=True))
    vals = [const(v) if v is not None else None for v in cut.inputs[1:]]
    if len(vals) < 2 or vals[0] is None or vals[1] is None or vals[0].size != 1:
        return None
    if len(cut.inputs) > 4 and cut.inputs[4] is not None and (vals[3] is None or int(vals[3].reshape(-1)[0]) != 1):
        return None
    lo, hi = int(vals[0].reshape(-1)[0]), int(vals[1].reshape(-1)[0])
    lo = min(max(lo + n if lo < 0 else lo, 0), n)
    hi = min(max(hi + n if hi < 0 else hi, 0), n)
    if lo >= hi:
        return None
    return tuple(p for p in ((0, lo), (lo, hi), (hi, n)) if p[0] < p[1])


def cut_axis(cut: ir.Node, rank: int) -> int | None:
    if cut.op_type == "Split":
        return int(attr(cut, "axis", 0)) % rank
    axes = const(cut.inputs[3]) if len(cut.inputs) > 3 and cut.inputs[3] is not None else np.zeros(1, np.int64)
    if axes is None or axes.size != 1:
        return None
    return int(axes.reshape(-1)[0]) % rank


def _edge(v: ir.Value, memo: dict[ir.Value, bool]) -> bool:
    """``v`` is computed from the graph's inputs and constants alone, with no layer (no weight-bearing op,
    no norm): a table the CPU makes at the graph's edge (the rotary embeddings' cos and sin)."""
    if v in memo:
        return memo[v]
    memo[v] = False  # a cycle cannot happen in a DAG; guards the recursion
    p = v.producer()
    if v.const_value is not None or (p is None and v.is_graph_input()):
        result = v.const_value is None
    elif p is None or not _onnx(p) or p.op_type in WEIGHTED:
        result = False
    else:
        result = all(w is None or w.const_value is not None or _edge(w, memo) for w in p.inputs)
    memo[v] = result
    return result


class _Planner:
    """Builds the parts of values (memoized); raises _Fail where a value's parts cannot be made."""

    def __init__(self, graph: ir.Graph, edges: dict[ir.Value, bool],
                 cut_edges: dict[tuple[ir.Value, int, Bounds], list[ir.Value]]) -> None:
        self.graph = graph
        self.b = Builder(graph, RULE)
        self.memo: dict[tuple[ir.Value, int, Bounds], list[ir.Value]] = {}
        self.whole: list[tuple[ir.Value, int, Bounds]] = []  # values now made of parts, for their other readers
        self.edges = edges
        self.cut_edges = cut_edges  # the edge tables' Slices, shared by every cut (one per table and part)
        self.new_edges: dict[tuple[ir.Value, int, Bounds], list[ir.Value]] = {}

    def parts(self, v: ir.Value, axis: int, bounds: Bounds) -> list[ir.Value]:
        key = (v, axis, bounds)
        if key in self.memo:
            return self.memo[key]
        shape = static_shape(v)
        if shape is None:
            raise _Fail(f"{v.name} has no static shape")
        if len(bounds) == 1:
            out = [v]
        elif v.const_value is not None:
            out = [self.b.derived(v, [step("slice", axis=axis, start=lo, stop=hi)], self._shape(shape, axis, lo, hi),
                                  f"{v.name}_rows{lo}") for lo, hi in bounds]
        elif _edge(v, self.edges) and _onnx(v.producer()) and v.producer().op_type == "Concat" \
                and int(attr(v.producer(), "axis", 0)) % len(shape) == axis:  # type: ignore[union-attr]
            out = self._from_concat(v.producer(), axis, bounds)  # type: ignore[arg-type]  # a table made of the parts
        elif _edge(v, self.edges) and _onnx(v.producer()) and v.producer().op_type in ("Reshape", "Transpose") \
                and v.producer().inputs[0] is not None and _edge(v.producer().inputs[0], self.edges):  # type: ignore[union-attr]
            out = self._through(v, shape, axis, bounds)  # cut the table before its view: the view is the reader's
        elif _edge(v, self.edges):
            out = self.cut_edges.get(key) or [self._slice(v, shape, axis, lo, hi) for lo, hi in bounds]
            if key not in self.cut_edges:
                self.new_edges[key] = out
        else:
            out = self._through(v, shape, axis, bounds)
            self.whole.append((v, axis, bounds))
        self.memo[key] = out
        return out

    @staticmethod
    def _shape(shape: Sequence[int], axis: int, lo: int, hi: int) -> list[int]:
        s = list(shape)
        s[axis] = hi - lo
        return s

    def _slice(self, v: ir.Value, shape: Sequence[int], axis: int, lo: int, hi: int) -> ir.Value:
        b = self.b
        args = [b.const(np.asarray([x], np.int64), "rows") for x in (lo, hi, axis)]
        return b.op("Slice", [v, *args], dtype=v.dtype, shape=self._shape(shape, axis, lo, hi)).outputs[0]

    def _through(self, v: ir.Value, shape: tuple[int, ...], axis: int, bounds: Bounds) -> list[ir.Value]:
        node = v.producer()
        if node is None or not _onnx(node):
            raise _Fail(f"{v.name} is not computed by an ONNX op")
        op = node.op_type
        out_i = list(node.outputs).index(v)
        if op == "Concat" and int(attr(node, "axis", 0)) % len(shape) == axis:
            return self._from_concat(node, axis, bounds)
        if op in UNARY or op in NARY:
            return self._elementwise(node, shape, axis, bounds)
        if op in ("Reshape", "Transpose"):
            src = node.inputs[0]
            src_axis = self._moved_axis(node, shape, axis)
            assert src is not None
            pieces = self.parts(src, src_axis, bounds)
            if op == "Transpose":
                return [self._op(node, [p], [self._shape(shape, axis, lo, hi)]) for p, (lo, hi) in zip(pieces, bounds)]
            return [self._reshape(p, self._shape(shape, axis, lo, hi)) for p, (lo, hi) in zip(pieces, bounds)]
        if op in REDUCE or op in ("Softmax", "LayerNormalization"):
            return self._rowwise_norm(node, shape, axis, bounds)
        if op == "MatMul":
            return self._matmul(node, shape, axis, bounds)
        if op == "Gemm" and axis == 0 and min(hi - lo for lo, hi in bounds) < MIN_ROWS:
            raise _Fail("a part of a few rows would read the layer's weights for little work")
        if op == "Gemm" and axis == 0 and not attr(node, "transA", 0) and (
                len(node.inputs) < 3 or node.inputs[2] is None or (static_shape(node.inputs[2]) or (0,))[0] in (1, shape[1])
                and len(static_shape(node.inputs[2]) or ()) <= 1):
            x = node.inputs[0]
            assert x is not None
            return [self._op(node, [p, *node.inputs[1:]], [self._shape(shape, 0, lo, hi)])
                    for p, (lo, hi) in zip(self.parts(x, 0, bounds), bounds, strict=True)]
        if op in ("Split", "Slice", "Concat"):
            return self._other_axis(node, out_i, shape, axis, bounds)
        raise _Fail(f"{op} is not computed row by row")

    def _op(self, node: ir.Node, inputs: list[ir.Value | None], shapes: list[list[int]], extra: dict | None = None
            ) -> ir.Value:
        attrs = {k: a.value for k, a in node.attributes.items()}
        attrs.update(extra or {})
        made = self.b.op(node.op_type, inputs, attrs, domain=node.domain, n_out=len(shapes))
        for o, s, old in zip(made.outputs, shapes, node.outputs, strict=False):
            o.dtype = old.dtype
            o.shape = ir.Shape(s)
        return made.outputs[0]

    def _reshape(self, x: ir.Value, shape: list[int]) -> ir.Value:
        target = self.b.const(np.asarray(shape, np.int64), "shape")
        return self.b.op("Reshape", [x, target], dtype=x.dtype, shape=shape).outputs[0]

    def _moved_axis(self, node: ir.Node, shape: tuple[int, ...], axis: int) -> int:
        src = static_shape(node.inputs[0])
        if src is None:
            raise _Fail("a movement without static shapes")
        if node.op_type == "Transpose":
            return int(attr(node, "perm")[axis])
        before = int(np.prod(shape[:axis]))
        for a, d in enumerate(src):
            if d == shape[axis] and int(np.prod(src[:a])) == before:
                return a
        raise _Fail(f"the reshape {list(src)} -> {list(shape)} mixes axis {axis} with another")

    def _from_concat(self, node: ir.Node, axis: int, bounds: Bounds) -> list[ir.Value]:
        edges, start = [], 0
        for v in node.inputs:
            n = (static_shape(v) or (0,) * (axis + 1))[axis]
            edges.append((start, start + n, v))
            start += n
        out = []
        for lo, hi in bounds:
            pieces = []
            for a, z, v in edges:
                s, e = max(lo, a), min(hi, z)
                if s >= e:
                    continue
                assert v is not None
                n = z - a
                if (s, e) == (a, z):
                    pieces.append(v)
                else:  # a part that starts or ends inside one input: that input's own parts
                    inner = tuple(p for p in ((0, s - a), (s - a, e - a), (e - a, n)) if p[0] < p[1])
                    pieces.append(self.parts(v, axis, inner)[[p[0] for p in inner].index(s - a)])
            if len(pieces) == 1:
                out.append(pieces[0])
            else:
                shape = list(static_shape(pieces[0]))  # type: ignore[arg-type]
                shape[axis] = hi - lo
                out.append(self.b.op("Concat", pieces, {"axis": axis}, dtype=pieces[0].dtype, shape=shape).outputs[0])
        return out

    def _elementwise(self, node: ir.Node, shape: tuple[int, ...], axis: int, bounds: Bounds) -> list[ir.Value]:
        per_input: list[list[ir.Value | None]] = []
        for w in node.inputs:
            ws = static_shape(w)
            if w is None:
                per_input.append([None] * len(bounds))
                continue
            if ws is None:
                raise _Fail("an operand without a static shape")
            a = axis - (len(shape) - len(ws))
            if a < 0 or ws[a] == 1:
                per_input.append([w] * len(bounds))  # broadcast along the axis: the same for every part
            elif ws[a] == shape[axis]:
                per_input.append(self.parts(w, a, bounds))  # type: ignore[arg-type]
            else:
                raise _Fail("an operand broadcasts in another way")
        return [self._op(node, [ins[i] for ins in per_input], [self._shape(shape, axis, lo, hi)])
                for i, (lo, hi) in enumerate(bounds)]

    def _rowwise_norm(self, node: ir.Node, shape: tuple[int, ...], axis: int, bounds: Bounds) -> list[ir.Value]:
        x = node.inputs[0]
        rank = len(static_shape(x) or ())
        if node.op_type == "Softmax":
            if int(attr(node, "axis", -1)) % rank == axis:
                raise _Fail("the softmax runs along the cut")
        elif node.op_type == "LayerNormalization":
            if axis >= int(attr(node, "axis", -1)) % rank or any(o.uses() for o in node.outputs[1:]):
                raise _Fail("the norm runs along the cut")
        else:
            axes = const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
            if axes is None or int(attr(node, "keepdims", 1)) != 1 or axis in {int(a) % rank for a in axes.reshape(-1)}:
                raise _Fail("the reduction runs along the cut")
        assert x is not None
        pieces = self.parts(x, axis, bounds)
        return [self._op(node, [p, *node.inputs[1:]], [self._shape(shape, axis, lo, hi)])
                for p, (lo, hi) in zip(pieces, bounds, strict=True)]

    def _matmul(self, node: ir.Node, shape: tuple[int, ...], axis: int, bounds: Bounds) -> list[ir.Value]:
        a, b = node.inputs
        sa, sb = static_shape(a), static_shape(b)
        if a is None or b is None or sa is None or sb is None or len(sa) < 2 or len(sb) < 2:
            raise _Fail("a MatMul of vectors")
        rank = len(shape)
        if b.const_value is not None:  # a layer: each part reads its weights again
            rows = [int(np.prod(self._shape(shape, axis, lo, hi)[:-1])) for lo, hi in bounds]
            if min(rows) < MIN_ROWS:
                raise _Fail(f"a part of {min(rows)} rows would read the layer's weights for little work")
        if axis == rank - 2:  # the rows of A: each row on its own, over the whole B
            pa, pb = self.parts(a, len(sa) - 2, bounds), [b] * len(bounds)
        elif axis == rank - 1:
            raise _Fail("the cut runs along the MatMul's columns")
        else:  # a batch axis: both operands, where they have it
            pa = self._batch(a, sa, rank, axis, bounds)
            pb = self._batch(b, sb, rank, axis, bounds)
        return [self._op(node, [x, y], [self._shape(shape, axis, lo, hi)])
                for x, y, (lo, hi) in zip(pa, pb, bounds, strict=True)]

    def _batch(self, v: ir.Value, s: tuple[int, ...], rank: int, axis: int, bounds: Bounds) -> list[ir.Value]:
        a = axis - (rank - len(s))
        if a < 0 or s[a] == 1:
            return [v] * len(bounds)
        return self.parts(v, a, bounds)

    def _other_axis(self, node: ir.Node, out_i: int, shape: tuple[int, ...], axis: int, bounds: Bounds
                    ) -> list[ir.Value]:
        """A Split, Slice or Concat along another axis than the cut: the same op on the parts."""
        x = node.inputs[0]
        rank = len(shape)
        if node.op_type == "Concat":
            ins = [self.parts(w, axis, bounds) for w in node.inputs]  # type: ignore[arg-type]
            return [self._op(node, [i[k] for i in ins], [self._shape(shape, axis, lo, hi)])
                    for k, (lo, hi) in enumerate(bounds)]
        along = cut_axis(node, rank)
        if along is None or along == axis or x is None:
            raise _Fail("a cut along the same axis, or of unknown axes")
        pieces = self.parts(x, axis, bounds)
        out = []
        for p, (lo, hi) in zip(pieces, bounds, strict=True):
            shapes = [self._shape(static_shape(o) or shape, axis, lo, hi) for o in node.outputs]  # type: ignore[arg-type]
            made = self._op(node, [p, *node.inputs[1:]], shapes).producer()
            assert made is not None
            out.append(made.outputs[out_i])
        return out


def _forward_axis(r: ir.Node, v: ir.Value, axis: int) -> int | None:
    """The axis of ``r``'s output that ``v``'s ``axis`` becomes, where ``r`` works row by row along it (the
    planner checks the rest when it builds ``r``'s parts); None where it plainly does not."""
    out = static_shape(r.outputs[0])
    vs = static_shape(v)
    if out is None or vs is None or not _onnx(r):
        return None
    op = r.op_type
    if op in UNARY or op in NARY or op in REDUCE or op in ("Softmax", "LayerNormalization", "Concat", "Split", "Slice"):
        a = axis + (len(out) - len(vs))
        return a if 0 <= a < len(out) and out[a] == vs[axis] else None
    if op == "Transpose":  # only where the axis keeps its place: a head split's Transpose is where the
        moved = list(attr(r, "perm")).index(axis)  # attention rule reads its [B, S, H, D] source, whole
        return moved if moved == axis else None
    if op == "Reshape":
        before = int(np.prod(vs[:axis]))
        return next((a for a, d in enumerate(out) if d == vs[axis] and int(np.prod(out[:a])) == before), None)
    if op == "MatMul" and r.inputs[0] is v and axis <= len(vs) - 2:
        return axis + (len(out) - len(vs))
    if op == "Gemm" and r.inputs[0] is v and axis == 0:
        return 0
    return None


def _cut_once(graph: ir.Graph, cut: ir.Node, edges: dict[ir.Value, bool],
              cut_edges: dict[tuple[ir.Value, int, Bounds], list[ir.Value]]) -> bool:
    x = cut.inputs[0]
    shape = static_shape(x)
    if x is None or shape is None or len(shape) < 2 or _edge(x, edges):  # a cut among CPU values stays there
        return False
    axis = cut_axis(cut, len(shape))
    if axis is None or axis == len(shape) - 1:  # the features: the Gemm rule's
        return False
    bounds = cut_bounds(cut, axis, shape[axis])
    if bounds is None or len(bounds) < 2:
        return False
    planner = _Planner(graph, edges, cut_edges)
    try:
        pieces = planner.parts(x, axis, bounds)
    except _Fail as e:
        log.debug("cut %s stays: %s", cut.name, e)
        planner.b.discard()
        return False
    if cut.op_type == "Split":
        targets = list(zip(cut.outputs, pieces, strict=True))
    else:
        targets = [(cut.outputs[0], pieces[bounds.index(slice_span(cut, shape[axis]))])]
    # every value now made of parts keeps its other readers: one that works row by row is made of parts too
    # (Flux.2's fused projection cut into q, k, v, mlp per stream), the rest read the parts' Concat (attention's
    # keys and values: an SDConcat on the NPU)
    whole: dict[int, tuple[ir.Value, int]] = {}
    done = 0
    while done < len(planner.whole):
        v, a, bd = planner.whole[done]
        done += 1
        for use in list(v.uses()):
            r = use.node
            if r is cut or any((o, ax, bd) in planner.memo for o in r.outputs for ax in range(len(static_shape(o) or ()))):
                continue  # the cut, or a node already made of parts (on the way to the cut)
            ax = _forward_axis(r, v, a)
            try:
                if ax is None:
                    raise _Fail("not row by row")
                for o in r.outputs:
                    planner.parts(o, ax, bd)
            except _Fail:
                whole[id(v)] = (v, a)
        if v.is_graph_output():
            whole[id(v)] = (v, a)
    b = planner.b
    rebuilt = {k: b.op("Concat", planner.memo[(v, a, bounds)], {"axis": a}, dtype=v.dtype,
                       shape=list(static_shape(v))).outputs[0] for k, (v, a) in whole.items()}  # type: ignore[arg-type]
    made = set(map(id, b.nodes))
    graph.insert_before(cut, b.nodes)
    for k, new in rebuilt.items():
        v = whole[k][0]
        for u in list(v.uses()):
            if u.node is not cut and id(u.node) not in made:
                u.node.replace_input_with(u.idx, new)
        if v.is_graph_output():
            reroute(graph, v, new)
    for old, new in targets:
        reroute(graph, old, new)
    cut_edges.update(planner.new_edges)
    return True


def slice_span(cut: ir.Node, n: int) -> tuple[int, int]:
    vals = [const(v) for v in cut.inputs[1:3]]
    lo, hi = (int(v.reshape(-1)[0]) for v in vals)  # type: ignore[union-attr]
    lo = min(max(lo + n if lo < 0 else lo, 0), n)
    hi = min(max(hi + n if hi < 0 else hi, 0), n)
    return lo, hi


def split_rows(graph: ir.Graph) -> int:
    """Every Slice and Split along an axis other than the features, computed as its parts where they can be
    traced to where they are made (module docstring). Returns how many cuts went."""
    done = 0
    edges: dict[ir.Value, bool] = {}
    cut_edges: dict[tuple[ir.Value, int, Bounds], list[ir.Value]] = {}
    for node in list(graph):
        if node.graph is None or node.op_type not in ("Slice", "Split") or not _onnx(node):
            continue
        if _cut_once(graph, node, edges, cut_edges):
            done += 1
            remove_dead_nodes(graph)
            graph.sort()
    return done
