"""SDGemm: a linear layer with constant weights, on the [B, M, K] view of its input, with everything after it
that is still linear in its columns.

    MatMul(x [.., K], w [K, N]) [+ b [N]]   (dynamo, TorchScript: weights already [K, N])
    Gemm(x [B, K], w [N, K], b, transB=1)    (the time embeddings)
    ==> SDGemm(x viewed [B, M, K], w [K, N], b [N]) [-> a view back to x's rank]

The layer's output z [R rows, N columns] is followed down through the ops that keep it a linear layer of x:

- *views* (Reshape): the same numbers, another shape;
- *constants added or subtracted* that are the same for every row once read in z's layout (a bias, PixArt's
  AdaLN-single table added to the [B, 6, C] view of its projection, the ``1 +`` of ``x * (1 + scale)``):
  they fold into the bias where the target's bias holds the sum exactly (``folds_exactly``), else they are
  added after the layer, as the module computes it (see below);
- *parts* (a Split, or Slices with steps of one, through the views): each part that is a block of z's
  columns for every row (SD3's and Flux's AdaLayerNorm chunks, a scale-shift resnet's [B, 2C, 1, 1] chunked
  along C) becomes an SDGemm of its own over those columns of the weight and bias: the same MACs, no Slice
  (DD's SDSlice is keyed on shapes alone and cannot say which part it takes). Each part is followed down
  again.

**The bias's precision.** SDGemm's bias is bf16 (the registry's type list). A constant folded into it is rounded
with it: ``bf16(b + 1)`` keeps the learned bias only to bf16's spacing at 1 (2^-7, an error up to 2^-8), where
the module in bf16 (PyTorch's bf16 run, or the layer then an Add) keeps ``bf16(b)`` to its own spacing and
rounds once more after the ``+ 1``. Folded, the modulation ``1 + scale`` carries two roundings at 1's scale (the
bias's and the output's) where the module carries one: about 1.4x its error in every conditional norm's scale,
a per-channel error that no later op averages out (Kandinsky 3's conditional GroupNorms, measured with
``bench/trace_bf16.py``). So the constants fold only where the rounded sum is the rounded parts' sum exactly
(a zero or absent bias and a constant bf16 holds, as the ``1 +`` of a bias-free projection). In the order they
are added, each constant joins the bias, or the Add before it, while the sum stays exact, else it starts an
Add of its own after the layer (the glue's SDAdd): the module's order.

Each value where the walk stops gets its SDGemm (viewed back to that value's shape). A layer without a bias
gets a zero one, as AMD's pass writes a fake bias (its SDXL shape lists have SDGemm, not SDMatMul, for the
bias-free Q/K/V projections); transB is folded into the weight offline. A MatMul of two activations has no
dispatch op on this target (SDMatMul takes a constant weight) and stays on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx_ir as ir
from sdnpu.passes import movement, provenance
from sdnpu.passes.irutil import Builder, attr, bmk_view, const, is_float, static_shape, unview
from sdnpu.passes.provenance import Step, step
from sdnpu.passes.rules.base import Match, Rule


def _bias(v: ir.Value | None, n: int) -> bool:
    c = const(v)
    return c is not None and c.size == n and c.shape[-1:] == (n,)


def _weight(v: ir.Value | None) -> tuple[int, int] | None:
    shape = static_shape(v)
    if v is None or v.const_value is None or shape is None or len(shape) != 2:
        return None
    return shape  # type: ignore[return-value]


@dataclass(frozen=True)
class GemmParams:
    x: ir.Value
    w: ir.Value
    bias: ir.Value | None
    trans: bool
    k: int
    n: int
    view: list[int]
    assumed: list[str]


@dataclass
class Leaf:
    """A value the rewrite replaces: columns [start, stop) of the layer's output, read as ``value``'s shape,
    with the constants ``extra`` (value, steps to a [stop - start] vector) added to them."""

    value: ir.Value
    start: int
    stop: int
    extra: list[tuple[ir.Value, list[Step]]] = field(default_factory=list)


def gemm_checked(rule: Rule, nodes: list[ir.Node], last: ir.Node, x: ir.Value | None, w: ir.Value | None,
                 bias: ir.Value | None, trans: bool) -> Match | str:
    """The match of a linear layer once its nodes are known (shared with the GEGLU rule's projection)."""
    x_shape, w_shape = static_shape(x), static_shape(w)
    if x is None or w is None or x_shape is None or w_shape is None or not is_float(x):
        return "the input is not a float tensor of static shape"
    if not x_shape:
        return "a scalar input: SDGemm views its input as [B, M, K]"  # any rank >= 1 views so (a video's 5-D too)
    k, n = (w_shape[1], w_shape[0]) if trans else w_shape
    view = bmk_view(x_shape)
    reason, assumed = rule.target.op("gemm").check({"x": view})
    if reason:
        return reason
    return Match(nodes, [last.outputs[0]], GemmParams(x, w, bias, trans, k, n, view, assumed))


def emit_gemm(b: Builder, p: GemmParams, out_shape: tuple[int, ...] | None, nonlinear: str | None = None,
              columns: slice | None = None, extra: list[tuple[ir.Value, list[Step]]] | None = None) -> ir.Value:
    """SDGemm for ``p`` (``columns``: only those output columns, as GEGLU's halves; ``extra``: constants added
    to the bias, each as a vector over those columns), viewed back to ``out_shape``."""
    w, bias, n = p.w, p.bias, p.n
    cols = columns or slice(0, n)
    width = cols.stop - cols.start
    if p.trans or columns is not None:
        steps = [step("transpose", perm=[1, 0])] if p.trans else []
        if columns is not None:
            steps.append(step("slice", axis=1, start=cols.start, stop=cols.stop))
        w = b.derived(w, steps, [p.k, width],
                      f"{w.name}_kn" if columns is None else f"{w.name}_{cols.start}_{cols.stop}")
    parts: list[tuple[ir.Value, list[Step]]] = []
    if bias is not None:
        own = [] if static_shape(bias) == (width,) else [
            step("astype", dtype="float32"), step("reshape", shape=[n]), step("slice", axis=0, start=cols.start,
                                                                              stop=cols.stop)]
        parts.append((bias, own))
    groups = [parts]  # the bias's, then each Add's after the layer: in order, each as long as its sum is exact
    for e in extra or []:
        if folds_exactly(b, [*groups[-1], e], width):
            groups[-1].append(e)
        else:
            groups.append([e])
    parts = groups[0]
    if not parts:
        bias = b.const(np.zeros(width, np.float32), f"{w.name}_zero_bias")
    elif len(parts) == 1 and not parts[0][1]:
        bias = parts[0][0]
    else:
        first = parts[0]
        if first[0].dtype != ir.DataType.FLOAT:  # the sum is taken in fp32, as the kernel adds its bias
            parts[0] = (first[0], [*first[1], step("astype", dtype="float32")])
        bias = b.summed(parts, [width], f"{w.name}_bias_{cols.start}", dtype=ir.DataType.FLOAT)
    attrs: dict[str, object] = {"input_shape": p.view, "output_shape": [*p.view[:2], width],
                                "weight_shape": [p.k, width], "bias_enable": 1}
    if nonlinear:
        attrs["nonlinear"] = nonlinear
    node = b.dispatch(b.target.op("gemm").op_type, [p.x, w, bias], attrs, dtype=p.x.dtype, shape=[*p.view[:2], width],
                      assumed=p.assumed)
    y = node.outputs[0]
    for added in groups[1:]:
        vector = b.summed(added, [width], f"{w.name}_added_{cols.start}", dtype=ir.DataType.FLOAT)
        if p.x.dtype not in (None, ir.DataType.FLOAT):  # the Add's operands share the activation's type (fp16)
            vector = b.derived(vector, [step("astype", dtype=np.dtype(p.x.dtype.numpy()).name)], [width],
                               f"{vector.name}_{np.dtype(p.x.dtype.numpy()).name}", p.x.dtype)
        y = b.op("Add", [y, vector], dtype=p.x.dtype, shape=[*p.view[:2], width]).outputs[0]
    return unview(b, y, out_shape)


def folds_exactly(b: Builder, parts: list[tuple[ir.Value, list[Step]]], width: int) -> bool:
    """Whether the layer's bias and the constants added after it (``parts``: each a value and the steps to its
    [width] vector) can be one bias of the target's gemm without losing what each holds: true where the bias
    input is wider than bf16, or where the sum rounded to bf16 is exactly the sum of the parts rounded to bf16
    (the parameters as a bf16 run of the module holds them)."""
    assert b.target is not None
    spec = b.target.op("gemm")
    if len(spec.inputs) < 3 or spec.inputs[2].dtype != "bfloat16":
        return True
    vectors = []
    for v, steps in parts:
        c = const(v)
        if c is None:
            return False
        vectors.append(np.asarray(provenance.apply(steps, c), np.float64).reshape(width))

    def bf16(a: np.ndarray) -> np.ndarray:
        return a.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    return bool(np.array_equal(bf16(np.sum(vectors, axis=0)), np.sum([bf16(v) for v in vectors], axis=0)))


def _row_vector(c: np.ndarray, shape: tuple[int, ...], rows: int, width: int) -> list[Step] | None:
    """Steps that turn the constant ``c`` (broadcast to ``shape``, a view of a [rows, width] block) into the
    [width] vector it adds to every row, or None where rows would get different values."""
    try:
        full = np.broadcast_to(c, shape)
    except ValueError:
        return None
    if full.shape != tuple(shape):
        return None
    block = full.reshape(rows, width)
    if not np.all(block == block[:1]):
        return None
    cast = [] if c.dtype == np.float32 else [step("astype", dtype="float32")]
    if c.shape[-1:] == (width,) and c.size == width:  # a bias: [N], or [1, .., 1, N]
        return cast + ([step("reshape", shape=[width])] if c.shape != (width,) else [])
    return [*cast, step("broadcast", shape=list(shape)), step("reshape", shape=[rows, width]),
            step("slice", axis=0, start=0, stop=1), step("reshape", shape=[width])]


def _part_columns(node: ir.Node, shape: tuple[int, ...], rows: int, width: int) -> list[tuple[int, int]] | None:
    """For a Split or Slice of a value of ``shape`` (a view of a [rows, width] block): the block's columns
    each of its outputs holds, where each is a block of columns of every row, read in order."""
    idx = movement.index_tensor(shape)
    if idx is None:
        return None
    axis_of = attr(node, "axis", 0)
    if node.op_type == "Split":
        sizes = const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        axis = axis_of % len(shape)
        if sizes is None:
            outs = [static_shape(o) for o in node.outputs]
            if any(o is None for o in outs):
                return None
            sizes = np.asarray([o[axis] for o in outs])  # type: ignore[index]
        bounds = np.concatenate([[0], np.cumsum(sizes.reshape(-1))])
        pieces = [np.take(idx, np.arange(int(lo), int(hi)), axis=axis) for lo, hi in zip(bounds[:-1], bounds[1:])]
    elif node.op_type == "Slice":
        vals = [const(v) if v is not None else None for v in node.inputs[1:]]
        if len(vals) < 2 or any(v is None for v in vals[:2]) or any(
                v is None for v, given in zip(vals[2:], node.inputs[3:]) if given is not None):
            return None
        starts, ends = vals[0].reshape(-1), vals[1].reshape(-1)  # type: ignore[union-attr]
        axes = vals[2].reshape(-1) if len(vals) > 2 and vals[2] is not None else np.arange(starts.size)
        steps = vals[3].reshape(-1) if len(vals) > 3 and vals[3] is not None else np.ones(starts.size, np.int64)
        if np.any(steps != 1):
            return None
        index = [slice(None)] * len(shape)
        for a, lo, hi in zip(axes, starts, ends, strict=True):
            index[int(a) % len(shape)] = slice(int(max(min(lo, 2**62), -2**62)), int(max(min(hi, 2**62), -2**62)))
        pieces = [idx[tuple(index)]]
    else:
        return None
    out = []
    grid = idx.reshape(rows, width)
    for piece in pieces:
        if piece.size == 0 or piece.size % rows:
            return None
        start = int(piece.reshape(-1)[0]) % width
        n = piece.size // rows
        if start + n > width or not np.array_equal(piece.reshape(-1), grid[:, start:start + n].reshape(-1)):
            return None
        out.append((start, start + n))
    return out


def _step_into(user: ir.Node, value: ir.Value, shape: tuple[int, ...], rows: int, width: int
               ) -> tuple[str, object] | None:
    """What ``user`` (a reader of ``value``) does to the layer's columns: ("view", None), ("add", steps to the
    [width] vector it adds), ("parts", the column blocks of its outputs), or None (it ends the walk)."""
    if user.domain not in ("", "ai.onnx"):
        return None
    out_shape = static_shape(user.outputs[0])
    if user.op_type in ("Split", "Slice") and user.inputs[0] is value:
        cut = _part_columns(user, shape, rows, width)
        return ("parts", cut) if cut is not None else None
    if user.op_type == "Reshape" and user.inputs[0] is value and out_shape is not None:
        return "view", None
    if user.op_type == "Add" and len(user.inputs) == 2 and out_shape is not None and out_shape != shape:
        spread = _spread(user, value, shape, out_shape, rows, width)
        return ("spread", spread) if spread is not None else None
    if user.op_type in ("Add", "Sub") and len(user.inputs) == 2 and out_shape == shape:
        other = user.inputs[1] if user.inputs[0] is value else user.inputs[0]
        c = const(other)
        if c is None or other is value or (user.op_type == "Sub" and user.inputs[0] is not value):
            return None
        steps = _row_vector(c, shape, rows, width)
        if steps is None:
            return None
        return "add", [*steps, step("neg")] if user.op_type == "Sub" else steps
    return None


def _spread(add: ir.Node, value: ir.Value, shape: tuple[int, ...], out_shape: tuple[int, ...], rows: int,
            width: int) -> list[tuple[ir.Value, list[Step]]] | None:
    """``value`` plus a constant that spreads it along an axis where it has size 1, the result cut back into
    pieces of ``value``'s shape along that axis (PixArt's final ``table [1, 2, C] + emb [B, 1, C]``, chunked
    into shift and scale): each piece is the layer's columns plus a constant of its own. Returns (piece, steps
    to the [width] vector added to it) for every piece, or None."""
    other = add.inputs[1] if add.inputs[0] is value else add.inputs[0]
    c = const(other)
    out = add.outputs[0]
    wide = [a for a, (d, e) in enumerate(zip(shape, out_shape)) if d != e] if len(shape) == len(out_shape) else []
    if c is None or len(wide) != 1 or shape[wide[0]] != 1 or out.is_graph_output():
        return None
    axis = wide[0]
    pieces: list[tuple[ir.Value, list[Step]]] = []
    for use in out.uses():
        cut = use.node
        if cut.op_type not in ("Split", "Slice") or cut.domain not in ("", "ai.onnx") or use.idx != 0:
            return None
        spans = _part_columns(cut, out_shape, int(np.prod(out_shape[:axis])) or 1,
                              int(np.prod(out_shape[axis:])))  # the cut's pieces, read along the spread axis
        if spans is None:
            return None
        step_len = int(np.prod(out_shape[axis + 1:]))
        for piece, (lo, hi) in zip(cut.outputs, spans, strict=True):
            if static_shape(piece) != shape or hi - lo != step_len or lo % step_len:
                return None
            j = lo // step_len
            try:
                block = np.broadcast_to(c, out_shape).take([j], axis=axis).reshape(rows, width)
            except ValueError:
                return None
            if not np.all(block == block[:1]):
                return None
            pieces.append((piece, [step("astype", dtype="float32"), step("broadcast", shape=list(out_shape)),
                                   step("slice", axis=axis, start=j, stop=j + 1), step("reshape", shape=[rows, width]),
                                   step("slice", axis=0, start=0, stop=1), step("reshape", shape=[width])]))
    return pieces or None


def _cuts_ahead(user: ir.Node, st: tuple[str, object], value: ir.Value, start: int, stop: int, rows: int,
                extra: list[tuple[ir.Value, list[Step]]]) -> bool:
    """Whether following ``user`` reaches a cut of the layer's columns (a Split or Slice into parts)."""
    if st[0] in ("parts", "spread"):
        return True
    nodes: list[ir.Node] = []
    leaves: list[Leaf] = []
    follow(user.outputs[0], start, stop, rows, extra, nodes, leaves, True)
    return any((leaf.start, leaf.stop) != (start, stop) for leaf in leaves)


def follow(value: ir.Value, start: int, stop: int, rows: int, extra: list[tuple[ir.Value, list[Step]]],
           nodes: list[ir.Node], leaves: list[Leaf], fan_out: bool = False) -> None:
    """Walk down from ``value`` (columns [start, stop) of the layer's output, ``extra`` added) through views,
    added row constants and column parts, collecting the nodes passed and the values where the walk stops.
    With ``fan_out`` (a projection of one vector per batch item: cheap to repeat), each reader of a value
    read by several is followed on its own, and gets its own SDGemm (PixArt's one AdaLN-single projection,
    read by every block through its own table and chunks); else a value read by several (but for its parts)
    ends the walk."""
    width = stop - start
    shape = static_shape(value)
    users = list(dict.fromkeys(u.node for u in value.uses()))
    steps = [] if shape is None else [(u, _step_into(u, value, shape, rows, width)) for u in users]
    cuts_all = bool(steps) and all(st is not None and st[0] == "parts" for _, st in steps)
    if shape is None or value.is_graph_output() or not users or (len(users) > 1 and not fan_out and not cuts_all):
        leaves.append(Leaf(value, start, stop, extra))
        return
    rest = False
    for user, st in steps:
        if st is None:
            rest = True
            continue
        kind, arg = st
        if len(users) > 1 and not cuts_all and not _cuts_ahead(user, st, value, start, stop, rows, extra):
            rest = True  # repeating the layer for this reader would only save a view or an add: not worth its MACs
            continue
        nodes.append(user)
        if kind == "parts":
            for out, (lo, hi) in zip(user.outputs, arg, strict=True):  # type: ignore[call-overload]
                part = [(v, [*s, step("slice", axis=0, start=lo, stop=hi)]) for v, s in extra]
                follow(out, start + lo, start + hi, rows, part, nodes, leaves, fan_out)
        elif kind == "spread":
            other = user.inputs[1] if user.inputs[0] is value else user.inputs[0]
            nodes += list(dict.fromkeys(u.node for u in user.outputs[0].uses()))
            for piece, piece_steps in arg:  # type: ignore[attr-defined]
                follow(piece, start, stop, rows, [*extra, (other, piece_steps)], nodes, leaves, fan_out)
        elif kind == "view":
            follow(user.outputs[0], start, stop, rows, extra, nodes, leaves, fan_out)
        else:
            other = user.inputs[1] if user.inputs[0] is value else user.inputs[0]
            follow(user.outputs[0], start, stop, rows, [*extra, (other, arg)], nodes, leaves, fan_out)  # type: ignore[list-item]
    if rest:  # the readers the walk does not go into read this value itself
        leaves.append(Leaf(value, start, stop, extra))


class GemmFusion(Rule):
    name = "GemmFusion"
    anchors = ("MatMul", "Gemm")

    def match(self, node: ir.Node) -> Match | str | None:
        if node.op_type == "MatMul":
            w = _weight(node.inputs[1])
            if w is None:
                return None
            found = gemm_checked(self, [node], node, node.inputs[0], node.inputs[1], None, False)
        else:
            if attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0 or attr(node, "beta", 1.0) != 1.0:
                return "Gemm with transA, alpha or beta other than the defaults"
            w = _weight(node.inputs[1])
            if w is None:
                return "the weight is not a constant"
            bias = node.inputs[2] if len(node.inputs) > 2 else None
            trans = bool(attr(node, "transB", 0))
            if bias is not None and not _bias(bias, w[0] if trans else w[1]):
                return "the bias is not a constant vector"
            found = gemm_checked(self, [node], node, node.inputs[0], node.inputs[1], bias, trans)
        if not isinstance(found, Match):
            return found
        p: GemmParams = found.params
        out_shape = static_shape(node.outputs[0])
        if out_shape is None:
            return "the output has no static shape"
        rows = int(np.prod(out_shape[:-1])) if len(out_shape) > 1 else 1
        nodes: list[ir.Node] = [node]
        leaves: list[Leaf] = []
        follow(node.outputs[0], 0, p.n, rows, [], nodes, leaves, fan_out=p.view[1] == 1)
        order = {id(n): i for i, n in enumerate(node.graph)} if node.graph is not None else {}

        def position(leaf: Leaf) -> int:
            made_by = leaf.value.producer()
            return order.get(id(made_by), -1) if made_by is not None else -1

        leaves.sort(key=position)
        return Match(nodes, [leaf.value for leaf in leaves], (p, leaves))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p, leaves = m.params
        out = []
        for leaf in leaves:
            whole = leaf.start == 0 and leaf.stop == p.n
            out.append(emit_gemm(b, p, static_shape(leaf.value), columns=None if whole else slice(leaf.start, leaf.stop),
                                 extra=leaf.extra))
        return out
