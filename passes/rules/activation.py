"""Activations: SiLU, GELU (Gelu op; the Erf form is canonicalized to it first), CLIP's quick_gelu, and
the GEGLU gate of the transformer feed-forward.

    SDSilu(x)      = x · sigmoid(x)                       Mul(x, Sigmoid(x))
    SDQuickGelu(x) = x · sigmoid(1.702 x)                 Mul(x, Sigmoid(Mul(x, 1.702)))
    SDGelu(x)      = gelu(x)                              Gelu(x)  (opset 20)
    SDGeGLU(x)     = h · gelu(g), (h, g) = halves of x    Split (dynamo) or two Slices (TorchScript)
"""

from __future__ import annotations

import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, const, producer, scalar, static_shape
from sdnpu.passes.rules.base import Match, Rule


def silu_after(v: ir.Value) -> tuple[list[ir.Node], ir.Value] | None:
    """If ``v`` feeds exactly a SiLU (Sigmoid(v) and Mul(v, sigmoid)), its two nodes and output. Not when
    the sigmoid is read elsewhere too: the op before would then not fuse at all (a shared intermediate),
    where without the SiLU it does."""
    uses = list(v.uses())
    if v.is_graph_output() or len(uses) != 2:
        return None
    sig = next((u.node for u in uses if u.node.op_type == "Sigmoid"), None)
    mul = next((u.node for u in uses if u.node.op_type == "Mul"), None)
    if sig is None or mul is None or sig.domain not in ("", "ai.onnx") or mul.domain not in ("", "ai.onnx"):
        return None
    if sig.outputs[0].is_graph_output() or len(sig.outputs[0].uses()) != 1:
        return None
    if set(mul.inputs) != {v, sig.outputs[0]}:
        return None
    return [sig, mul], mul.outputs[0]


def _other(node: ir.Node, v: ir.Value | None) -> ir.Value | None:
    a, b = node.inputs
    return b if a is v else a


class SDSiluFusion(Rule):
    name = "SDSiluFusion"
    anchors = ("Mul",)

    def match(self, node: ir.Node) -> Match | str | None:
        for x, s in (node.inputs, reversed(node.inputs)):
            sig = producer(s, "Sigmoid")
            if sig is not None and sig.inputs[0] is x:
                return Match([sig, node], [node.outputs[0]], x)
        return None

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        return [b.op("SDSilu", [m.params]).outputs[0]]


class SDQuickGeluFusion(Rule):
    name = "SDQuickGeluFusion"
    anchors = ("Mul",)

    def match(self, node: ir.Node) -> Match | str | None:
        for x, s in (node.inputs, reversed(node.inputs)):
            sig = producer(s, "Sigmoid")
            inner = producer(sig.inputs[0], "Mul") if sig is not None else None
            if inner is None:
                continue
            c = scalar(_other(inner, x))
            if x in inner.inputs and c is not None and abs(c - 1.702) < 1e-3:
                if static_shape(node.outputs[0]) != static_shape(x):  # a [1, 1, ..] constant raised the rank
                    return "the constant broadcasts x to another shape"
                return Match([inner, sig, node], [node.outputs[0]], x)  # type: ignore[list-item]
        return None

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        return [b.op("SDQuickGelu", [m.params]).outputs[0]]


class SDGeluFusion(Rule):
    name = "SDGeluFusion"
    anchors = ("Gelu",)

    def match(self, node: ir.Node) -> Match | str | None:
        return Match([node], [node.outputs[0]], (node.inputs[0], attr(node, "approximate", "none")))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, approx = m.params
        return [b.op("SDGelu", [x], {"approximate": approx}).outputs[0]]


def _halves(h: ir.Value, g: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """``(x, nodes)`` when h and g are the first and second halves of x's last axis."""
    hs, gs = h.producer(), g.producer()
    if hs is None or gs is None:
        return None
    x_shape = static_shape(hs.inputs[0])
    if x_shape is None:
        return None
    last = len(x_shape) - 1
    if hs is gs and hs.op_type == "Split" and len(hs.outputs) == 2:  # dynamo
        axis = attr(hs, "axis", 0) % len(x_shape)
        sizes = const(hs.inputs[1]) if len(hs.inputs) > 1 and hs.inputs[1] is not None else None
        even = sizes is None or (len(sizes) == 2 and sizes[0] == sizes[1])
        if axis == last and even and hs.outputs[0] is h and hs.outputs[1] is g:
            return hs.inputs[0], [hs]  # type: ignore[return-value]
        return None
    if hs.op_type == gs.op_type == "Slice" and hs.inputs[0] is gs.inputs[0]:  # TorchScript
        n = x_shape[last] // 2

        def span(node: ir.Node) -> tuple[int, int] | None:
            vals = [const(v) for v in node.inputs[1:]]
            if any(v is None or v.size != 1 for v in vals[:3] if v is not None) or len(vals) < 3:
                return None
            start, end, axes = (int(v.reshape(())) for v in vals[:3])  # type: ignore[union-attr]
            steps = int(vals[3].reshape(())) if len(vals) > 3 and vals[3] is not None else 1
            if axes % len(x_shape) != last or steps != 1:
                return None
            return start, min(end, x_shape[last])

        if span(hs) == (0, n) and span(gs) == (n, 2 * n):
            return hs.inputs[0], [hs, gs]  # type: ignore[return-value]
    return None


class SDGeGLUFusion(Rule):
    name = "SDGeGLUFusion"
    anchors = ("Mul",)

    def match(self, node: ir.Node) -> Match | str | None:
        for h, gl in (node.inputs, reversed(node.inputs)):
            gelu = producer(gl, "Gelu")
            if gelu is None or h is None:
                continue
            found = _halves(h, gelu.inputs[0])  # type: ignore[arg-type]
            if found is not None:
                x, split_nodes = found
                return Match([*split_nodes, gelu, node], [node.outputs[0]],
                             (x, attr(gelu, "approximate", "none")))
        return None

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, approx = m.params
        return [b.op("SDGeGLU", [x], {"approximate": approx}).outputs[0]]
