"""Cleanup: inverse cast pairs, dead nodes, unused initializers; then the finishing touches every dispatch
model carries: AMD-style attributes on each dispatch op and the ops' reference functions."""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from sdnpu.ops.opset import BOUNDARY_OP, DOMAIN, VERSION, functions_for
from sdnpu.passes.irutil import attr, remove_dead_nodes, remove_unused_initializers, static_shape
from sdnpu.passes.manager import PassResult

_DTYPE_NAMES = {ir.DataType.BFLOAT16: "bfloat16", ir.DataType.FLOAT: "float32", ir.DataType.FLOAT16: "float16",
                ir.DataType.INT64: "int64", ir.DataType.INT32: "int32"}


def _cancel_casts(graph: ir.Graph) -> int:
    """CastAvx(CastAvx(x)) back to x's own dtype and layout is x (bf16 -> fp32 -> bf16 is exact)."""
    done = 0
    for node in list(graph):
        if node.graph is None or node.op_type != BOUNDARY_OP or node.domain != DOMAIN:
            continue
        inner = node.inputs[0].producer() if node.inputs[0] is not None else None
        if inner is None or inner.op_type != BOUNDARY_OP or inner.domain != DOMAIN:
            continue
        base = inner.inputs[0]
        assert base is not None
        p1, p2 = list(attr(inner, "perm")), list(attr(node, "perm"))
        if base.dtype != ir.DataType.BFLOAT16 or attr(node, "to") != int(ir.DataType.BFLOAT16):
            continue
        if [p1[i] for i in p2] != list(range(len(p1))) or node.outputs[0].is_graph_output():
            continue
        node.outputs[0].replace_all_uses_with(base)
        done += 1
    return done


def _dtype_name(v: ir.Value | None) -> str:
    return _DTYPE_NAMES.get(v.dtype, str(v.dtype)) if v is not None and v.dtype is not None else ""


def annotate(graph: ir.Graph) -> None:
    """AMD's per-op metadata: in_dtypes, out_dtypes, input_shape, output_shape (static)."""
    for node in graph:
        if node.domain != DOMAIN:
            continue
        values = {
            "in_dtypes": ir.AttrStrings("in_dtypes", [_dtype_name(v) for v in node.inputs]),
            "out_dtypes": ir.AttrStrings("out_dtypes", [_dtype_name(v) for v in node.outputs]),
            "input_shape": ir.AttrInt64s("input_shape", list(static_shape(node.inputs[0]) or [])),
            "output_shape": ir.AttrInt64s("output_shape", list(static_shape(node.outputs[0]) or [])),
        }
        for key, value in values.items():
            node.attributes[key] = value


def attach_functions(model: ir.Model) -> int:
    used = {n.op_type for n in model.graph if n.domain == DOMAIN}
    for key in [k for k in model.functions if k[0] == DOMAIN]:
        del model.functions[key]
    for proto in functions_for(used):
        fn = ir.serde.deserialize_function(proto)
        model.functions[fn.identifier()] = fn
    if used:
        model.opset_imports[DOMAIN] = VERSION
        model.graph.opset_imports[DOMAIN] = VERSION
    return len(used)


def cleanup(model: ir.Model) -> PassResult:
    graph = model.graph
    counts: Counter[str] = Counter()
    counts["cast pairs cancelled"] = _cancel_casts(graph)
    counts["dead nodes"] = remove_dead_nodes(graph)
    counts["unused initializers"] = remove_unused_initializers(graph)
    annotate(graph)
    counts["reference functions"] = attach_functions(model)
    return PassResult(modified=True, counts=dict(counts))
