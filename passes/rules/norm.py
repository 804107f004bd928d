"""SDGroupNorm and SDLayerNorm.

GroupNorm as the exporters write it (both torch exporters, opset 17-20):

    Reshape(x [B, C, H, W] or [B, C, L] -> [B, G, -1]) -> InstanceNormalization(scale=1, bias=0, eps)
      -> Reshape(-> [B, C, H, W]) -> Mul(gamma [C, 1, 1]) -> Add(beta [C, 1, 1]) [-> SiLU]
    (the second Reshape is gone when it changed nothing, [B, C, L] with G = C: the canonical steps drop it)
    ==> Transpose(NCHW->NHWC) -> SDGroupNorm(x', wts [2C] = gamma ++ beta, nonlinear='Silu' with the SiLU)
        -> Transpose back

InstanceNormalization normalizes each row of its input's first two axes, so any first Reshape whose rows are
whole (sample, group) blocks is a GroupNorm: [B, G, -1], the batch folded in ([1, B*G, -1]), the groups'
channels on an axis of their own ([B, G, C/G, H*W]). The group count is rows / B, never the Reshape's second
axis alone (an earlier version read [1, B*G, -1] as B*G groups and was 0.28 off at an output scale of 2.58).
A row that straddles two samples or splits a channel is declined.

LayerNorm: one ``LayerNormalization`` over the last axis (opset >= 17) ==> SDLayerNorm on the [B, M, K] view
of its input, then a view back to the input's rank where that differs.

RMSNorm as the exporters spell torch's (SD3.5's per-head Q/K norms, T5's layer norms):

    x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2) | x * x, last axis, keepdims) + eps))  [* scale [K]]
    (or x / Sqrt(...))
    ==> SDRMSNorm(x, scale [K], epsilon)   (a scale of ones where the norm has none)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, bmk_view, const, producer, scalar, static_shape, unview
from sdnpu.passes.provenance import step
from sdnpu.passes.rules.activation import silu_after
from sdnpu.passes.rules.base import Match, Rule
from sdnpu.passes.rules.conv import NCHW_TO_NHWC, NHWC_TO_NCHW, nhwc_shape


def _per_channel(v: ir.Value | None, c: int, rank: int) -> np.ndarray | None:
    """A constant that scales the channels (axis 1) of a rank-``rank`` tensor: [C, 1, ..] or [1, C, 1, ..]."""
    a = const(v)
    ones = (1,) * (rank - 2)
    if a is None or a.shape not in ((c, *ones), (1, c, *ones)):
        return None
    return a.reshape(c).astype(np.float32)


class GroupNormFusion(Rule):
    name = "GroupNormFusion"
    anchors = ("Add",)

    def match(self, node: ir.Node) -> Match | str | None:
        for y, beta in (node.inputs, reversed(node.inputs)):
            mul = producer(y, "Mul")
            if mul is None:
                continue
            for z, gamma in (mul.inputs, reversed(mul.inputs)):
                r2 = producer(z, "Reshape")
                inorm = producer(r2.inputs[0] if r2 is not None else z, "InstanceNormalization")
                r1 = producer(inorm.inputs[0], "Reshape") if inorm is not None else None
                if r1 is None:
                    continue
                return self._check(node, mul, r2, inorm, r1, gamma, beta)  # type: ignore[arg-type]
        return None

    def _check(self, add: ir.Node, mul: ir.Node, r2: ir.Node | None, inorm: ir.Node, r1: ir.Node,
               gamma: ir.Value | None, beta: ir.Value | None) -> Match | str:
        x = r1.inputs[0]
        x_shape, grouped = static_shape(x), static_shape(r1.outputs[0])
        if x_shape is None or grouped is None or len(x_shape) not in (3, 4) or len(grouped) < 3:
            return "GroupNorm input is not a static [B, C, H, W] or [B, C, L] tensor"
        if static_shape((r2 if r2 is not None else inorm).outputs[0]) != x_shape:
            return "the reshape after InstanceNormalization does not restore the input shape"
        rows, c = grouped[0] * grouped[1], x_shape[1]  # InstanceNormalization normalizes each row
        groups = rows // x_shape[0]
        if rows % x_shape[0] or not groups or c % groups:
            return (f"the reshape to {list(grouped)} does not cut {list(x_shape)} into whole (sample, group) "
                    "rows")
        scale, bias = const(inorm.inputs[1]), const(inorm.inputs[2])
        if scale is None or bias is None or not (np.all(scale == 1) and np.all(bias == 0)):
            return "InstanceNormalization has a learned scale/bias (not the GroupNorm form)"
        g, bt = _per_channel(gamma, c, len(x_shape)), _per_channel(beta, c, len(x_shape))
        if g is None or bt is None:
            return "gamma/beta are not constant per-channel vectors"
        nodes, out = [r1, inorm, *([r2] if r2 is not None else []), mul, add], add.outputs[0]
        silu = silu_after(out)
        if silu is not None:
            nodes += silu[0]
            out = silu[1]
        eps = float(attr(inorm, "epsilon", 1e-5))
        x4 = (*x_shape, 1) if len(x_shape) == 3 else x_shape
        reason, assumed = self.target.op("group_norm").check({"x": nhwc_shape(x4), "groups": groups})
        if reason:
            return reason
        return Match(nodes, [out], (x, gamma, beta, groups, eps, silu is not None, add.name, assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, gamma, beta, groups, eps, silu, add_name, assumed = m.params
        x_shape = static_shape(x)
        assert x_shape is not None
        flat = len(x_shape) == 3  # the VAE's attention norm sees [B, C, H*W]: run it as [B, C, H*W, 1]
        if flat:
            x_shape = (*x_shape, 1)
            x = b.op("Reshape", [x, b.const(np.asarray(x_shape, np.int64), "shape")], dtype=x.dtype,
                     shape=x_shape).outputs[0]
        c = x_shape[1]
        per_channel = [step("reshape", shape=[c]), step("astype", dtype="float32")]  # as _per_channel reads it
        wts = b.concatenated([(gamma, per_channel), (beta, per_channel)], [2 * c], f"{add_name or 'group_norm'}_wts",
                             dtype=ir.DataType.FLOAT)
        xt = b.op("Transpose", [x], {"perm": NCHW_TO_NHWC}, dtype=x.dtype, shape=nhwc_shape(x_shape))
        attrs = {"input_shape": nhwc_shape(x_shape), "output_shape": nhwc_shape(x_shape), "wts_shape": [2 * c],
                 "gamma_shape": [c], "beta_shape": [c], "epsilon": eps, "groups": groups, "activation": 0,
                 "channels_last": 1}
        if silu:
            attrs["nonlinear"] = "Silu"
        gn = b.dispatch(self.target.op("group_norm").op_type, [xt.outputs[0], wts], attrs, dtype=x.dtype,
                        shape=nhwc_shape(x_shape), assumed=assumed)
        y = b.op("Transpose", [gn.outputs[0]], {"perm": NHWC_TO_NCHW}, dtype=x.dtype, shape=x_shape).outputs[0]
        if flat:
            y = b.op("Reshape", [y, b.const(np.asarray(x_shape[:3], np.int64), "shape")], dtype=x.dtype,
                     shape=x_shape[:3]).outputs[0]
        return [y]


class LayerNormFusion(Rule):
    name = "LayerNormFusion"
    anchors = ("LayerNormalization",)

    def match(self, node: ir.Node) -> Match | str | None:
        shape = static_shape(node.inputs[0])
        if shape is None:
            return "input shape is not static"
        if attr(node, "axis", -1) not in (-1, len(shape) - 1):
            return "normalizes over more than the last axis"
        if any(o.uses() or o.is_graph_output() for o in node.outputs[1:]):
            return "its mean / inverse std outputs are used"
        gamma = node.inputs[1]
        beta = node.inputs[2] if len(node.inputs) > 2 else None
        k = shape[-1]
        if const(gamma) is None or (beta is not None and const(beta) is None):
            return "gamma/beta are not constants"
        if (static_shape(gamma) != (k,) and const(gamma).size != k) or (  # type: ignore[union-attr]
                beta is not None and const(beta).size != k):  # type: ignore[union-attr]
            return "gamma/beta do not hold one value per channel"
        view = bmk_view(shape)
        reason, assumed = self.target.op("layer_norm").check({"x": view})
        if reason:
            return reason
        return Match([node], [node.outputs[0]], (node.inputs[0], gamma, beta, view,
                                                 float(attr(node, "epsilon", 1e-5)), assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, gamma, beta, view, eps, assumed = m.params
        k = view[-1]
        gamma = _vector(b, gamma, k)
        beta = b.const(np.zeros(k, np.float32), f"{gamma.name}_zero_beta") if beta is None else _vector(b, beta, k)
        ln = b.dispatch(self.target.op("layer_norm").op_type, [x, gamma, beta],
                        {"input_shape": view, "output_shape": view, "gamma_shape": [k], "beta_shape": [k],
                         "epsilon": eps, "axis": -1}, dtype=x.dtype, shape=view, assumed=assumed)
        return [unview(b, ln.outputs[0], static_shape(m.outputs[0]))]


def _vector(b: Builder, v: ir.Value, k: int) -> ir.Value:
    if static_shape(v) == (k,):
        return v
    return b.derived(v, [step("astype", dtype="float32"), step("reshape", shape=[k])], [k], f"{v.name}_k",
                     dtype=ir.DataType.FLOAT)


def _rms_chain(v: ir.Value | None) -> tuple[ir.Value, float, list[ir.Node]] | None:
    """(x, eps, nodes) when ``v`` is x normalized by its root mean square over the last axis."""
    node = v.producer() if v is not None else None
    if node is None or node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
        return None
    for x, r in ((node.inputs[0], node.inputs[1]), (node.inputs[1], node.inputs[0])):
        if node.op_type == "Div" and r is not node.inputs[1]:
            continue
        chain = [node]
        if node.op_type == "Mul":
            rec = producer(r, "Reciprocal")
            if rec is None:
                continue
            chain.append(rec)
            r = rec.inputs[0]
        sqrt = producer(r, "Sqrt")
        add = producer(sqrt.inputs[0], "Add") if sqrt is not None else None
        if add is None:
            continue
        for m, e in (add.inputs, reversed(add.inputs)):
            eps, mean = scalar(e), producer(m, "ReduceMean")
            if eps is None or mean is None or attr(mean, "keepdims", 1) != 1:
                continue
            rank = len(static_shape(x) or ())
            axes = const(mean.inputs[1]) if len(mean.inputs) > 1 else np.asarray(attr(mean, "axes", []))
            if axes is None or axes.size != 1 or int(axes.reshape(-1)[0]) % max(rank, 1) != rank - 1:
                continue
            sq = mean.inputs[0].producer() if mean.inputs[0] is not None else None
            squares = sq is not None and sq.inputs[0] is x and (
                (sq.op_type == "Pow" and scalar(sq.inputs[1]) == 2.0)
                or (sq.op_type == "Mul" and sq.inputs[1] is x))
            if squares:
                return x, float(eps), [sq, mean, add, sqrt, *reversed(chain)]  # type: ignore[list-item,arg-type]
    return None


def _per_last_axis(a: np.ndarray | None, k: int) -> bool:
    """One value per channel of the last axis: [K] or [1, .., 1, K]."""
    return a is not None and a.size == k and a.ndim >= 1 and a.shape[-1] == k


class RMSNormFusion(Rule):
    name = "RMSNormFusion"
    anchors = ("Mul", "Div")

    def match(self, node: ir.Node) -> Match | str | None:
        found, scale = None, None
        if node.op_type == "Mul":
            for y, w in (node.inputs, reversed(node.inputs)):
                a = const(w)
                if a is not None and (y.producer() if y is not None else None) is not None:
                    found = _rms_chain(y)
                    if found is not None:
                        scale = w
                        break
        if found is None:
            found = _rms_chain(node.outputs[0])
            if found is None:
                return None
            out = node.outputs[0]
            uses = list(out.uses())
            k = (static_shape(out) or (0,))[-1]
            if len(uses) == 1 and not out.is_graph_output() and uses[0].node.op_type == "Mul" and any(
                    _per_last_axis(const(v), k) for v in uses[0].node.inputs):
                return None  # the Mul by the scale after it takes the whole norm
        x, eps, nodes = found
        shape = static_shape(x)
        if shape is None or not 2 <= len(shape) <= 4:
            return "the input is not a static tensor of rank 2-4"
        k = shape[-1]
        if scale is not None:
            if not _per_last_axis(const(scale), k):
                return None  # a Mul by something else: the norm before it matches alone
            nodes = [*nodes, node]
        reason, assumed = self.target.op("rms_norm").check({"x": shape})
        if reason:
            return reason
        return Match(nodes, [node.outputs[0]], (x, scale, eps, list(shape), assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, scale, eps, shape, assumed = m.params
        k = shape[-1]
        w = b.const(np.ones(k, np.float32), "rms_norm_ones") if scale is None else _vector(b, scale, k)
        node = b.dispatch(self.target.op("rms_norm").op_type, [x, w],
                          {"input_shape": shape, "output_shape": shape, "beta_shape": [k], "epsilon": eps, "axis": -1},
                          dtype=x.dtype, shape=shape, assumed=assumed)
        return [node.outputs[0]]
