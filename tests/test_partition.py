"""The partitioner: NPU regions are connected, cycle-free and as large as the cycles allow; every CPU node
has a reason."""

from __future__ import annotations

import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.formats.keys import DECLINED_TAG, REASON_TAG, REGION_TAG
from sdnpu.ops.target import get_target
from sdnpu.passes.partition import cpu_islands, partition, propose_regions

from .graphs import to_ir

TARGET = get_target()
D = TARGET.domain


def npu(name: str, ins: list[str]) -> object:
    return helper.make_node("SDAdd", ins, [name], domain=D, name=name)


def cpu(name: str, ins: list[str]) -> object:
    return helper.make_node("Floor", ins[:1], [name], name=name)


def _graph(nodes, out: str):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.BFLOAT16, [4])],
                          [helper.make_tensor_value_info(out, T.BFLOAT16, [4])])
    return to_ir(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(D, 1)]))


# (nodes in topological order, the regions expected: lists of dispatch node names)
CASES = {
    "a chain is one region": ([npu("a", ["x", "x"]), npu("b", ["a", "a"]), cpu("c", ["b"])], "c", [["a", "b"]]),
    "two branches that join are one region": (
        [npu("a", ["x", "x"]), npu("b", ["a", "a"]), npu("c", ["a", "a"]), npu("d", ["b", "c"])], "d",
        [["a", "b", "c", "d"]]),
    "a cycle through the CPU splits the region": (
        [npu("a", ["x", "x"]), cpu("c", ["a"]), npu("b", ["a", "c"])], "b", [["a"], ["b"]]),
    "the split keeps what the cycle allows": (  # a -> b -> d and a -> Floor -> d: {a, b} and {d}
        [npu("a", ["x", "x"]), npu("b", ["a", "a"]), cpu("c", ["a"]), npu("d", ["b", "c"])], "d",
        [["a", "b"], ["d"]]),
    "unconnected ops are separate regions": (
        [npu("a", ["x", "x"]), cpu("c", ["a"]), npu("b", ["c", "c"])], "b", [["a"], ["b"]]),
    "a cycle elsewhere leaves other regions whole": (
        [npu("a", ["x", "x"]), npu("a2", ["a", "a"]), cpu("c", ["a2"]), npu("b", ["a2", "c"]),
         cpu("e", ["b"]), npu("f", ["e", "e"]), npu("g", ["f", "f"])], "g", [["a", "a2"], ["b"], ["f", "g"]]),
    # Stable Cascade's timestep mappers: a linear layer on a CPU value (r) read by a region split for a cycle
    # (b -> Floor -> e): r starts a region of its own when regrouped, then joins the one that reads it
    "a root on a CPU value joins the region that reads it": (
        [npu("a", ["x", "x"]), cpu("c", ["x"]), npu("r", ["c", "c"]), npu("b", ["a", "r"]), cpu("d", ["b"]),
         npu("e", ["b", "d"])], "e", [["a", "r", "b"], ["e"]]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_proposed_regions(case):
    nodes, out, expected = CASES[case]
    m = _graph(nodes, out)
    regions = propose_regions(m.graph, TARGET)
    assert [[n.name for n in r] for r in regions] == expected
    before = [n.name for n in m.graph]
    partition(m, TARGET)
    assert [n.name for n in m.graph] == before  # proposing and applying change no node
    tags = {n.name: n.metadata_props for n in m.graph}
    for i, region in enumerate(expected):
        assert {tags[name][REGION_TAG] for name in region} == {str(i)}


def test_every_cpu_node_has_its_reason():
    m = _graph([npu("a", ["x", "x"]), cpu("c", ["a"]), npu("b", ["a", "c"])], "b")
    next(n for n in m.graph if n.name == "c").metadata_props[DECLINED_TAG] = "SomeRule: a made-up reason"
    result = partition(m, TARGET)
    tags = {n.name: n.metadata_props for n in m.graph}
    assert tags["c"][REASON_TAG] == "SomeRule: a made-up reason"
    # transitions: region a takes x and gives a; region b takes a and c and gives b
    assert result.counts == {"NPU regions": 2, "CPU nodes": 1, "transitions": 5, "CPU islands": 1,
                             "CPU islands at the edges": 0, "CPU islands around ops the registry lacks": 1,
                             "CPU islands avoidable": 0}
    m = _graph([npu("a", ["x", "x"]), cpu("c", ["a"])], "c")
    partition(m, TARGET)
    assert next(n for n in m.graph if n.name == "c").metadata_props[REASON_TAG] == "Floor: not in the amd-xdna2 registry"


def _cast(name: str, ins: list[str]) -> object:
    return helper.make_node(TARGET.boundary.op_type, ins[:1], [name], domain=D, name=name, to=T.FLOAT)


def test_cpu_islands_are_classed_by_why_they_are_there():
    # Floor between two dispatch ops: around an op the registry lacks; a graph input's Floor: at the edge
    m = _graph([cpu("e", ["x"]), npu("a", ["e", "e"]), cpu("c", ["a"]), npu("b", ["a", "c"])], "b")
    assert cpu_islands(m.graph, TARGET) == {"CPU islands": 2, "at the edges": 1,
                                            "around ops the registry lacks": 1, "avoidable": 0}
    # a cast and nothing else between two dispatch ops: an island the data flow does not call for
    m = _graph([npu("a", ["x", "x"]), _cast("c", ["a"]), npu("b", ["a", "c"])], "b")
    assert cpu_islands(m.graph, TARGET)["avoidable"] == 1
    # CPU nodes joined through each other are one island, however many
    m = _graph([npu("a", ["x", "x"]), cpu("c", ["a"]), _cast("d", ["c"]), cpu("f", ["d"]), npu("b", ["a", "f"])],
               "b")
    assert cpu_islands(m.graph, TARGET) == {"CPU islands": 1, "at the edges": 0,
                                            "around ops the registry lacks": 1, "avoidable": 0}


def test_a_clamp_left_on_the_cpu_says_the_registry_has_no_clamp():
    """A Clip (a VAE's output clamp to [-1, 1]: Qwen-Image's, Wan 2.2's) after a dispatch op: the registry has no
    clamp, ReLU or ReLU6 kernel, and its reason says so."""
    clip = helper.make_node("Clip", ["a"], ["c"], name="c")
    m = _graph([npu("a", ["x", "x"]), clip], "c")
    partition(m, TARGET)
    reason = next(n for n in m.graph if n.name == "c").metadata_props[REASON_TAG]
    assert reason.startswith("Clip: not in the amd-xdna2 registry") and "no clamp" in reason, reason
