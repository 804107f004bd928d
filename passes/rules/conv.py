"""SDConv: 2-D convolution with constant weights (+ bias), in NHWC.

    Conv(x [B, C, H, W], w [OC, C, KH, KW], b [OC])
    ==> Transpose(x, NCHW->NHWC) -> SDConv(x' [B, H, W, C], w' [OC, KH, KW, C], b) -> Transpose(NHWC->NCHW)

The weight is transposed offline (lazily, at save time); a missing bias is zeros (AMD's packer folds one into
the weight blob either way). The Transposes around the op are the layout boundary: the layout pass cancels
them between neighbouring NHWC ops. A SiLU after the Conv stays a separate SDSilu: the target has no fused
form (only GroupNorm takes one).

AMD's SDConv has no groups and no transposed form (DD src/ops/sd/conv2d.cpp:405-446: IC is the weight's last
axis, tiled by 8, and no ``group`` attribute is read; op_registration_db.def:253-305 registers no deconvolution
among the SD ops), so the other members of the family are written as what it takes, where that is exact and
worth its cost, and declined with the registry's reason otherwise:

- a grouped conv (``group`` G > 1, depthwise when G = C) as the dense conv with a block-diagonal weight
  ``[OC, IC, KH, KW]``: the same sums (the zeros add nothing), G times the multiply-accumulates and the weight.
  Taken where that costs at most ``STACK_OVERHEAD`` (2) times the grouped conv's MACs, as a conv's frames
  stacked in channels are (``sdnpu.passes.canonical.convs``), and the dense weight stays within
  ``_DENSE_LIMIT`` elements (8 MB in bf16), as the average pool's: G <= 2. A depthwise conv (G = C: Stable
  Cascade's and Sana's, C times the MACs; 2048 times and 75 MB a conv at Stable Cascade's full size) stays on
  the CPU with the registry's reason, one CPU island with its layout Transposes and casts: an NPU that
  multiplies C - 1 zeros for every product it needs is no gain, and a tiny model's few channels would hide it;
- a transposed conv whose kernel is its stride s (non-overlapping windows: Kandinsky 3's 2x upsampling,
  an unpatchify), ``ConvTranspose(x [B, C, H, W], w [C, OC, s, s])``: output row ``s i + a``, column
  ``s j + c`` is ``x[:, :, i, j] . w[:, :, a, c]``. So for each row phase a, a 1x1 SDConv with ``s OC``
  outputs (channel ``c OC + o`` = ``w[:, o, a, c]``) gives in NHWC ``[B, H, W, s OC]``, which is
  ``[B, H, 1, s W OC]``: row phase a of the output; the s phases' Concat along that axis is ``[B, H s, W s, OC]``
  read as it lies. s SDConvs and s - 1 SDConcats, the MACs of the ConvTranspose itself, no CPU node. Any other
  ConvTranspose (overlapping windows, padding, output padding, groups, dilation) stays on the CPU with its
  reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.passes.canonical.convs import STACK_OVERHEAD, stacking_reason
from sdnpu.passes.irutil import Builder, attr, const, static_shape
from sdnpu.passes.provenance import step
from sdnpu.passes.rules.base import Match, Rule

NCHW_TO_NHWC = [0, 2, 3, 1]
NHWC_TO_NCHW = [0, 3, 1, 2]


@dataclass(frozen=True)
class ConvParams:
    x: ir.Value
    w: ir.Value
    b: ir.Value | None
    strides: list[int]
    pads: list[int]
    dilations: list[int]
    group: int
    assumed: list[str]
    widths: tuple[tuple[int, int], ...] = ()  # the weight's zero padding to a square kernel (OIHW), if any


def nhwc_shape(shape: tuple[int, ...] | list[int]) -> list[int]:
    return [shape[i] for i in NCHW_TO_NHWC]


class ConvFusion(Rule):
    name = "ConvFusion"
    anchors = ("Conv",)

    def match(self, node: ir.Node) -> Match | str | None:
        x, w = node.inputs[0], node.inputs[1]
        b = node.inputs[2] if len(node.inputs) > 2 else None
        w_shape = static_shape(w)
        if w is None or w.const_value is None or w_shape is None:
            return "the weight is not a constant"
        if len(w_shape) == 5 and static_shape(x) is not None:
            return stacking_reason(node) or "a 3-D convolution: the target's conv is 2-D"
        if len(w_shape) != 4 or static_shape(x) is None or static_shape(node.outputs[0]) is None:
            return "only 2-D convolutions with static shapes are offloaded"
        if b is not None and const(b) is None:
            return "the bias is not a constant"
        if attr(node, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
            return "auto_pad is not supported (the exporters write explicit pads)"
        strides = [int(s) for s in attr(node, "strides", [1, 1])]
        dilations = [int(d) for d in attr(node, "dilations", [1, 1])]
        pads = [int(p) for p in attr(node, "pads", [0, 0, 0, 0])]
        group = int(attr(node, "group", 1))
        oc, icg, kh, kw = w_shape
        widths: tuple[tuple[int, int], ...] = ()
        if kh != kw and min(kh, kw) == 1:  # (K, 1) or (1, K): a temporal conv over its view, a Conv1d
            squared = _squared(kh, kw, strides, dilations, pads)
            if squared is not None:
                widths, pads = squared
                kh = kw = max(kh, kw)
        ic = icg * group  # a grouped conv is taken as the dense one (block-diagonal weight): see the docstring
        reason, assumed = self.target.op("conv").check(
            {"w": (oc, kh, kw, ic), "group": 1, "dilations": dilations, "strides": strides, "pads": pads})
        if reason:
            return reason
        if group > 1 and (group > STACK_OVERHEAD or oc * ic * kh * kw > _DENSE_LIMIT):
            grouped, _ = self.target.op("conv").check(
                {"w": (oc, kh, kw, icg), "group": group, "dilations": dilations, "strides": strides, "pads": pads})
            return (f"{grouped}; as a dense conv its weight would be {oc}x{ic}x{kh}x{kw}, {group} times the "
                    f"grouped conv's multiply-accumulates (taken up to {STACK_OVERHEAD:g} times, as a conv's "
                    "frames stacked in channels are)")
        return Match([node], [node.outputs[0]], ConvParams(x, w, b, strides, pads, dilations, group,  # type: ignore
                                                          assumed, widths))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p: ConvParams = m.params
        w_shape = static_shape(p.w)
        x_shape = static_shape(p.x)
        out_shape = static_shape(m.outputs[0])
        assert w_shape is not None and x_shape is not None and out_shape is not None
        steps = []
        if p.group > 1:  # zeros between the groups make it dense: the same sums, G times the products
            w_shape = (w_shape[0], w_shape[1] * p.group, *w_shape[2:])
            steps.append(step("block_diagonal", groups=p.group))
        if p.widths:  # zero taps around a (K, 1) kernel make it K x K: the same sums, K times the products
            w_shape = tuple(d + lo + hi for d, (lo, hi) in zip(w_shape, p.widths, strict=True))
            steps.append(step("pad", widths=[list(x) for x in p.widths]))
        w = b.derived(p.w, [*steps, step("transpose", perm=[0, 2, 3, 1])], nhwc_shape(w_shape), f"{p.w.name}_ohwi")
        bias = p.b if p.b is not None else b.const(np.zeros(w_shape[0], np.float32), f"{p.w.name}_zero_bias")
        xt = b.op("Transpose", [p.x], {"perm": NCHW_TO_NHWC}, dtype=p.x.dtype, shape=nhwc_shape(x_shape))
        conv = b.dispatch(self.target.op("conv").op_type, [xt.outputs[0], w, bias],
                          {"input_shape": nhwc_shape(x_shape), "output_shape": nhwc_shape(out_shape),
                           "weight_shape": nhwc_shape(w_shape), "strides": p.strides, "pads": p.pads,
                           "dilations": p.dilations, "group": 1, "kernel_shape": list(w_shape[2:])},
                          dtype=p.x.dtype, shape=nhwc_shape(out_shape), assumed=p.assumed)
        back = b.op("Transpose", [conv.outputs[0]], {"perm": NHWC_TO_NCHW}, dtype=p.x.dtype, shape=out_shape)
        return [back.outputs[0]]


def _squared(kh: int, kw: int, strides: list[int], dilations: list[int], pads: list[int]
             ) -> tuple[tuple[tuple[int, int], ...], list[int]] | None:
    """A (K, 1) or (1, K) kernel as K x K (the target's conv is square): zero taps on both sides of the unit
    axis, and as many more zeros of padding there, so each output reads the one real tap at the place it did.
    Exact, at K times the multiply-accumulates. Only where the unit axis has stride and dilation 1."""
    k = max(kh, kw)
    axis = 1 if kw == 1 else 0  # the unit axis: W for (K, 1), H for (1, K)
    if strides[axis] != 1 or dilations[axis] != 1:
        return None
    lo, hi = (k - 1) // 2, k - 1 - (k - 1) // 2
    new = list(pads)
    new[axis] += lo
    new[axis + 2] += hi
    widths = ((0, 0), (0, 0), (lo, hi) if axis == 0 else (0, 0), (lo, hi) if axis == 1 else (0, 0))
    return widths, new


_DENSE_LIMIT = 1 << 22  # elements of the dense weight an average pool becomes (8 MB in bf16)


class PoolFusion(Rule):
    """An average pool over k x k windows as an SDConv with a constant weight: each output channel the mean of
    its own input channel's window (OHWI weight, 1/k^2 on the channel diagonal, exact in bf16 for k = 2),
    Kandinsky's resnet downsampling. The NPU multiplies C times the pool's adds for it (C x C x k x k
    weights); past ``_DENSE_LIMIT`` weight elements the pool stays on the CPU with that reason."""

    name = "PoolFusion"
    anchors = ("AveragePool",)

    def match(self, node: ir.Node) -> Match | str | None:
        x = node.inputs[0]
        x_shape, y_shape = static_shape(x), static_shape(node.outputs[0])
        kernel = [int(k) for k in attr(node, "kernel_shape", [])]
        if x_shape is None or y_shape is None or len(x_shape) != 4 or len(kernel) != 2:
            return "only 2-D average pools of static shape"
        pads = [int(p) for p in attr(node, "pads", [0, 0, 0, 0])]
        if any(pads) and not attr(node, "count_include_pad", 0):
            return "padded windows averaged over their valid values only (count_include_pad=0): no one weight"
        if attr(node, "ceil_mode", 0) or any(int(d) != 1 for d in attr(node, "dilations", [1, 1])) or \
                attr(node, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
            return "ceil_mode, dilations or auto_pad"
        c = x_shape[1]
        if c * c * kernel[0] * kernel[1] > _DENSE_LIMIT:
            return (f"as an SDConv its weight would be {c}x{c}x{kernel[0]}x{kernel[1]} (the target has no "
                    "depthwise convolution)")
        strides = [int(s) for s in attr(node, "strides", [1, 1])]
        reason, assumed = self.target.op("conv").check(
            {"w": (c, kernel[0], kernel[1], c), "group": 1, "dilations": [1, 1], "strides": strides, "pads": pads})
        if reason:
            return reason
        return Match([node], [node.outputs[0]], ConvParams(x, x, None, strides, pads, [1, 1], 1, assumed))  # type: ignore[arg-type]

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p: ConvParams = m.params
        node = m.nodes[0]
        kh, kw = (int(k) for k in attr(node, "kernel_shape"))
        x_shape, out_shape = static_shape(p.x), static_shape(m.outputs[0])
        assert x_shape is not None and out_shape is not None
        c = x_shape[1]
        weight = np.zeros((c, kh, kw, c), np.float32)
        weight[np.arange(c), :, :, np.arange(c)] = 1.0 / (kh * kw)
        w = b.const(weight, "avg_pool_ohwi")
        bias = b.const(np.zeros(c, np.float32), "avg_pool_zero_bias")
        xt = b.op("Transpose", [p.x], {"perm": NCHW_TO_NHWC}, dtype=p.x.dtype, shape=nhwc_shape(x_shape))
        conv = b.dispatch(self.target.op("conv").op_type, [xt.outputs[0], w, bias],
                          {"input_shape": nhwc_shape(x_shape), "output_shape": nhwc_shape(out_shape),
                           "weight_shape": [c, kh, kw, c], "strides": p.strides, "pads": p.pads,
                           "dilations": [1, 1], "group": 1, "kernel_shape": [kh, kw]},
                          dtype=p.x.dtype, shape=nhwc_shape(out_shape), assumed=p.assumed)
        back = b.op("Transpose", [conv.outputs[0]], {"perm": NHWC_TO_NCHW}, dtype=p.x.dtype, shape=out_shape)
        return [back.outputs[0]]


@dataclass(frozen=True)
class TransposedParams:
    x: ir.Value
    w: ir.Value
    b: ir.Value | None
    stride: int
    assumed: list[str]


class TransposedConvFusion(Rule):
    """A ConvTranspose whose kernel is its stride s as s 1x1 SDConvs, one a row phase, and their Concat along
    the row phase (the module's docstring has the algebra): exact, the ConvTranspose's own MACs."""

    name = "TransposedConvFusion"
    anchors = ("ConvTranspose",)

    def match(self, node: ir.Node) -> Match | str | None:
        x, w = node.inputs[0], node.inputs[1]
        b = node.inputs[2] if len(node.inputs) > 2 else None
        w_shape, x_shape, y_shape = static_shape(w), static_shape(x), static_shape(node.outputs[0])
        if w is None or w.const_value is None or w_shape is None:
            return "the weight is not a constant"
        if len(w_shape) != 4 or x_shape is None or y_shape is None:
            return "only 2-D transposed convolutions with static shapes are offloaded"
        if b is not None and const(b) is None:
            return "the bias is not a constant"
        kernel = [int(k) for k in w_shape[2:]]
        strides = [int(s) for s in attr(node, "strides", [1, 1])]
        pads = [int(p) for p in attr(node, "pads", [0, 0, 0, 0])]
        out_pads = [int(p) for p in attr(node, "output_padding", [0, 0])]
        dilations = [int(d) for d in attr(node, "dilations", [1, 1])]
        group = int(attr(node, "group", 1))
        if attr(node, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") or attr(node, "output_shape", None):
            return "auto_pad or output_shape is not supported (the exporters write explicit pads)"
        if kernel != strides or kernel[0] != kernel[1] or any(pads) or any(out_pads) or dilations != [1, 1] \
                or group != 1:
            return (f"ConvTranspose with kernel {kernel}, strides {strides}, pads {pads}, output_padding {out_pads}, "
                    f"dilations {dilations}, group {group}: the target has no transposed conv; only a square "
                    "kernel equal to its stride (non-overlapping windows), unpadded, is written as SDConvs")
        s = kernel[0]
        c, oc = w_shape[0], w_shape[1]
        reason, assumed = self.target.op("conv").check(
            {"w": (s * oc, 1, 1, c), "group": 1, "dilations": [1, 1], "strides": [1, 1], "pads": [0, 0, 0, 0]})
        if reason:
            return reason
        if s > 1 and "concat" not in self.target.families:
            return "the target has no concat to interleave the row phases"
        return Match([node], [node.outputs[0]], TransposedParams(x, w, b, s, assumed))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p: TransposedParams = m.params
        s = p.stride
        x_shape, w_shape, y_shape = static_shape(p.x), static_shape(p.w), static_shape(m.outputs[0])
        assert x_shape is not None and w_shape is not None and y_shape is not None
        n, c, h, wd = x_shape
        oc = w_shape[1]
        xt = b.op("Transpose", [p.x], {"perm": NCHW_TO_NHWC}, dtype=p.x.dtype, shape=[n, h, wd, c])
        if p.b is not None:  # every phase adds the bias to each of its s column phases
            bias = b.derived(p.b, [step("reshape", shape=[1, oc]), step("broadcast", shape=[s, oc]),
                                   step("reshape", shape=[s * oc])], [s * oc], f"{p.b.name}_phases")
        else:
            bias = b.const(np.zeros(s * oc, np.float32), f"{p.w.name}_zero_bias")
        rows = []
        for a in range(s):
            # w [C, OC, s, s] -> row phase a [C, OC, 1, s] -> [s (column phase), OC, C, 1] -> OHWI [s OC, 1, 1, C]
            wa = b.derived(p.w, [step("slice", axis=2, start=a, stop=a + 1), step("transpose", perm=[3, 1, 0, 2]),
                                 step("reshape", shape=[s * oc, 1, 1, c])], [s * oc, 1, 1, c],
                           f"{p.w.name}_row{a}_ohwi")
            conv = b.dispatch(self.target.op("conv").op_type, [xt.outputs[0], wa, bias],
                              {"input_shape": [n, h, wd, c], "output_shape": [n, h, wd, s * oc],
                               "weight_shape": [s * oc, 1, 1, c], "strides": [1, 1], "pads": [0, 0, 0, 0],
                               "dilations": [1, 1], "group": 1, "kernel_shape": [1, 1]},
                              dtype=p.x.dtype, shape=[n, h, wd, s * oc], assumed=p.assumed)
            row = b.op("Reshape", [conv.outputs[0], b.const(np.asarray([n, h, 1, wd * s * oc], np.int64), "shape")],
                       dtype=p.x.dtype, shape=[n, h, 1, wd * s * oc])
            rows.append(row.outputs[0])
        y = rows[0] if s == 1 else b.op("Concat", rows, {"axis": 2}, dtype=p.x.dtype,
                                        shape=[n, h, s, wd * s * oc]).outputs[0]
        nhwc = b.op("Reshape", [y, b.const(np.asarray([n, h * s, wd * s, oc], np.int64), "shape")],
                    dtype=p.x.dtype, shape=[n, h * s, wd * s, oc])
        back = b.op("Transpose", [nhwc.outputs[0]], {"perm": NHWC_TO_NCHW}, dtype=p.x.dtype, shape=y_shape)
        return [back.outputs[0]]
