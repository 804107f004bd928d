"""Sinusoids: the sinusoidal embeddings (diffusers' ``get_timestep_embedding``, CogView4's size conditions) in one
form, fewer CPU nodes (Sin and Cos have no dispatch op; these run on the CPU in fp32).

- ``Concat(Slice(C, h:), Slice(C, :h))`` of ``C = Concat(P1, P2)``, each slice one part, is ``Concat(P2, P1)``
  (diffusers' ``flip_sin_to_cos``, as the exporters write it);
- ``Concat(Sin(x f), Cos(x f))`` along the last axis is one ``Sin(x f' + phase)``, with cos(a) written as
  sin(a + pi/2): the same numbers to fp32 rounding of the argument (|a| <= ~1000 rad: below 1e-4), in three
  CPU nodes instead of four to seven;
- the same element-wise chain applied to several inputs' columns and concatenated (CogView4's original size,
  crop and target size) is the chain applied once to the inputs' Concat, bit for bit.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes.canonical.driver import RULE, graph_of, node_rewrite
from sdnpu.passes.irutil import Builder, attr, const, producer, replace, reroute, static_shape


@node_rewrite("sin/cos halves reordered", "Concat")
def unflip_concat(node: ir.Node) -> bool:
    """Concat(Slice(C, h:), Slice(C, :h)) of C = Concat(P1, P2) along one axis, each slice one part ->
    Concat(P2, P1) (diffusers' flip_sin_to_cos, as the exporters write it)."""
    slices = [producer(v, "Slice") for v in node.inputs]
    if not slices or any(s is None for s in slices):
        return False
    src = slices[0].inputs[0]  # type: ignore[union-attr]
    cat = producer(src, "Concat")
    shape = static_shape(src)
    if cat is None or shape is None or any(s.inputs[0] is not src for s in slices):  # type: ignore[union-attr]
        return False
    rank = len(shape)
    axis = attr(cat, "axis", 0) % rank
    if attr(node, "axis", 0) % rank != axis:
        return False
    bounds, start = [], 0
    for part in cat.inputs:
        part_shape = static_shape(part)
        if part_shape is None:
            break
        bounds.append((start, start + part_shape[axis]))
        start += part_shape[axis]
    picked = []
    for sl in slices:
        vals = [const(v) if v is not None else None for v in sl.inputs[1:]]  # type: ignore[union-attr]
        if len(vals) < 3 or any(v is None or v.size != 1 for v in vals[:3]):
            return False
        steps = vals[3] if len(vals) > 3 and vals[3] is not None else np.ones(1)
        s0, e0, ax = (int(np.asarray(v).reshape(())) for v in vals[:3])
        if ax % rank != axis or int(np.asarray(steps).reshape(())) != 1:
            return False
        span = (s0 % shape[axis] if s0 < 0 else s0, min(e0 if e0 >= 0 else e0 + shape[axis], shape[axis]))
        if span not in bounds:
            return False
        picked.append(cat.inputs[bounds.index(span)])
    graph = graph_of(node)
    b = Builder(graph, RULE)
    new = b.op("Concat", picked, {"axis": axis}, dtype=node.outputs[0].dtype, shape=static_shape(node.outputs[0]))
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [new.outputs[0]])
    return True


@node_rewrite("sinusoids -> one Sin", "Concat")
def merge_sinusoids(node: ir.Node) -> bool:
    """Concat(Sin(a) | Cos(a), ...) along the last axis with a = Mul(x, f), f a constant along that axis ->
    Sin(Mul(x, f') + phase), f' the parts' f side by side and phase pi/2 where a part is a cosine."""
    out_shape = static_shape(node.outputs[0])
    if out_shape is None or attr(node, "axis", 0) % len(out_shape) != len(out_shape) - 1:
        return False
    trig = [producer(v, "Sin") or producer(v, "Cos") for v in node.inputs]
    if any(t is None for t in trig):
        return False
    arg = trig[0].inputs[0]  # type: ignore[union-attr]
    mul = producer(arg, "Mul")
    if mul is None or any(t.inputs[0] is not arg for t in trig):  # type: ignore[union-attr]
        return False
    x, f = (mul.inputs if const(mul.inputs[1]) is not None else reversed(mul.inputs))  # type: ignore[misc]
    fv, x_shape, a_shape = const(f), static_shape(x), static_shape(arg)
    if fv is None or x_shape is None or a_shape is None or x.dtype != ir.DataType.FLOAT:
        return False
    d = a_shape[-1]
    if fv.shape[-1:] != (d,) or any(s != 1 for s in fv.shape[:-1]) or (x_shape and x_shape[-1] != 1):
        return False
    if len(fv.shape) > len(a_shape) or tuple(a_shape[:-1]) != tuple(np.broadcast_shapes(x_shape, fv.shape)[:-1]):
        return False
    freqs = np.concatenate([fv.reshape(-1)] * len(trig)).astype(np.float32)
    phase = np.concatenate([np.full(d, np.pi / 2 if t.op_type == "Cos" else 0.0)  # type: ignore[union-attr]
                            for t in trig]).astype(np.float32)
    shape = [1] * (len(fv.shape) - 1) + [len(freqs)]
    graph = graph_of(node)
    b = Builder(graph, RULE)
    scaled = b.op("Mul", [x, b.const(freqs.reshape(shape), "sinusoid_freqs")], dtype=x.dtype, shape=out_shape)
    shifted = b.op("Add", [scaled.outputs[0], b.const(phase.reshape(shape), "sinusoid_phase")], dtype=x.dtype,
                   shape=out_shape)
    y = b.op("Sin", [shifted.outputs[0]], dtype=x.dtype, shape=out_shape)
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [y.outputs[0]])
    return True


