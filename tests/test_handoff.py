"""Handoff values (issue 14): graph inputs and outputs another dispatch model writes or reads stay in the NPU's
form (bf16, NHWC), with no Transpose or CastAvx at the edge; and a runtime scalar (a ControlNet's conditioning
scale) multiplies on the NPU. Each on small graphs, with the near misses that must keep their fp32 edge."""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import helper

from sdnpu import onnxrun
from sdnpu.formats import handoff
from sdnpu.ops.target import get_target
from sdnpu.passes.handoff import drop_handoff_edges
from sdnpu.passes.manager import entry_name, run_passes
from sdnpu.passes.pipeline import CompileOptions, compile_model, pipeline

from .graphs import feeds_for, model, run, to_ir, to_proto, with_functions

R = np.random.default_rng(3)
TARGET = get_target()
BF16_TOL = 2**-7  # a few bf16 roundings on values of order 1 (one conv, one add): measured < 2**-8 here


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.3).astype(np.float32)


def conv(x: str, out: str, c: int = 8, k: str = "") -> tuple[onnx.NodeProto, dict[str, np.ndarray]]:
    return (helper.make_node("Conv", [x, f"W{k}{out}", f"B{k}{out}"], [out], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
            {f"W{k}{out}": w(c, 8, 3, 3), f"B{k}{out}": w(c)})


def residuals_out(extra_reader: bool = False) -> onnx.ModelProto:
    """A ControlNet's tail: residuals of three widths (8, twice 8, and 12), each scaled by the runtime scalar
    ``scale``."""
    c1, i1 = conv("x", "h")
    c2, i2 = conv("h", "r1")
    c3, i3 = conv("h", "r2", c=16)
    c4, i4 = conv("h", "r3", c=12)
    nodes = [c1, c2, c3, c4, *(helper.make_node("Mul", [f"r{i}", "scale"], [f"y{i}"]) for i in (1, 2, 3))]
    i3.update(i4)
    outputs: dict[str, list[int] | None] = {"y1": [2, 8, 6, 6], "y2": [2, 16, 6, 6], "y3": [2, 12, 6, 6]}
    if extra_reader:  # y1 is read on the CPU too
        nodes.append(helper.make_node("Sin", ["y1"], ["s"]))
        outputs["s"] = [2, 8, 6, 6]
    return model(nodes, {"x": [2, 8, 6, 6], "scale": []}, outputs, {**i1, **i2, **i3})


def residual_in(extra_reader: bool = False) -> onnx.ModelProto:
    """The UNet's side: a residual input added to a conv's output, then another conv."""
    c1, i1 = conv("x", "h")
    c2, i2 = conv("a", "y", k="2")
    nodes = [c1, helper.make_node("Add", ["h", "res"], ["a"]), c2]
    outputs: dict[str, list[int] | None] = {"y": [2, 8, 6, 6]}
    if extra_reader:
        nodes.append(helper.make_node("Sin", ["res"], ["s"]))
        outputs["s"] = [2, 8, 6, 6]
    return model(nodes, {"x": [2, 8, 6, 6], "res": [2, 8, 6, 6]}, outputs, {**i1, **i2})


def compiled(m: onnx.ModelProto, names: set[str]) -> onnx.ModelProto:
    irm = to_ir(m)
    compile_model(irm, CompileOptions(handoff=frozenset(names)))
    out = to_proto(irm)
    onnx.checker.check_model(out, full_check=True)
    return out


def session(m: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])


def io_types(m: onnx.ModelProto) -> dict[str, tuple[int, list[int]]]:
    return {v.name: (v.type.tensor_type.elem_type, [d.dim_value for d in v.type.tensor_type.shape.dim])
            for v in [*m.graph.input, *m.graph.output]}


def cpu_ops(m: onnx.ModelProto) -> Counter[str]:
    return Counter(n.op_type for n in m.graph.node if n.domain != "com.amd" or n.op_type == "CastAvx")


