"""float32 tables: float64 inside a graph becomes float32 (QNN maps no float64 where Flux.1's rotary tables need
it). See ``sdnpu.passes.htp``."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes.manager import PassResult

F64, F32 = ir.DataType.DOUBLE, ir.DataType.FLOAT


def _float32_tensor(t: ir.TensorProtocol, name: str | None = None) -> ir.Tensor:
    return ir.tensor(np.asarray(t.numpy(), np.float32), name=name)


def _edge_casts(graph: ir.Graph) -> None:
    """A float64 graph input is read through a Cast to float32; a float64 graph output is written by a Cast
    from float32 (the interface keeps its type; everything between becomes float32)."""
    for v in graph.inputs:
        if v.dtype == F64 and v.uses():
            readers = [(u.node, u.idx) for u in v.uses()]
            cast = ir.node("Cast", [v], attributes={"to": F32}, name=f"{v.name}_to_float32")
            cast.outputs[0].name, cast.outputs[0].dtype, cast.outputs[0].shape = f"{v.name}_float32", F32, v.shape
            for node, idx in readers:
                node.replace_input_with(idx, cast.outputs[0])
            graph.insert_before(graph.node(0), cast)
    for i, v in enumerate(list(graph.outputs)):
        if v.dtype == F64 and v.producer() is not None and not (v.producer().op_type == "Cast"
                                                                  and v.producer().name.endswith("_to_float64")):
            name = v.name
            v.name = f"{name}_float32"
            cast = ir.node("Cast", [v], attributes={"to": F64}, name=f"{name}_to_float64")
            cast.outputs[0].name, cast.outputs[0].dtype, cast.outputs[0].shape = name, F64, v.shape
            graph.append(cast)
            graph.outputs[i] = cast.outputs[0]


def demote_float64(model: ir.Model) -> PassResult:
    """float64 inside the graph -> float32 (see the module's docstring)."""
    graph = model.graph
    _edge_casts(graph)
    interface = {id(v) for v in [*graph.inputs, *graph.outputs]}
    counts = {"float64 constants -> float32": 0, "casts to float64 -> float32": 0, "float64 values -> float32": 0}
    for name, v in list(graph.initializers.items()):
        if v.dtype == F64 and id(v) not in interface and v.const_value is not None:
            v.const_value = _float32_tensor(v.const_value, name)
            v.dtype = F32
            counts["float64 constants -> float32"] += 1
    for node in graph:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Cast" and node.attributes.get("to") is not None and node.attributes["to"].value == F64:
            if not any(id(o) in interface for o in node.outputs):
                node.attributes["to"] = ir.AttrInt64("to", F32)
                counts["casts to float64 -> float32"] += 1
        if node.op_type in ("Constant", "ConstantOfShape") and "value" in node.attributes:
            t = node.attributes["value"].value
            if t is not None and t.dtype == F64 and not any(id(o) in interface for o in node.outputs):
                node.attributes["value"] = ir.AttrTensor("value", _float32_tensor(t))
                counts["float64 constants -> float32"] += 1
        for out in node.outputs:
            if out.dtype == F64 and id(out) not in interface:
                out.dtype = F32
                counts["float64 values -> float32"] += 1
    return PassResult(modified=any(counts.values()), counts=counts)
