"""The target's table against AMD's own signatures, and every dispatch op of every tiny-sdxl component
against the table: attribute names and types, and values that agree with the tensors the node reads and
writes."""

from __future__ import annotations

import math

import onnx
import pytest
from onnx import helper

from sdnpu.formats.keys import VIEWS_TAG
from sdnpu.ops.target import get_target
from sdnpu.passes.cleanup import contract_violations

from .amd_signatures import REGISTRY, TEST_MODELS

TARGET = get_target()
COMPONENTS = ["unet", "vae_decoder", "vae_encoder", "text_encoder", "text_encoder_2"]
_ONNX_TYPES = {"bfloat16": "BFLOAT16", "float": "FLOAT", "uint8": "UINT8", "uint16": "UINT16"}


def verify(op: str, dtypes: list[str]) -> bool:
    """DynamicDispatch's ICreatePolicy::verify: type i at position pos[i] of in_dtypes + out_dtypes."""
    types, pos = REGISTRY[op]
    return all(p == -1 or (p < len(dtypes) and dtypes[p] == t) for t, p in zip(types, pos, strict=False))


@pytest.mark.parametrize("op", sorted(TEST_MODELS))
def test_the_table_writes_what_amds_test_models_write(op):
    spec = TARGET.spec(op)
    model = TEST_MODELS[op]
    amd_attrs = {a.name: a.type for a in spec.attrs if a.kind == "amd"}
    assert amd_attrs == model["attrs"]
    if op == "SDConv":
        # DD's test lists a fourth input dtype that no input has; the table writes one per input, as AMD's
        # ONNX pass does (conv_to_sd_conv2d L355): a prefix, and both pass the registry's check.
        assert list(spec.in_dtypes) == model["in_dtypes"][:3]
    else:
        assert list(spec.in_dtypes) == model["in_dtypes"]
    assert list(spec.out_dtypes) == model["out_dtypes"]
    packed = [_ONNX_TYPES[(i.packed.split()[0] if i.packed else i.dtype)] for i in spec.inputs
              if not i.packed.startswith("folded")]
    assert packed == model["inputs"]
    dummies = [list(i.dummy_shape) for i in spec.inputs if i.role == "dummy"]
    assert dummies == ([model["dummy"]] if "dummy" in model else [])


@pytest.mark.parametrize("op", sorted(TARGET.ops))
def test_every_op_passes_the_registrys_dtype_check(op):
    spec = TARGET.spec(op)
    base = op if op in REGISTRY else "SDMHA"  # SDFlatMHA and SDMHA_VAE are AMD's variants of SDMHA
    assert verify(base, [*spec.in_dtypes, *spec.out_dtypes]), op
    assert spec.sources and all(s.split()[0] in TARGET.sources for s in spec.sources)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _value_shapes(m: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    out = {}
    for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
        out[vi.name] = tuple(d.dim_value for d in vi.type.tensor_type.shape.dim)
    for init in m.graph.initializer:
        out[init.name] = tuple(init.dims)
    return out


def _value_types(m: onnx.ModelProto) -> dict[str, int]:
    out = {vi.name: vi.type.tensor_type.elem_type for vi in [*m.graph.input, *m.graph.output, *m.graph.value_info]}
    out.update({init.name: init.data_type for init in m.graph.initializer})
    return out


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_dispatch_op_agrees_with_the_table_and_its_tensors(tiny_conversion, component):
    m = onnx.load(str(tiny_conversion.out / component / "dd" / "replaced.onnx"))
    m = onnx.shape_inference.infer_shapes(m)
    shapes, types = _value_shapes(m), _value_types(m)
    checked = 0
    for node in m.graph.node:
        if node.domain != TARGET.domain or node.op_type == TARGET.boundary.op_type:
            continue
        checked += 1
        assert TARGET.is_dispatch(node.domain, node.op_type), node.op_type
        spec = TARGET.base_spec(node.op_type)
        attrs = _attrs(node)
        # names and types, through the compiler's own check (which refuses to write a broken node) ...
        assert contract_violations(TARGET, _ir_node(node)) == []
        # ... and every attribute with a tensor behind it agrees with that tensor
        assert [s.decode() if isinstance(s, bytes) else s for s in attrs["in_dtypes"]] == list(
            spec.bfp_in_dtypes if node.op_type != spec.op_type else spec.in_dtypes)
        for name, i in spec.exact_inputs:
            assert tuple(attrs[name]) == shapes[node.input[i]], (node.name, name)
        for name, i in spec.exact_outputs:
            assert tuple(attrs[name]) == shapes[node.output[i]], (node.name, name)
        views = spec.input_views(attrs)
        read_through = {int(r.split(":")[0]) for r in
                        dict((p.key, p.value) for p in node.metadata_props).get(VIEWS_TAG, "").split(";") if r}
        for i, view in views.items():
            tensor = shapes[node.input[i]]
            assert math.prod(view) == math.prod(tensor), (node.name, i, view, tensor)
            if i not in read_through:  # no view recorded: the attribute is the tensor's own shape
                assert tuple(view) == tensor, (node.name, i, view, tensor)
        for i, spec_in in enumerate(spec.inputs):
            want = {"bfloat16": onnx.TensorProto.BFLOAT16, "float": onnx.TensorProto.FLOAT,
                    "uint8": onnx.TensorProto.UINT8, "uint16": onnx.TensorProto.UINT16}[spec_in.dtype]
            assert types[node.input[i]] == want, (node.name, spec_in.name)
            if spec_in.role == "dummy":
                assert shapes[node.input[i]] == spec_in.dummy_shape
        assert all(types[o] == onnx.TensorProto.BFLOAT16 for o in node.output)
    assert checked > 0


def _ir_node(node: onnx.NodeProto):
    """The node in onnx_ir (for the compiler's own check), without its graph."""
    import logging

    import onnx_ir as ir

    logging.getLogger("onnx_ir").setLevel(logging.ERROR)  # the inputs' producers are not in scope here
    return ir.from_proto(node)


def test_a_node_that_breaks_the_table_is_named():
    import onnx_ir as ir

    node = ir.Node(TARGET.domain, "SDSilu", [ir.Value(name="x")],
                   attributes=ir.convenience.convert_attributes({"input_shape": [1, 2], "num_heads": 3.0}),
                   name="bad")
    problems = contract_violations(TARGET, node)
    assert any("no attribute output_shape" in p for p in problems)
    assert any("1 inputs, the table says 2" in p for p in problems)
    node = ir.Node(TARGET.domain, "SDMHA", [ir.Value(name=n) for n in "qkvm"], attributes=ir.convenience.convert_attributes(
        {"input_shape": [1, 2, 3, 4], "num_heads": [2], "in_dtypes": ["bfloat16"], "out_dtypes": ["bfloat16"],
         "op_version": "v2", "is_flash_mha": 1}), name="heads")
    assert contract_violations(TARGET, node) == ["SDMHA heads: num_heads is INTS, the table says INT"]
