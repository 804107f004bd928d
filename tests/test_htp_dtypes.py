"""float64 inside a graph as float32 (``sdnpu.passes.htp.dtypes``) on small graphs, as op counts, onnx's full check
and onnxruntime's numbers before and after (fp32: every rewrite is exact or changes float32's last bits); then QNN's
refusal of float64, on Qualcomm's compiler and its HTP emulator (onnxruntime-qnn)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.passes import htp

from .graphs import run, to_ir, to_proto
from .htp_graphs import on_htp


def rotary_in_float64() -> onnx.ModelProto:
    """Flux.1's rotary angles as diffusers exports them: ids cast to float64, times float64 frequencies, broadcast
    over the batch (an Expand), Cos, cast back."""
    freqs = (1.0 / 10000 ** (np.arange(0, 8, 2) / 8)).astype(np.float64)
    nodes = [helper.make_node("Cast", ["ids"], ["ids64"], to=T.DOUBLE),
             helper.make_node("Unsqueeze", ["ids64", "axis"], ["col"]),
             helper.make_node("Mul", ["col", "freqs"], ["angles"]),
             helper.make_node("Expand", ["angles", "batch"], ["batched"]),
             helper.make_node("Cos", ["batched"], ["cos"]),
             helper.make_node("Cast", ["cos"], ["y"], to=T.FLOAT)]
    g = helper.make_graph(nodes, "rope", [helper.make_tensor_value_info("ids", T.FLOAT, [64])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [2, 64, 4])],
                          [onnx.numpy_helper.from_array(freqs, "freqs"),
                           onnx.numpy_helper.from_array(np.asarray([1], np.int64), "axis"),
                           onnx.numpy_helper.from_array(np.asarray([2, 64, 4], np.int64), "batch")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    return onnx.shape_inference.infer_shapes(m, strict_mode=True)


def test_float64_inside_the_graph_becomes_float32():
    m = rotary_in_float64()
    after = to_ir(m)
    counts = htp.demote_float64(after).counts
    assert counts["casts to float64 -> float32"] == 1 and counts["float64 constants -> float32"] == 1
    proto = to_proto(after)
    onnx.checker.check_model(proto, full_check=True)
    assert not any(t.data_type == T.DOUBLE for t in proto.graph.initializer)
    ids = np.arange(64, dtype=np.float32)
    np.testing.assert_allclose(run(proto, {"ids": ids})[0], run(m, {"ids": ids})[0], atol=1e-5)


def test_a_float64_graph_input_and_output_keep_their_type():
    nodes = [helper.make_node("Mul", ["x", "k"], ["y"])]
    g = helper.make_graph(nodes, "f64", [helper.make_tensor_value_info("x", T.DOUBLE, [4])],
                          [helper.make_tensor_value_info("y", T.DOUBLE, [4])],
                          [onnx.numpy_helper.from_array(np.full(4, 3.0), "k")])
    m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]))
    after = to_ir(m)
    htp.demote_float64(after)
    proto = to_proto(after)
    onnx.checker.check_model(proto, full_check=True)
    assert proto.graph.input[0].type.tensor_type.elem_type == T.DOUBLE
    assert proto.graph.output[0].type.tensor_type.elem_type == T.DOUBLE
    assert [n.op_type for n in proto.graph.node] == ["Cast", "Mul", "Cast"]
    x = np.arange(4, dtype=np.float64)
    np.testing.assert_allclose(run(proto, {"x": x})[0], 3 * x)


# --- the fault, on Qualcomm's compiler and its emulator -----------------------------------------------------------

qnn = pytest.importorskip("sdnpu.backends.qnn_htp")


def test_qnn_refuses_float64_and_takes_the_float32_tables(tmp_path):
    """QNN refuses the float64 Expand, then fails composing the graph (error 7004): no session at all."""
    m = rotary_in_float64()
    onnx.save(m, str(tmp_path / "raw.onnx"))
    with pytest.raises(Exception):
        qnn.session(tmp_path / "raw.onnx")
    after = to_ir(m)
    htp.demote_float64(after)
    ids = np.arange(64, dtype=np.float32)
    got = on_htp(to_proto(after), tmp_path / "fixed.onnx", {"ids": ids})
    # the bound: the HTP computes in fp16, whose rounding of an angle up to 63 rad is up to 63 * 2**-11 = 0.031
    # rad, and cos moves by at most that much (measured: 0.027)
    np.testing.assert_allclose(got, run(m, {"ids": ids})[0], atol=63 * 2.0 ** -11)