_AFFINE = frozenset({"Mul", "Add", "Sub", "Div"})
_CHAIN_UNARY = frozenset({"Sin", "Cos", "Neg", "Exp", "Sigmoid", "Tanh"})


def _column_chain(y: ir.Value) -> tuple[ir.Value, list[tuple[str, int, np.ndarray, ir.Value]], int] | None:
    """``y = Reshape(E(Reshape(x, [N k, 1])), [N, k F])`` with ``E`` element-wise ops whose other operand is a
    constant row [1, F] or [F] (a sinusoid's frequencies and phase), or unary (its Sin): (x, E's steps as
    (op, side of the constant or -1, its values, the constant or the unary's input), F), or None. Every
    value on the way has one reader."""
    outer = y.producer()
    v: ir.Value | None = y
    if outer is not None and outer.op_type == "Reshape" and outer.domain in ("", "ai.onnx"):
        v = outer.inputs[0]  # (a column of one, k = 1, has no Reshape either side: they were dropped)
    sy, sv = static_shape(y), static_shape(v)
    if v is None or sy is None or sv is None or len(sy) != 2 or len(sv) != 2 or (v is not y and len(v.uses()) != 1):
        return None
    f = sv[1]
    steps: list[tuple[str, int, np.ndarray, ir.Value]] = []
    while (p := v.producer()) is not None and p.op_type in _AFFINE | _CHAIN_UNARY and p.domain in ("", "ai.onnx"):
        if p.op_type in _CHAIN_UNARY:
            if p.attributes:
                return None
            steps.append((p.op_type, -1, np.zeros(0), p.inputs[0]))  # type: ignore[arg-type]
            v = p.inputs[0]
            if v is None or len(v.uses()) != 1:
                return None
            continue
        side = next((i for i, w in enumerate(p.inputs) if w is not None and w.const_value is not None), None)
        if side is None or len(p.inputs) != 2:
            return None
        c = p.inputs[side]
        cv = const(c)
        if cv is None or cv.size != f or (cv.ndim == 2 and cv.shape[0] != 1) or cv.ndim > 2:
            return None
        steps.append((p.op_type, side, cv.reshape(-1), c))  # type: ignore[arg-type]
        v = p.inputs[1 - side]
        if v is None or len(v.uses()) != 1:
            return None
    col = v
    x = v
    while (inner := x.producer()) is not None and inner.op_type == "Reshape" and inner.domain in ("", "ai.onnx") \
            and inner.inputs[0] is not None and len(x.uses()) == 1:
        x = inner.inputs[0]  # the column, through a chain of Reshapes ([N, k] -> [N k] -> [N k, 1])
    if not steps:
        return None
    sx, sc = static_shape(x), static_shape(col)
    if x is None or sx is None or len(sx) != 2 or sc != (sx[0] * sx[1], 1) or sy != (sx[0], sx[1] * f):
        return None
    return x, steps[::-1], f


@node_rewrite("parallel column chains -> one", "Concat", sweep_before=True, sweep_after=True)
def merge_column_chains(node: ir.Node) -> bool:
    """A Concat (along the features, 2-D) of the same element-wise chain applied to several inputs' columns,
    each flattened to [N k_i, 1], scaled by a row of constants and viewed back as [N, k_i F] (CogView4's
    original size, crop and target size sinusoids: three chains of four CPU nodes), is the chain applied once
    to the inputs' Concat: the rows of ``Concat(x_i)`` flattened are the chains' rows in the Concat's order,
    so every value is the same number. One chain of five CPU nodes instead of four per input and the Concat.
    The dead nodes go first: the chains count their values' readers, and the sinusoids' old halves still read
    them."""
    if len(node.inputs) < 2:
        return False
    y = node.outputs[0]
    sy = static_shape(y)
    if sy is None or len(sy) != 2 or int(attr(node, "axis", 0)) % 2 != 1:
        return False
    chains = [_column_chain(v) for v in node.inputs if v is not None]
    if len(chains) != len(node.inputs) or any(c is None for c in chains):
        return False
    first = chains[0]
    assert first is not None
    same = all(c is not None and c[2] == first[2] and len(c[1]) == len(first[1]) and all(
        a[0] == b[0] and a[1] == b[1] and np.array_equal(a[2], b[2]) for a, b in zip(c[1], first[1], strict=True))
        and c[0].dtype == first[0].dtype and static_shape(c[0])[0] == static_shape(first[0])[0]  # type: ignore[index]
        for c in chains)
    if not same:
        return False
    n, f = static_shape(first[0])[0], first[2]  # type: ignore[index]
    k = sum(static_shape(c[0])[1] for c in chains)  # type: ignore[index, union-attr]
    graph = graph_of(node)
    b = Builder(graph, RULE)
    v = b.op("Concat", [c[0] for c in chains], {"axis": 1}, dtype=first[0].dtype, shape=[n, k]).outputs[0]  # type: ignore[union-attr]
    v = b.op("Reshape", [v, b.const(np.asarray([n * k, 1], np.int64), "shape")], dtype=v.dtype,
             shape=[n * k, 1]).outputs[0]
    for op, side, _, c in first[1]:
        ins = [v] if side < 0 else [c, v] if side == 0 else [v, c]
        v = b.op(op, ins, dtype=y.dtype, shape=[n * k, f]).outputs[0]
    v = b.op("Reshape", [v, b.const(np.asarray([n, k * f], np.int64), "shape")], dtype=y.dtype,
             shape=[n, k * f]).outputs[0]
    graph.insert_before(node, b.nodes)
    reroute(graph, y, v)
    graph.remove(node, safe=True)
    return True
