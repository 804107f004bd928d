"""SDRMSNorm: SDRMSNorm(x, w, eps') = x / sqrt(mean(x^2) + eps') * w over x's last axis (D values).
Spelled as the exporters write torch's RMSNorm (SD3.5's per-head Q/K norms, T5), a hand-written RMS norm and
``F.normalize`` (Qwen-Image's and Wan's VAEs: ``F.normalize(x, dim=1) * sqrt(C) * gamma``):

    x * Reciprocal(D) | x / D, where the denominator D is
      Sqrt(ReduceMean(x^2) [+ e])                 an RMS norm (x^2: Pow(x, 2) or x * x), eps inside
      Sqrt(ReduceSum(x^2) [+ e]), ReduceL2(x)     an L2 norm: sqrt(D) times the RMS norm
      Clip(L, min=e) | Max(L, e) | L + e          for a root L of the two above: eps outside the root
      [Expand(..., x's shape)]                    F.normalize's broadcast back
    [* c]  a scalar c = sqrt(D) after an L2 norm: the RMS norm itself (Qwen-Image's ``* self.scale``)
    [* w]  one weight per normalized channel       ==> SDRMSNorm(x, w | ones, eps')

With k = 1 for a mean and k = D for a sum, sqrt(k * mean + e) = sqrt(k) * sqrt(mean + e / k): eps' = e / k and
the output scaled by 1 / sqrt(k) (a weight of 1/sqrt(D) where no c = sqrt(D) follows; a weight w after such an
unscaled L2 norm stays an element-wise Mul). Eps outside the root is not the op's formula: max(L, e) and L + e
are taken as sqrt(L^2 + e^2) (eps' = e^2 / k), which is max(L, e) within a factor 1 + (e / L)^2 / 2 and L + e
within 1 + e / L: within bf16's rounding (2^-9) but for norms L below 16 e, or 512 e. Both are taken where that
norm is at most TINY_NORM = 1.6e-5, nothing but a vector that is 0 at bf16's resolution: e <= 1e-6 clamping
(F.normalize's 1e-12), e <= 3.1e-8 added (1e-8); declined with that reason above it. A zero vector stays 0
either way (e^2 / k is at least float32's smallest normal, else declined). The normalized axis is the last one,
or the channels (axis 1 of a [B, C, *S] tensor: Qwen-Image's VAE), which the NHWC layout puts last: the same view
and Transposes as SDGroupNorm's. Any other axis, or several, is declined with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, bmk_view, const, producer, scalar, static_shape, unview
from sdnpu.passes.rules.base import Declined, Match, Rule
from sdnpu.passes.rules.conv import nhwc_shape
from sdnpu.passes.rules.norm import as_vector, channels_first, channels_last, channels_view, only_reader, per_channel


TINY_NORM = 1.6e-5  # an eps outside the root may change the norm beyond bf16's rounding only below it (docstring)


@dataclass
class _Root:
    """The denominator of a norm of ``x``: sqrt(k * mean(x^2 over axes) + eps_in) [max'd or added with eps_out],
    k = D for a sum of squares (an L2 norm), 1 for a mean."""

    x: ir.Value
    axes: list[int]
    summed: bool
    eps_in: float
    eps_out: float
    added: bool  # eps_out added to the root (L + e), not clamping it (max(L, e))
    nodes: list[ir.Node]  # in graph order


def _squared(v: ir.Value | None) -> tuple[ir.Value, ir.Node] | None:
    """(x, node) where ``v`` is x^2: Pow(x, 2) or x * x."""
    sq = producer(v)
    if sq is None or sq.domain not in ("", "ai.onnx"):
        return None
    if sq.op_type == "Pow" and scalar(sq.inputs[1]) == 2.0:
        return sq.inputs[0], sq  # type: ignore[return-value]
    if sq.op_type == "Mul" and sq.inputs[0] is sq.inputs[1]:
        return sq.inputs[0], sq  # type: ignore[return-value]
    return None


def _with_scalar(node: ir.Node | None, *op_types: str) -> tuple[ir.Value, float] | None:
    """(v, e) where ``node`` is op(v, e) or op(e, v) for a one-value constant e."""
    if node is None or node.op_type not in op_types or len(node.inputs) != 2:
        return None
    for v, e in (node.inputs, reversed(node.inputs)):
        value = scalar(e)
        if value is not None and const(v) is None:
            return v, value  # type: ignore[return-value]
    return None


def _root(d: ir.Value | None) -> _Root | None:
    nodes: list[ir.Node] = []
    node = producer(d)
    if node is not None and node.op_type == "Expand":  # F.normalize's broadcast back to x's shape
        nodes.append(node)
        node = producer(node.inputs[0])
    eps_out, added = 0.0, False
    clip = node if node is not None and node.op_type == "Clip" and len(node.inputs) >= 2 and (
        len(node.inputs) == 2 or node.inputs[2] is None) else None
    outside = _with_scalar(node, "Max", "Add")
    if clip is not None and scalar(clip.inputs[1]) is not None:  # Clip(L, min=e): clamp_min, F.normalize
        nodes.append(clip)
        eps_out, node = float(scalar(clip.inputs[1])), producer(clip.inputs[0])  # type: ignore[arg-type]
    elif outside is not None:  # Max(L, e), L + e
        nodes.append(node)  # type: ignore[arg-type]
        eps_out, added, node = outside[1], node.op_type == "Add", producer(outside[0])  # type: ignore[union-attr]
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    eps_in, summed = 0.0, True
    if node.op_type == "ReduceL2":
        reduce, x = node, node.inputs[0]
        nodes.append(node)
    elif node.op_type == "Sqrt":
        nodes.append(node)
        inner = producer(node.inputs[0])
        inside = _with_scalar(inner, "Add")
        if inside is not None:
            nodes.append(inner)  # type: ignore[arg-type]
            eps_in, inner = inside[1], producer(inside[0])
        if inner is None or inner.domain not in ("", "ai.onnx"):
            return None
        reduce = inner
        if inner.op_type == "ReduceSumSquare":
            x = inner.inputs[0]
            nodes.append(inner)
        elif inner.op_type in ("ReduceMean", "ReduceSum"):
            sq = _squared(inner.inputs[0])
            if sq is None:
                return None
            x = sq[0]
            nodes += [inner, sq[1]]
            summed = inner.op_type == "ReduceSum"
        else:
            return None
    else:
        return None
    if attr(reduce, "keepdims", 1) != 1 or x is None:
        return None
    given = const(reduce.inputs[1]) if len(reduce.inputs) > 1 and reduce.inputs[1] is not None \
        else attr(reduce, "axes")
    rank = len(static_shape(x) or ())
    axes = list(range(rank)) if given is None or np.size(given) == 0 else [int(a) for a in np.ravel(given)]
    return _Root(x, axes, summed, eps_in, eps_out, added, list(reversed(nodes)))


def _norm(node: ir.Node) -> _Root | None:
    """The norm ``node`` ends: x / D or x * Reciprocal(D), D a root of x's squares (``_root``)."""
    if node.op_type == "Div":
        pairs = [(node.inputs[0], node.inputs[1], [])]
    else:
        pairs = []
        for x, r in (node.inputs, reversed(node.inputs)):
            rec = producer(r, "Reciprocal")
            if rec is not None:
                pairs.append((x, rec.inputs[0], [rec]))
    for x, d, chain in pairs:
        root = _root(d)
        if root is not None and root.x is x and static_shape(node.outputs[0]) == static_shape(x):
            root.nodes += [*chain, node]
            return root
    return None


def _the_other(node: ir.Node, v: ir.Value) -> np.ndarray | None:
    """The constant ``node`` multiplies ``v`` by, where it keeps ``v``'s shape."""
    if static_shape(node.outputs[0]) != static_shape(v) or len(node.inputs) != 2:
        return None
    other = node.inputs[1] if node.inputs[0] is v else node.inputs[0]
    return const(other) if other is not v else None


@dataclass(frozen=True)
class RMSNormParams:
    x: ir.Value
    axis: int  # the last axis, or 1: the channels, last in NHWC
    scale: ir.Value | None  # a weight per channel, or None: ``unit`` for each
    unit: float  # 1, or 1 / sqrt(D) for an L2 norm no sqrt(D) scales
    eps: float
    assumed: list[str]


class RMSNormFusion(Rule):
    name = "RMSNormFusion"
    anchors = ("Mul", "Div")

    def match(self, node: ir.Node) -> Match | str | None:
        root = _norm(node)
        if root is None:
            return None
        nodes, x = root.nodes, root.x
        shape = static_shape(x)
        if shape is None:
            return Declined("the input shape is not static", nodes)
        rank = len(shape)
        axes = sorted({a % rank for a in root.axes})
        if len(axes) != 1:
            return Declined(f"the norm reduces axes {axes} of {list(shape)}: SDRMSNorm normalizes one", nodes)
        axis = axes[0]
        if axis != rank - 1 and not (axis == 1 and rank >= 3):
            return Declined(f"normalizes axis {axis} of {list(shape)}: SDRMSNorm normalizes the last axis, or the "
                            "channels (axis 1) through the NHWC layout", nodes)
        factor = 512 if root.added else 16  # where sqrt(L^2 + e^2) leaves L + e, or max(L, e), by 2^-9
        if root.eps_out * factor > TINY_NORM:
            return Declined(f"eps {root.eps_out:g} {'added to' if root.added else 'clamping'} the norm outside the "
                            f"square root (SDRMSNorm's is inside): the two differ by more than bf16's rounding for "
                            f"norms below {factor} x eps = {factor * root.eps_out:.2g}", nodes)
        k = shape[axis] if root.summed else 1
        eps = (root.eps_in + root.eps_out ** 2) / k
        if (root.eps_in or root.eps_out) and eps < np.finfo(np.float32).tiny:
            return Declined(f"eps {root.eps_out or root.eps_in:g} is below float32's range as SDRMSNorm's epsilon: a "
                            "zero vector would give 0 / 0", nodes)
        unit, out, scale = float(k) ** -0.5, node.outputs[0], None
        after = only_reader(out, "Mul")
        c = _the_other(after, out) if after is not None and unit != 1 else None
        if c is not None and c.size == 1 and c.dtype.kind == "f" and \
                abs(float(c.reshape(())) * unit - 1) <= 4 * float(np.finfo(c.dtype).eps):  # c = sqrt(D)
            nodes, out, unit = [*nodes, after], after.outputs[0], 1.0  # type: ignore[union-attr]
            after = only_reader(out, "Mul")
        if after is not None and unit == 1:
            w = after.inputs[1] if after.inputs[0] is out else after.inputs[0]
            a = _the_other(after, out)
            if a is not None and (per_channel(w, shape[axis], rank) is not None if axis != rank - 1
                                  else a.ndim <= rank and _per_last_axis(a, shape[axis])):
                nodes, out, scale = [*nodes, after], after.outputs[0], w
        view = _rms_view(shape, axis)
        reason, assumed = self.target.op("rms_norm").check({"x": view})
        if reason:
            return Declined(reason, nodes)
        return Match(nodes, [out], RMSNormParams(x, axis, scale, unit, eps, assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p: RMSNormParams = m.params
        shape = static_shape(p.x)
        assert shape is not None
        k, view = shape[p.axis], _rms_view(shape, p.axis)
        if p.scale is not None:
            w = as_vector(b, p.scale, k)
        else:
            w = b.const(np.full(k, p.unit, np.float32), "rms_norm_ones" if p.unit == 1 else "l2_norm_unit")
        x = unview(b, p.x, tuple(view)) if p.axis == len(shape) - 1 else channels_last(b, p.x, shape)
        node = b.dispatch(self.target.op("rms_norm").op_type, [x, w],
                          {"input_shape": view, "output_shape": view, "beta_shape": [k], "epsilon": p.eps,
                           "axis": -1}, dtype=p.x.dtype, shape=view, assumed=p.assumed)
        y = node.outputs[0]
        return [unview(b, y, shape) if p.axis == len(shape) - 1 else channels_first(b, y, shape)]


def _rms_view(shape: tuple[int, ...], axis: int) -> list[int]:
    """What SDRMSNorm reads: x itself (rank 2-4) or its [B, M, K] view for the last axis; [B, S1, S2, C] for
    the channels."""
    if axis != len(shape) - 1:
        return nhwc_shape(channels_view(shape))
    return list(shape) if 2 <= len(shape) <= 4 else bmk_view(shape)


def _per_last_axis(a: np.ndarray | None, k: int) -> bool:
    """One value per channel of the last axis: [K] or [1, .., 1, K]."""
    return a is not None and a.size == k and a.ndim >= 1 and a.shape[-1] == k
