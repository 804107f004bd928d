"""SDGroupNorm and SDLayerNorm.

GroupNorm as the exporters write it (both torch exporters, opset 17-20):

    Reshape(x [B, C, H, W] or [B, C, L] -> [B, G, -1]) -> InstanceNormalization(scale=1, bias=0, eps)
      -> Reshape(-> [B, C, H, W]) -> Mul(gamma [C, 1, 1]) -> Add(beta [C, 1, 1]) [-> SiLU]
    (the second Reshape is gone when it changed nothing, [B, C, L] with G = C: canonicalize drops it)
    ==> Transpose(NCHW->NHWC) -> SDGroupNorm(x', gamma [C], beta [C], groups, eps, silu) -> Transpose back

LayerNorm: one ``LayerNormalization`` over the last axis at opset >= 17 ==> SDLayerNorm.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, const, producer, static_shape
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


class SDGroupNormFusion(Rule):
    name = "SDGroupNormFusion"
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
        if x_shape is None or grouped is None or len(x_shape) not in (3, 4) or len(grouped) != 3:
            return "GroupNorm input is not a static [B, C, H, W] or [B, C, L] tensor"
        if static_shape((r2 if r2 is not None else inorm).outputs[0]) != x_shape:
            return "the reshape after InstanceNormalization does not restore the input shape"
        c, groups = x_shape[1], grouped[1]
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
        return Match(nodes, [out], (x, g, bt, groups, eps, silu is not None, mul.name, add.name))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, g, bt, groups, eps, silu, mul_name, add_name = m.params
        x_shape = static_shape(x)
        assert x_shape is not None
        flat = len(x_shape) == 3  # the VAE's attention norm sees [B, C, H*W]: run it as [B, C, H*W, 1]
        if flat:
            x_shape = (*x_shape, 1)
            x = b.op("Reshape", [x, b.const(np.asarray(x_shape, np.int64), "shape")], domain="", dtype=x.dtype,
                     shape=x_shape).outputs[0]
        gv = b.const(g, f"{mul_name or 'group_norm'}_gamma")
        bv = b.const(bt, f"{add_name or 'group_norm'}_beta")
        xt = b.op("Transpose", [x], {"perm": NCHW_TO_NHWC}, domain="", dtype=x.dtype, shape=nhwc_shape(x_shape))
        gn = b.op("SDGroupNorm", [xt.outputs[0], gv, bv], {"groups": [groups], "epsilon": eps, "silu": int(silu)},
                  dtype=x.dtype, shape=nhwc_shape(x_shape))
        y = b.op("Transpose", [gn.outputs[0]], {"perm": NHWC_TO_NCHW}, domain="", dtype=x.dtype,
                 shape=x_shape).outputs[0]
        if flat:
            y = b.op("Reshape", [y, b.const(np.asarray(x_shape[:3], np.int64), "shape")], domain="").outputs[0]
        return [y]


class SDLayerNormFusion(Rule):
    name = "SDLayerNormFusion"
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
        if const(gamma) is None or (beta is not None and const(beta) is None):
            return "gamma/beta are not constants"
        return Match([node], [node.outputs[0]], (node.inputs[0], gamma, beta, shape[-1],
                                                 float(attr(node, "epsilon", 1e-5))))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, gamma, beta, c, eps = m.params
        if beta is None:
            beta = b.const(np.zeros(c, np.float32), f"{gamma.name}_zero_beta")
        return [b.op("SDLayerNorm", [x, gamma, beta], {"epsilon": eps}).outputs[0]]
