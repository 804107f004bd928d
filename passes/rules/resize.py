"""SDResize: 2x nearest-neighbour upsampling, in NHWC.

    Resize(x [B, C, H, W], scales [1, 1, 2, 2] | sizes [B, C, 2H, 2W], mode=nearest)
    ==> Transpose(NCHW->NHWC) -> SDResize(a_shape [B, H, W, C], c_shape [B, 2H, 2W, C]) -> Transpose back

The kernel is keyed by its two shapes; what it computes is torch's nearest upsampling (asymmetric
coordinates, floor), which is what the exporters write. Other modes and factors stay on the CPU. The shapes
alone do not say the factor is 2: a Resize maps output index i back to i / scale, and given ``scales`` its
output is floor(H * scale), so scale 2.4 on H = 2 also writes 4 rows (0, 0, 0, 1 where 2x writes 0, 0, 1, 1).
Given ``scales``, they must be exactly 1 on B and C and 2 on H and W (``axes`` naming which they are); given
``sizes``, the scale is 2H / H = 2 (unless a keep_aspect_ratio_policy other than stretch picks another).
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


def _not_twice(node: ir.Node, rank: int) -> str | None:
    """Why the coordinate map of ``node`` (its output known to be [B, C, 2H, 2W]) may not be i / 2, or None.
    Fuzzer-found: nearest Resize with scales [1, 1, 2.4, 2.4] on 2x2 fused as SDResize, 0.15 off at scale 0.15."""
    sizes = node.inputs[3] if len(node.inputs) > 3 else None
    if sizes is not None:
        policy = _text(attr(node, "keep_aspect_ratio_policy"), "stretch")
        return None if policy == "stretch" else f"keep_aspect_ratio_policy={policy} may scale by other than 2"
    given = const(node.inputs[2] if len(node.inputs) > 2 else None)
    if given is None:
        return "the scales are not constant"
    axes = attr(node, "axes")
    full = [1.0] * rank
    for a, s in zip([int(a) % rank for a in axes] if axes is not None else range(rank), given.reshape(-1).tolist()):
        full[a] = float(s)
    if full == [1.0, 1.0, 2.0, 2.0]:
        return None
    return f"scales {full} are not [1, 1, 2, 2] (output index i reads i / scale)"


class ResizeFusion(Rule):
    name = "ResizeFusion"
    anchors = ("Resize",)

    def match(self, node: ir.Node) -> Match | str | None:
        x_shape, y_shape = static_shape(node.inputs[0]), static_shape(node.outputs[0])
        if x_shape is None or y_shape is None or len(x_shape) != 4:
            return "only static 4-D resizes are offloaded"
        reason, assumed = self.target.op("resize").check({
            "x": nhwc_shape(x_shape), "y": nhwc_shape(y_shape), "mode": _text(attr(node, "mode"), "nearest"),
            "nearest_mode": _text(attr(node, "nearest_mode"), "round_prefer_floor"),
            "coord": _text(attr(node, "coordinate_transformation_mode"), "half_pixel")})
        if reason:
            return reason
        reason = _not_twice(node, len(x_shape))
        if reason:
            return reason
        return Match([node], [node.outputs[0]], (node.inputs[0], assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, assumed = m.params
        x_shape, y_shape = static_shape(x), static_shape(m.outputs[0])
        assert x_shape is not None and y_shape is not None
        xt = b.op("Transpose", [x], {"perm": NCHW_TO_NHWC}, dtype=x.dtype, shape=nhwc_shape(x_shape))
        y = b.dispatch(self.target.op("resize").op_type, [xt.outputs[0]],
                       {"a_shape": nhwc_shape(x_shape), "c_shape": nhwc_shape(y_shape)},
                       dtype=x.dtype, shape=nhwc_shape(y_shape), assumed=assumed)
        return [b.op("Transpose", [y.outputs[0]], {"perm": NHWC_TO_NCHW}, dtype=x.dtype, shape=y_shape).outputs[0]]
