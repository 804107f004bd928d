"""SDGemm (a linear layer with constant weights) and SDMatMul (activation x activation).

    MatMul(x [.., K], w [K, N]) + b [N]   (dynamo, TorchScript: weights already [K, N])
    Gemm(x [B, K], w [N, K], b, transB=1)  (time embeddings)
    ==> SDGemm(x, w [K, N], b)   (a zero bias when the layer has none; transB folded into the weight)
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.ops.capability import check_gemm
from sdnpu.passes.irutil import Builder, attr, const, is_float, producer, static_shape
from sdnpu.passes.rules.base import Match, Rule


def _bias(v: ir.Value | None, n: int) -> bool:
    c = const(v)
    return c is not None and c.size == n and c.shape[-1:] == (n,)


def _weight(v: ir.Value | None) -> tuple[int, int] | None:
    shape = static_shape(v)
    if v is None or v.const_value is None or shape is None or len(shape) != 2:
        return None
    return shape  # type: ignore[return-value]


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
                return self._checked([mm, node], node, mm.inputs[0], mm.inputs[1], bias, False)
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
            return self._checked([node], node, node.inputs[0], node.inputs[1], None, False)
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
        return self._checked([node], node, node.inputs[0], node.inputs[1], bias, trans)

    def _checked(self, nodes: list[ir.Node], last: ir.Node, x: ir.Value | None, w: ir.Value | None,
                 bias: ir.Value | None, trans: bool) -> Match | str:
        x_shape, w_shape = static_shape(x), static_shape(w)
        if x_shape is None or w_shape is None or not is_float(x):
            return "the input is not a float tensor of static shape"
        if len(x_shape) not in (2, 3):
            return f"input rank {len(x_shape)}: SDGemm takes [B, K] or [B, M, K]"
        k, n = (w_shape[1], w_shape[0]) if trans else w_shape
        reason = check_gemm(k, n)
        if reason:
            return reason
        return Match(nodes, [last.outputs[0]], (x, w, bias, trans, k, n))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        x, w, bias, trans, k, n = m.params
        if trans:
            w = b.derived(w, lambda a: np.ascontiguousarray(a.T), [k, n], f"{w.name}_kn")
        if bias is None:
            bias = b.const(np.zeros(n, np.float32), f"{w.name}_zero_bias")
        elif static_shape(bias) != (n,):
            bias = b.const(np.asarray(const(bias)).reshape(n), f"{bias.name}_n")
        return [b.op("SDGemm", [x, w, bias]).outputs[0]]


class SDMatMulFusion(Rule):
    name = "SDMatMulFusion"
    anchors = ("MatMul",)

    def match(self, node: ir.Node) -> Match | str | None:
        a, c = node.inputs
        if a is None or c is None or a.const_value is not None or c.const_value is not None:
            return None
        if not (is_float(a) and is_float(c)) or static_shape(a) is None or static_shape(c) is None:
            return "inputs are not float tensors of static shape"
        if max(len(static_shape(a) or ()), len(static_shape(c) or ())) > 4:
            return "rank above 4"
        return Match([node], [node.outputs[0]], (a, c))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        return [b.op("SDMatMul", list(m.params)).outputs[0]]
