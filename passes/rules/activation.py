"""GEGLU, the gate of the transformer feed-forward, written with the target's ops; and the SiLU pattern the
GroupNorm rule absorbs.

    (h, g) = halves of proj(x) = x·W + b along the last axis (Split: dynamo; two Slices: TorchScript)
    y = h · gelu(g)
    ==> SDGemm(x, W[:, :N], b[:N]) = h,  SDGemm(x, W[:, N:], b[N:], nonlinear='Gelu') = gelu(g),  SDMul

The projection is split into its two halves offline, so no slice is needed (the target's SDSlice has no
offsets): this is what AMD's SDXL shape lists show (SDGemm [640 -> 2560] for a 5120-wide projection, SDMul
of two [2, 4096, 2560] halves, no SDXL SDGelu). Where the halves do not come from a linear layer, the pieces
stay for the glue pass (the Gelu and the Mul become SDGelu and SDMul; the split stays on the CPU).
"""

from __future__ import annotations

import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, const, producer, static_shape, unview
from sdnpu.passes.rules.base import Match, Rule
from sdnpu.passes.rules.gemm import GemmParams, emit_gemm, gemm_checked


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
        even = (sizes is None and x_shape[last] % 2 == 0) or (sizes is not None and len(sizes) == 2
                                                               and sizes[0] == sizes[1])
        if axis == last and even and hs.outputs[0] is h and hs.outputs[1] is g:
            return hs.inputs[0], [hs]  # type: ignore[return-value]
        return None
    if hs.op_type == gs.op_type == "Slice" and hs.inputs[0] is gs.inputs[0]:  # TorchScript
        if x_shape[last] % 2:
            return None
        n = x_shape[last] // 2

        def span(node: ir.Node) -> tuple[int, int] | None:
            vals = [const(v) for v in node.inputs[1:]]
            if len(vals) < 3 or any(v is None or v.size != 1 for v in vals[:3]):
                return None
            start, end, axes = (int(v.reshape(())) for v in vals[:3])  # type: ignore[union-attr]
            steps = int(vals[3].reshape(())) if len(vals) > 3 and vals[3] is not None else 1
            if axes % len(x_shape) != last or steps != 1:
                return None
            return start, min(end, x_shape[last])

        if span(hs) == (0, n) and span(gs) == (n, 2 * n):
            return hs.inputs[0], [hs, gs]  # type: ignore[return-value]
    return None


def _linear_producer(rule: Rule, x: ir.Value) -> Match | str | None:
    """The linear layer writing ``x``: MatMul with a constant [K, 2N] weight, maybe + a bias."""
    p = x.producer()
    if p is None or p.domain not in ("", "ai.onnx"):
        return None
    if p.op_type == "Add":
        for y, bias in (p.inputs, reversed(p.inputs)):
            mm = producer(y, "MatMul")
            w = static_shape(mm.inputs[1]) if mm is not None else None
            c = const(bias)
            if mm is None or mm.inputs[1] is None or mm.inputs[1].const_value is None or w is None or len(w) != 2 \
                    or c is None or c.size != w[1] or static_shape(p.outputs[0]) != static_shape(mm.outputs[0]):
                continue
            return gemm_checked(rule, [mm, p], p, mm.inputs[0], mm.inputs[1], bias, False)
        return None
    if p.op_type == "MatMul" and p.inputs[1] is not None and p.inputs[1].const_value is not None \
            and len(static_shape(p.inputs[1]) or ()) == 2:
        return gemm_checked(rule, [p], p, p.inputs[0], p.inputs[1], None, False)
    return None


class GeGLUFusion(Rule):
    name = "GeGLUFusion"
    anchors = ("Mul",)

    def match(self, node: ir.Node) -> Match | str | None:
        for h, gl in (node.inputs, reversed(node.inputs)):
            gelu = producer(gl, "Gelu")
            if gelu is None or h is None:
                continue
            found = _halves(h, gelu.inputs[0])  # type: ignore[arg-type]
            if found is None:
                continue
            x, split_nodes = found
            proj = _linear_producer(self, x)
            if proj is None:
                return None  # not a linear layer's output: the glue pass takes the Gelu and the Mul
            if isinstance(proj, str):
                return proj
            out_shape = static_shape(node.outputs[0])
            if out_shape is None or static_shape(h) != out_shape:
                return "the gate's product broadcasts to another shape"
            return Match([*proj.nodes, *split_nodes, gelu, node], [node.outputs[0]],
                         (proj.params, attr(gelu, "approximate", "none")))
        return None

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p, approximate = m.params
        assert isinstance(p, GemmParams)
        half = p.n // 2
        h = emit_gemm(b, p, None, columns=slice(0, half))
        nonlinear = "Gelu" if approximate in ("none", b"none") else None
        g = emit_gemm(b, p, None, nonlinear=nonlinear, columns=slice(half, p.n))
        if nonlinear is None:  # tanh GELU: SDGelu after the gate's half (an assumed form, see the table)
            shape = static_shape(g)
            assert shape is not None
            reason, assumed = self.target.op("gelu").check({"x": list(shape), "approximate": "tanh"})
            assert reason is None, reason
            g = b.dispatch(self.target.op("gelu").op_type, [g],
                           {"input_shape": list(shape), "output_shape": list(shape), "approximate": "tanh"},
                           dtype=g.dtype, shape=shape, assumed=assumed).outputs[0]
        shape = static_shape(h)
        assert shape is not None
        y = b.dispatch(self.target.op("mul").op_type, [h, g],
                       {"a_shape": list(shape), "b_shape": list(shape), "c_shape": list(shape)},
                       dtype=h.dtype, shape=shape).outputs[0]
        return [unview(b, y, static_shape(m.outputs[0]))]
