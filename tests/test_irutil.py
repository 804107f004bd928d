"""The helpers every pass rewrites with: a value rerouted keeps the graph's outputs and their names."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper

from sdnpu.passes.irutil import remove_dead_nodes, reroute


def _graph() -> ir.Model:
    """y = x * 2 read by z = y + 1; both y and z are outputs, and so is the input x under the name 'xo'."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("y", "z", "xo")]
    two = helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    nodes = [helper.make_node("Mul", ["x", "two"], ["y"]), helper.make_node("Add", ["y", "one"], ["z"]),
             helper.make_node("Identity", ["x"], ["xo"])]
    g = helper.make_graph(nodes, "g", [x], outs, [two, one])
    return ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]))


def _run(model: ir.Model) -> dict[str, np.ndarray]:
    proto = ir.serde.serialize_model(model)
    onnx.checker.check_model(proto, full_check=True)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x}), strict=True))


def test_a_rerouted_output_keeps_its_name():
    model = _graph()
    g = model.graph
    y = next(n for n in g if n.op_type == "Mul").outputs[0]
    b = ir.node("Add", [g.inputs[0], g.inputs[0]], num_outputs=1)  # x + x: the same values as x * 2
    b.outputs[0].dtype, b.outputs[0].shape = y.dtype, y.shape
    g.insert_before(next(iter(g)), b)
    reroute(g, y, b.outputs[0])
    assert [o.name for o in g.outputs] == ["y", "z", "xo"]
    out = _run(model)
    assert np.array_equal(out["z"], out["y"] + 1) and np.array_equal(out["y"], 2 * out["xo"])


def test_an_output_rerouted_to_the_input_is_written_by_an_identity():
    """The graph input keeps its name; the output keeps its own, through an Identity."""
    model = _graph()
    g = model.graph
    xo = next(n for n in g if n.op_type == "Identity").outputs[0]
    reroute(g, xo, g.inputs[0])
    remove_dead_nodes(g)
    assert g.inputs[0].name == "x" and [o.name for o in g.outputs] == ["y", "z", "xo"]
    assert np.array_equal(_run(model)["xo"], np.arange(6, dtype=np.float32).reshape(2, 3))


def test_an_output_rerouted_to_another_output_keeps_both():
    model = _graph()
    g = model.graph
    y = next(n for n in g if n.op_type == "Mul").outputs[0]
    z = next(n for n in g if n.op_type == "Add").outputs[0]
    reroute(g, z, y)  # z now returns y's values under its own name
    remove_dead_nodes(g)
    assert [o.name for o in g.outputs] == ["y", "z", "xo"]
    out = _run(model)
    assert np.array_equal(out["z"], out["y"])