def test_outputs_leave_in_the_npus_form_and_the_scale_multiplies_on_the_npu():
    m = residuals_out()
    out = compiled(m, {"y1", "y2", "y3"})
    types = io_types(out)
    assert types["y1"] == (onnx.TensorProto.BFLOAT16, [2, 6, 6, 8]) and types["y2"][1] == [2, 6, 6, 16]
    assert handoff.of_proto(out) == {f"y{i}": (0, 3, 1, 2) for i in (1, 2, 3)}
    # what stays on the CPU: x's Transpose and cast in, and the scale spread to [2, 1, 1, 8] and to
    # [2, 1, 1, 12] (Expand and cast each); [2, 1, 1, 16] is the first doubled by SDConcat on the NPU
    assert cpu_ops(out) == {"Transpose": 1, "CastAvx": 3, "Expand": 2}
    ops = Counter(n.op_type for n in out.graph.node)
    assert ops["SDMul"] == 3 and ops["SDConcat"] == 1
    feeds = {**feeds_for(m), "scale": np.asarray(0.7, np.float32)}
    want = run(m, feeds)
    got = onnxrun.run(session(out), ["y1", "y2", "y3"], feeds)  # back in the fp32 graph's form
    for a, b in zip(want, got, strict=True):
        assert b.dtype == np.float32 and b.shape == a.shape
        np.testing.assert_allclose(b, a, rtol=BF16_TOL, atol=BF16_TOL * np.abs(a).max())
    native = onnxrun.run(session(out), ["y1"], feeds, native=True)[0]
    assert handoff.is_bf16(native) and native.shape == (2, 6, 6, 8)
    np.testing.assert_array_equal(handoff.to_reference(native, (0, 3, 1, 2)), got[0])


def test_inputs_enter_in_the_npus_form_from_either_form():
    m = residual_in()
    out = compiled(m, {"res"})
    assert io_types(out)["res"] == (onnx.TensorProto.BFLOAT16, [2, 6, 6, 8])
    assert io_types(out)["x"] == (onnx.TensorProto.FLOAT, [2, 8, 6, 6])
    plain = compiled(m, set())
    assert cpu_ops(plain) - cpu_ops(out) == {"Transpose": 1, "CastAvx": 1}  # res's edge, gone
    feeds = feeds_for(m)
    want = run(m, feeds)[0]
    fp32 = onnxrun.run(session(out), ["y"], feeds)[0]
    np.testing.assert_allclose(fp32, want, rtol=BF16_TOL, atol=BF16_TOL * np.abs(want).max())
    nhwc = handoff.to_graph(feeds["res"], (0, 3, 1, 2))
    assert handoff.is_bf16(nhwc) and nhwc.shape == (2, 6, 6, 8)
    native = onnxrun.run(session(out), ["y"], {**feeds, "res": nhwc})[0]
    np.testing.assert_array_equal(native, fp32)


def test_a_value_the_cpu_also_reads_keeps_its_fp32_edge(caplog):
    with caplog.at_level(logging.WARNING):
        out = compiled(residuals_out(extra_reader=True), {"y1", "y2", "y3"})
        back = compiled(residual_in(extra_reader=True), {"res"})
    assert set(handoff.of_proto(out)) == {"y2", "y3"} and io_types(out)["y1"][0] == onnx.TensorProto.FLOAT
    assert handoff.of_proto(back) == {} and io_types(back)["res"][0] == onnx.TensorProto.FLOAT
    assert "the output y1 is not written by a dispatch op through one CastAvx" in caplog.text
    assert "the input res is not read by dispatch ops through one CastAvx" in caplog.text


