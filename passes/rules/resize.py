"""SDResize: nearest-neighbour upsampling by integer factors, in NHWC.

    Resize(x [B, C, H, W], scales [1, 1, s, s] | sizes, mode=nearest)
    ==> Transpose(NCHW->NHWC) -> SDResize(scales [1, s, s, 1]) -> Transpose back
"""

from __future__ import annotations

import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, const, static_shape
from sdnpu.passes.rules.base import Match, Rule
from sdnpu.passes.rules.conv import NCHW_TO_NHWC, NHWC_TO_NCHW, nhwc_shape


def _text(v: object, default: str) -> str:
    if v is None:
        return default
    return v.decode() if isinstance(v, bytes) else str(v)


class SDResizeFusion(Rule):
    name = "SDResizeFusion"
    anchors = ("Resize",)

    def match(self, node: ir.Node) -> Match | str | None:
        x_shape, y_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
        if x_shape is None or y_shape is None or len(x_shape) != 4:
            return "only static 4-D resizes are offloaded"
        if _text(attr(node, "mode"), "nearest") != "nearest":
            return "only nearest-neighbour resizing is offloaded"
        factors = [yo / xi for xi, yo in zip(x_shape, y_shape, strict=True)]
        if factors[:2] != [1, 1] or any(f != int(f) or f < 1 for f in factors[2:]):
            return f"scale factors {factors} are not integer upsampling of H and W"
        if len(node.inputs) > 2 and node.inputs[2] is not None and const(node.inputs[2]) is None:
            return "scales are not constant"
        mode = _text(attr(node, "coordinate_transformation_mode"), "half_pixel")
        nearest = _text(attr(node, "nearest_mode"), "round_prefer_floor")
        return Match([node], [node.outputs[0]], (node.inputs[0], [float(f) for f in factors], mode, nearest))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, factors, mode, nearest = m.params
        xt = b.op("Transpose", [x], {"perm": NCHW_TO_NHWC}, domain="", dtype=x.dtype,
                  shape=nhwc_shape(static_shape(x)))
        y = b.op("SDResize", [xt.outputs[0]], {"scales": [factors[i] for i in NCHW_TO_NHWC], "mode": "nearest",
                                                "coordinate_transformation_mode": mode, "nearest_mode": nearest},
                 dtype=x.dtype, shape=nhwc_shape(static_shape(m.outputs[0])))
        return [b.op("Transpose", [y.outputs[0]], {"perm": NHWC_TO_NCHW}, domain="").outputs[0]]
