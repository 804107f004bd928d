"""SDGemm: a linear layer with constant weights, on the [B, M, K] view of its input.

    MatMul(x [.., K], w [K, N]) [+ b [N]]   (dynamo, TorchScript: weights already [K, N])
    Gemm(x [B, K], w [N, K], b, transB=1)    (the time embeddings)
    ==> SDGemm(x viewed [B, M, K], w [K, N], b [N]) [-> a view back to x's rank]

A layer without a bias gets a zero one, as AMD's pass writes a fake bias (its SDXL shape lists have SDGemm,
not SDMatMul, for the bias-free Q/K/V projections); transB is folded into the weight offline. A MatMul of
two activations has no dispatch op on this target (SDMatMul takes a constant weight) and stays on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, bmk_view, const, is_float, producer, static_shape, unview
from sdnpu.passes.provenance import step
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


def gemm_checked(rule: Rule, nodes: list[ir.Node], last: ir.Node, x: ir.Value | None, w: ir.Value | None,
                 bias: ir.Value | None, trans: bool) -> Match | str:
    """The match of a linear layer once its nodes are known (shared with the GEGLU rule's projection)."""
    x_shape, w_shape = static_shape(x), static_shape(w)
    if x is None or w is None or x_shape is None or w_shape is None or not is_float(x):
        return "the input is not a float tensor of static shape"
    if not 1 <= len(x_shape) <= 4:
        return f"input rank {len(x_shape)}: SDGemm views its input as [B, M, K]"
    k, n = (w_shape[1], w_shape[0]) if trans else w_shape
    view = bmk_view(x_shape)
    reason, assumed = rule.target.spec("SDGemm").check({"x": view})
    if reason:
        return reason
    return Match(nodes, [last.outputs[0]], GemmParams(x, w, bias, trans, k, n, view, assumed))


def emit_gemm(b: Builder, p: GemmParams, out_shape: tuple[int, ...] | None, nonlinear: str | None = None,
              columns: slice | None = None) -> ir.Value:
    """SDGemm for ``p`` (``columns``: only those output columns, as GEGLU's halves), viewed back to
    ``out_shape``."""
    w, bias, n = p.w, p.bias, p.n
    cols = columns or slice(0, n)
    width = cols.stop - cols.start
    if p.trans or columns is not None:
        steps = [step("transpose", perm=[1, 0])] if p.trans else []
        if columns is not None:
            steps.append(step("slice", axis=1, start=cols.start, stop=cols.stop))
        w = b.derived(w, steps, [p.k, width],
                      f"{w.name}_kn" if columns is None else f"{w.name}_{cols.start}_{cols.stop}")
    if bias is None:
        bias = b.const(np.zeros(width, np.float32), f"{w.name}_zero_bias")
    elif static_shape(bias) != (width,):
        bias = b.derived(bias, [step("astype", dtype="float32"), step("reshape", shape=[n]),
                                step("slice", axis=0, start=cols.start, stop=cols.stop)], [width],
                         f"{bias.name}_{cols.start}", dtype=ir.DataType.FLOAT)
    attrs: dict[str, object] = {"input_shape": p.view, "output_shape": [*p.view[:2], width],
                                "weight_shape": [p.k, width], "bias_enable": 1}
    if nonlinear:
        attrs["nonlinear"] = nonlinear
    node = b.dispatch("SDGemm", [p.x, w, bias], attrs, dtype=p.x.dtype, shape=[*p.view[:2], width],
                      assumed=p.assumed)
    return unview(b, node.outputs[0], out_shape)


class SDGemmFusion(Rule):
    name = "SDGemmFusion"
    anchors = ("Add", "MatMul", "Gemm")

    def match(self, node: ir.Node) -> Match | str | None:
        if node.op_type == "Add":
            for y, bias in (node.inputs, reversed(node.inputs)):
                mm = producer(y, "MatMul")
                w = _weight(mm.inputs[1]) if mm is not None else None
                if mm is None or w is None or not _bias(bias, w[1]):
                    continue
                if static_shape(node.outputs[0]) != static_shape(mm.outputs[0]):  # a [1, 1, N] bias, 2-D x
                    return "the bias broadcasts the product to a higher rank"
                return gemm_checked(self, [mm, node], node, mm.inputs[0], mm.inputs[1], bias, False)
            return None
        if node.op_type == "MatMul":
            w = _weight(node.inputs[1])
            if w is None:
                return None
            uses = list(node.outputs[0].uses())
            if len(uses) == 1 and uses[0].node.op_type == "Add" and not node.outputs[0].is_graph_output():
                add = uses[0].node
                other = add.inputs[1] if add.inputs[0] is node.outputs[0] else add.inputs[0]
                if _bias(other, w[1]) and static_shape(add.outputs[0]) == static_shape(node.outputs[0]):
                    return None  # the Add anchor takes MatMul + bias together
            return gemm_checked(self, [node], node, node.inputs[0], node.inputs[1], None, False)
        # Gemm
        if attr(node, "transA", 0) or attr(node, "alpha", 1.0) != 1.0 or attr(node, "beta", 1.0) != 1.0:
            return "Gemm with transA, alpha or beta other than the defaults"
        w = _weight(node.inputs[1])
        if w is None:
            return "the weight is not a constant"
        bias = node.inputs[2] if len(node.inputs) > 2 else None
        trans = bool(attr(node, "transB", 0))
        if bias is not None and not _bias(bias, w[0] if trans else w[1]):
            return "the bias is not a constant vector"
        return gemm_checked(self, [node], node, node.inputs[0], node.inputs[1], bias, trans)

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        return [emit_gemm(b, m.params, static_shape(m.outputs[0]))]


class SDGemmSplitFusion(Rule):
    """A linear layer whose output is cut into parts along its features (SD3's AdaLayerNorm: one projection of
    the conditioning chunked into shift, scale and gate for each stream):

        Split(Linear(x) [.., N], axis=-1) -> parts [.., n_i]
        ==> one SDGemm per part, with its columns of the weight and bias (the same MACs, no Split)

    DD's SDSlice cannot take these parts (it is keyed on shapes alone, and the parts share one shape)."""

    name = "SDGemmSplitFusion"
    anchors = ("Split",)

    def match(self, node: ir.Node) -> Match | str | None:
        y = node.inputs[0]
        shape = static_shape(y)
        linear = y.producer() if y is not None else None
        if shape is None or linear is None or linear.op_type not in ("Gemm", "MatMul", "Add"):
            return None
        axis = attr(node, "axis", 0)
        if axis % len(shape) != len(shape) - 1:
            return None
        found = SDGemmFusion(self.target).match(linear)
        if not isinstance(found, Match):
            return found
        sizes = [static_shape(o) for o in node.outputs]
        if any(s is None for s in sizes) or sum(s[-1] for s in sizes) != shape[-1]:  # type: ignore[index]
            return "the parts' widths are not static or do not add up to the layer's"
        bounds, start = [], 0
        for s in sizes:
            bounds.append(slice(start, start + s[-1]))  # type: ignore[index]
            start += s[-1]  # type: ignore[index]
        return Match([*found.nodes, node], list(node.outputs), (found.params, bounds))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p, bounds = m.params
        return [emit_gemm(b, p, static_shape(o), columns=cols) for o, cols in zip(m.outputs, bounds, strict=True)]