@pytest.mark.parametrize("shape", [[], [1], [1, 1, 1, 1]])
def test_a_runtime_scalar_of_any_rank_is_spread_once(shape):
    c1, i1 = conv("x", "h")
    c2, i2 = conv("x", "g")
    nodes = [c1, c2, helper.make_node("Mul", ["h", "s"], ["a"]), helper.make_node("Mul", ["s", "g"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["y"])]
    m = model(nodes, {"x": [2, 8, 6, 6], "s": shape}, {"y": [2, 8, 6, 6]}, {**i1, **i2})
    out = compiled(m, set())
    assert cpu_ops(out)["Expand"] == 1 and Counter(n.op_type for n in out.graph.node)["SDMul"] == 2
    feeds = {**feeds_for(m), "s": np.full(shape, -1.3, np.float32)}
    want = run(m, feeds)[0]
    np.testing.assert_allclose(run(out, feeds)[0], want, rtol=BF16_TOL, atol=BF16_TOL * np.abs(want).max())


def test_a_runtime_tensor_that_is_not_a_scalar_is_not_spread():
    c1, i1 = conv("x", "h")
    m = model([c1, helper.make_node("Mul", ["h", "s"], ["y"])], {"x": [2, 8, 6, 6], "s": [1, 8, 1, 1]},
              {"y": [2, 8, 6, 6]}, i1)
    out = compiled(m, set())
    assert cpu_ops(out)["Expand"] == 0


def test_a_spread_shared_by_an_op_lowered_later_keeps_the_graph_in_order():
    """The first Mul by the scalar in the graph is lowered after the second (only once the Add after it is an
    SDAdd does it touch the NPU) and takes the spread made at the second's place: the graph stays sorted."""
    c0, i0 = conv("x", "h1", k="1")
    c1, i1 = conv("x", "h2")
    c2, i2 = conv("x", "h3", k="3")
    nodes = [c0, helper.make_node("Relu", ["h1"], ["g"]), helper.make_node("Mul", ["g", "s"], ["z"]), c2,
             helper.make_node("Mul", ["h3", "s"], ["y2"]), c1, helper.make_node("Add", ["z", "h2"], ["y1"])]
    m = model(nodes, {"x": [2, 8, 6, 6], "s": []}, {"y1": [2, 8, 6, 6], "y2": [2, 8, 6, 6]}, {**i0, **i1, **i2})
    out = compiled(m, set())  # the checker's full check: every value defined before it is read
    assert Counter(n.op_type for n in out.graph.node)["SDMul"] == 2 and cpu_ops(out)["Expand"] == 1
    feeds = {**feeds_for(m), "s": np.asarray(0.6, np.float32)}
    for a, b in zip(run(m, feeds), run(out, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=BF16_TOL, atol=BF16_TOL * np.abs(a).max())


# ---- the pass by itself (``sdnpu.passes.handoff.drop_handoff_edges``), on what the passes before it leave ----

def through(m: onnx.ModelProto, last: str):
    """``m`` through the pipeline up to and including the pass ``last``."""
    irm = to_ir(m)
    passes = pipeline(CompileOptions())
    names = [entry_name(e) for e in passes]
    assert last in names, f"no pass {last}"
    run_passes(irm, passes[:names.index(last) + 1])
    return irm


def test_the_pass_removes_each_named_outputs_edge_and_records_its_form():
    m = residuals_out()
    irm = through(m, "precision")
    before = Counter(n.op_type for n in irm.graph)
    names = frozenset({"y1", "y2", "y3"})
    result = drop_handoff_edges(irm, TARGET, names)
    assert result.modified and result.counts == {"outputs kept bf16": 3, "CPU nodes removed": 6}
    assert before - Counter(n.op_type for n in irm.graph) == {"CastAvx": 3, "Transpose": 3}  # one pair each
    assert handoff.decode(irm.metadata_props[handoff.KEY]) == {f"y{i}": (0, 3, 1, 2) for i in (1, 2, 3)}
    assert all(v.dtype == ir.DataType.BFLOAT16 for v in irm.graph.outputs)
    out = with_functions(irm, TARGET)
    onnx.checker.check_model(out, full_check=True)
    feeds = {**feeds_for(m), "scale": np.asarray(0.7, np.float32)}
    for a, b in zip(run(m, feeds), onnxrun.run(session(out), ["y1", "y2", "y3"], feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=BF16_TOL, atol=BF16_TOL * np.abs(a).max())
    again = drop_handoff_edges(irm, TARGET, names)  # bf16 already: nothing left to do
    assert not again.modified and not again.counts


def test_the_pass_takes_a_named_input_in_the_npus_form():
    irm = through(residual_in(), "precision")
    result = drop_handoff_edges(irm, TARGET, frozenset({"res"}))
    assert result.counts == {"inputs kept bf16": 1, "CPU nodes removed": 2}
    res = next(v for v in irm.graph.inputs if v.name == "res")
    assert res.dtype == ir.DataType.BFLOAT16 and list(res.shape) == [2, 6, 6, 8]


def test_the_pass_leaves_a_model_without_named_values_as_it_is():
    irm = through(residuals_out(), "precision")
    result = drop_handoff_edges(irm, TARGET, frozenset({"not_an_output"}))
    assert not result.modified and handoff.KEY not in irm.metadata_props
