"""``sdnpu.passes.movement`` on small graphs: which nodes are data movement, what a chain of them does (run on an
index tensor, against onnxruntime running the same chain), and the walk up through movement and scalar
scales that the attention and layout rewrites use."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from sdnpu.passes import movement

from .graphs import model, run, to_ir
from .lowering import n, w


def chain_graph() -> onnx.ModelProto:
    """A head split as one exporter writes it: Reshape, Transpose, Reshape, then a Flatten and an Unsqueeze."""
    nodes = [n("Reshape", ["x", "s1"], ["a"]), n("Transpose", ["a"], ["b"], perm=[0, 2, 1, 3]),
             n("Reshape", ["b", "s2"], ["c"]), n("Flatten", ["c"], ["d"], axis=1), n("Unsqueeze", ["d", "ax"], ["y"])]
    return model(nodes, {"x": [2, 6, 8]}, {"y": [2, 1, 48]},
                 {"s1": np.array([2, 6, 2, 4]), "s2": np.array([2, 2, 24]), "ax": np.array([1])})


def test_a_chain_run_on_an_index_tensor_is_what_onnxruntime_computes():
    m = chain_graph()
    irm = to_ir(m)
    nodes = list(irm.graph)
    assert all(movement.is_movement(node) for node in nodes)
    index = movement.index_tensor((2, 6, 8))
    assert index is not None and index.dtype == np.int32
    got = movement.run_chain(nodes, index)
    want = run(m, {"x": index.astype(np.float32)})[0]
    np.testing.assert_array_equal(got.astype(np.float32), want)
    assert got.shape == (2, 1, 48)


def test_not_movement():
    """An element-wise op and a Reshape whose shape is a runtime value are not."""
    g = helper.make_graph([n("Reshape", ["x", "shape"], ["a"]), n("Relu", ["a"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
                           helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(m, full_check=True)
    irm = to_ir(m)
    reshape, relu = list(irm.graph)
    assert not movement.is_movement(reshape)  # its shape is not a constant
    assert not movement.is_movement(relu)
    assert not movement.is_movement(None)


def test_trace_up_walks_movement_and_scalar_scales_to_the_source():
    """q = Reshape(Transpose(x * 0.5)) / 4: the source is x, the nodes are the four, the scale 0.125."""
    nodes = [n("Mul", ["x", "half"], ["a"]), n("Transpose", ["a"], ["b"], perm=[0, 2, 1]),
             n("Reshape", ["b", "s"], ["c"]), n("Div", ["c", "four"], ["q"])]
    m = model(nodes, {"x": [2, 3, 4]}, {"q": [2, 12]},
              {"half": np.array(0.5, np.float32), "s": np.array([2, 12]), "four": np.array(4.0, np.float32)})
    irm = to_ir(m)
    q = irm.graph.outputs[0]
    source, chain, scale = movement.trace_up(q)
    assert source.name == "x" and [node.op_type for node in chain] == ["Mul", "Transpose", "Reshape", "Div"]
    assert scale == pytest.approx(0.125)
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_allclose(movement.run_chain_ignoring_scale(chain, x) * scale, run(m, {"x": x})[0], rtol=1e-6)
    source, chain, scale = movement.trace_up(q, allow_scale=False)
    assert source.name == "q" and chain == [] and scale == 1.0  # without scales, the Div stops it


def test_a_scale_by_a_tensor_stops_the_walk():
    nodes = [n("Transpose", ["x"], ["a"], perm=[1, 0]), n("Mul", ["a", "k"], ["y"])]
    m = model(nodes, {"x": [3, 4]}, {"y": [4, 3]}, {"k": w(4, 3)})
    source, chain, scale = movement.trace_up(to_ir(m).graph.outputs[0])
    assert source.name == "y" and chain == [] and scale == 1.0


def test_tensors_too_large_to_simulate_are_not():
    assert movement.index_tensor((2, movement.MAX_SIMULATED // 2 + 1)) is None
    assert movement.index_tensor((2, 3)).tolist() == [[0, 1, 2], [3, 4, 5]]
