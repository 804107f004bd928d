"""The partitioner: NPU regions are connected, cycle-free, and every CPU node has a reason."""

from __future__ import annotations

from onnx import TensorProto as T
from onnx import helper

from sdnpu.ops.opset import REASON_TAG, REGION_TAG
from sdnpu.passes.partition import partition

from .graphs import to_ir


def _graph(nodes):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.BFLOAT16, [4])],
                          [helper.make_tensor_value_info("y", T.BFLOAT16, [4])])
    return to_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("sdnpu", 1)]))


def test_a_region_that_would_wait_on_its_own_cpu_output_is_split():
    """a -> b directly and a -> Floor (CPU) -> b: one region {a, b} would need the CPU's result of itself."""
    m = _graph([helper.make_node("SDAdd", ["x", "x"], ["a"], domain="sdnpu", name="a"),
                helper.make_node("Floor", ["a"], ["c"], name="c"),
                helper.make_node("SDMul", ["a", "c"], ["y"], domain="sdnpu", name="b")])
    result = partition(m, {"c": ("SomeRule", "a made-up reason")})
    regions = result.details["regions"]
    assert sorted(r.nodes for r in regions) == [["a"], ["b"]]
    tags = {n.name: n.metadata_props for n in m.graph}
    assert tags["a"][REGION_TAG] != tags["b"][REGION_TAG]
    assert tags["c"][REASON_TAG] == "SomeRule: a made-up reason"
    # transitions: region a takes x and gives a; region b takes a and c and gives y
    assert result.counts == {"NPU regions": 2, "CPU nodes": 1, "transitions": 5}


def test_connected_dispatch_ops_form_one_region():
    m = _graph([helper.make_node("SDAdd", ["x", "x"], ["a"], domain="sdnpu", name="a"),
                helper.make_node("SDMul", ["a", "a"], ["b"], domain="sdnpu", name="b"),
                helper.make_node("Floor", ["b"], ["y"], name="c")])
    result = partition(m)
    assert [r.nodes for r in result.details["regions"]] == [["a", "b"]]
    assert next(n for n in m.graph if n.name == "c").metadata_props[REASON_TAG] == "no rule offloads Floor"
