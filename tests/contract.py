"""Every dispatch op of a compiled model against the target's table and its own tensors: attribute names and
types (the compiler's own check), the dtype lists, exact shapes, views with the tensor's element count (and
recorded where they differ), storage dtypes, dummy buffers, bf16 outputs. Shared by the target tests and the
zoo (``problems`` lists what is wrong; an empty list is a model AMD's runtime could key its kernels on)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import onnx
from onnx import helper
from sdnpu.formats.keys import VIEWS_TAG
from sdnpu.ops.target import DispatchTarget, get_target
from sdnpu.passes.cleanup import contract_violations

_STORAGE = {"bfloat16": onnx.TensorProto.BFLOAT16, "float": onnx.TensorProto.FLOAT,
            "uint8": onnx.TensorProto.UINT8, "uint16": onnx.TensorProto.UINT16}


def _value_shapes(m: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    out = {vi.name: tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
           for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]}
    out.update({init.name: tuple(init.dims) for init in m.graph.initializer})
    return out


def _value_types(m: onnx.ModelProto) -> dict[str, int]:
    out = {vi.name: vi.type.tensor_type.elem_type for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]}
    out.update({init.name: init.data_type for init in m.graph.initializer})
    return out


def ir_node(node: onnx.NodeProto):
    """The node in onnx_ir (for the compiler's own check), without its graph."""
    import onnx_ir as ir

    logging.getLogger("onnx_ir").setLevel(logging.ERROR)  # the inputs' producers are not in scope here
    return ir.from_proto(node)


def problems(path: Path, target: DispatchTarget | None = None) -> tuple[int, list[str]]:
    """(dispatch ops checked, what breaks the contract) for the model at ``path``."""
    target = target or get_target()
    m = onnx.shape_inference.infer_shapes(onnx.load(str(path), load_external_data=False))  # shapes, not weights
    shapes, types = _value_shapes(m), _value_types(m)
    checked, found = 0, []
    for node in m.graph.node:
        if node.domain != target.domain or node.op_type == target.boundary.op_type:
            continue
        checked += 1
        where = f"{node.op_type} {node.name}"
        if not target.is_dispatch(node.domain, node.op_type):
            found.append(f"{where}: not in the {target.name} table")
            continue
        spec = target.base_spec(node.op_type)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        found += contract_violations(target, ir_node(node))
        dtypes = [s.decode() if isinstance(s, bytes) else s for s in attrs.get("in_dtypes", [])]
        if dtypes != list(spec.bfp_in_dtypes if node.op_type != spec.op_type else spec.in_dtypes):
            found.append(f"{where}: in_dtypes {dtypes}")
        for name, i in spec.exact_inputs:
            if tuple(attrs.get(name, ())) != shapes.get(node.input[i]):
                found.append(f"{where}: {name} {attrs.get(name)} is not input {i}'s {shapes.get(node.input[i])}")
        for name, i in spec.exact_outputs:
            if tuple(attrs.get(name, ())) != shapes.get(node.output[i]):
                found.append(f"{where}: {name} {attrs.get(name)} is not output {i}'s {shapes.get(node.output[i])}")
        meta = {p.key: p.value for p in node.metadata_props}
        read_through = {int(r.split(":")[0]) for r in meta.get(VIEWS_TAG, "").split(";") if r}
        for i, view in spec.input_views(attrs).items():
            tensor = shapes.get(node.input[i], ())
            if math.prod(view) != math.prod(tensor):
                found.append(f"{where}: input {i} read as {list(view)}, a tensor of {list(tensor)}")
            elif i not in read_through and tuple(view) != tensor:
                found.append(f"{where}: input {i} read as {list(view)} without a recorded view of {list(tensor)}")
        for i, spec_in in enumerate(spec.inputs):
            if i < len(node.input) and types.get(node.input[i]) != _STORAGE[spec_in.dtype]:
                found.append(f"{where}: input {spec_in.name} is type {types.get(node.input[i])}, the table says "
                             f"{spec_in.dtype}")
            if spec_in.role == "dummy" and i < len(node.input) and shapes.get(node.input[i]) != spec_in.dummy_shape:
                found.append(f"{where}: dummy {spec_in.name} of shape {shapes.get(node.input[i])}")
        if not all(types.get(o) == onnx.TensorProto.BFLOAT16 for o in node.output):
            found.append(f"{where}: an output is not bf16")
    return checked, found
