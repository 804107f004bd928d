"""Constants and opset (``sdnpu.passes.canonical.constants``) on tiny graphs: the opset raised, Constant nodes
lifted, constants folded (onnxscript's folder; sdnpu's small folder, in its declared rounds), nodes named,
crops of constants derived from their source and recorded, the finish, and input shapes bound. Each rewrite
fires where its pattern is, the result passes onnx's full check and onnxruntime computes the same numbers bit
for bit; and each near miss stays as it was."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import SIZED_CONSTANTS_KEY
from sdnpu.passes.canonical import constants
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.manager import Group, run_passes
from sdnpu.passes.pipeline import CANONICAL

from .graphs import model, ops, rewritten, to_ir

R = np.random.default_rng(0)


def n(op: str, ins: list[str], outs: list[str], **attrs) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, **attrs)


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.2).astype(np.float32)


def _declared(name: str) -> Group:
    """A repeated group of the declared canonical steps."""
    return next(s for s in CANONICAL.steps if isinstance(s, Group) and s.name == name)


# ---- opset ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [17, 20])
def test_the_opset_is_raised_to_20(opset):
    """ReduceMean's axes became an input at 18: at 17 they are an attribute, rewritten by the converter. A
    model at 20 stays as it is (the near miss)."""
    axes = {"axes": [-1]} if opset < 18 else {}
    ins = ["x"] if opset < 18 else ["x", "ax"]
    inits = {} if opset < 18 else {"ax": np.array([-1])}
    m = model([n("ReduceMean", ins, ["y"], **axes)], {"x": [2, 5]}, {"y": [2, 1]}, inits, opset=opset)
    irm, counts = rewritten(m, constants.raise_opset)
    assert counts == ({"opset 17 -> 20": 1} if opset == 17 else {})
    assert irm.opset_imports[""] == 20
    node = next(iter(irm.graph))
    assert len(node.inputs) == 2 and "axes" not in node.attributes


def test_an_opset_the_converter_cannot_raise_is_one_line():
    m = model([n("Relu", ["x"], ["y"])], {"x": [2]}, {"y": [2]})
    irm = to_ir(m)
    irm.opset_imports[""] = 0  # ONNX's training ops' tests: no default-domain opset
    irm.graph.opset_imports[""] = 0
    with pytest.raises(SdnpuError, match="cannot be raised to 20"):
        constants.raise_opset(irm)


# ---- Constant nodes, shapes, folding ----------------------------------------------------------------------------

def test_constant_nodes_become_initializers():
    m = model([n("Constant", [], ["c"], value=onnx.numpy_helper.from_array(w(3), "c")), n("Add", ["x", "c"], ["y"])],
              {"x": [3]}, {"y": [3]})
    irm, counts = rewritten(m, constants.lift_constants)
    assert counts["Constant nodes -> initializers"] == 1 and dict(ops(irm)) == {"Add": 1}
    assert "c" in irm.graph.initializers
    _, again = rewritten(onnx.shape_inference.infer_shapes(m), constants.lift_constants, constants.lift_constants)
    assert again["Constant nodes -> initializers"] == 1  # the second finds none left


def test_shape_arithmetic_is_folded_and_a_weight_product_is_not():
    """Reshape(x, Concat(Shape(x)[0], -1)): its shape is a constant of the static shape; x * W is computed at
    run time (the near miss)."""
    m = model([n("Shape", ["x"], ["s"]), n("Gather", ["s", "zero"], ["b"]), n("Unsqueeze", ["b", "ax"], ["b1"]),
               n("Concat", ["b1", "minus1"], ["shape"], axis=0), n("Reshape", ["x", "shape"], ["r"]),
               n("MatMul", ["r", "wl"], ["y"])], {"x": [2, 3, 4]}, {"y": [2, 5]},
              {"zero": np.asarray(0, np.int64), "ax": np.array([0]), "minus1": np.array([-1]), "wl": w(12, 5)})
    irm, counts = rewritten(m, constants.fold_constants, sweep)
    assert counts["constant subgraphs folded"] == 1
    assert dict(ops(irm)) == {"Reshape": 1, "MatMul": 1}


def _fills(size: int) -> onnx.ModelProto:
    """x + ConstantOfShape([size], 1.5), which onnxscript's folder leaves (it does not materialize fills)."""
    return model([n("ConstantOfShape", ["shape"], ["c"], value=onnx.numpy_helper.from_array(np.array([1.5],
                                                                                               np.float32))),
                  n("Add", ["x", "c"], ["y"])], {"x": [size]}, {"y": [size]}, {"shape": np.array([size])})


@pytest.mark.parametrize(("size", "folds"), [(6, True), (70000, False)])
def test_the_small_folder_evaluates_what_onnxscript_leaves(size, folds):
    """A small ConstantOfShape is evaluated; above 65536 elements it stays (the near miss: only shape-sized
    arithmetic is folded here, never a weight-sized tensor)."""
    irm, counts = rewritten(_fills(size), constants.fold_constants, constants.fold_small)
    assert counts["small constants folded"] == int(folds)
    assert dict(ops(irm)) == ({"Add": 1} if folds else {"ConstantOfShape": 1, "Add": 1})


def test_the_fold_rounds_run_until_a_round_folds_nothing():
    """A Shape of a Reshape to a shape the first round folds is known after the second round's shape inference:
    three rounds (the last folds nothing), each recorded as a step of its own."""
    fill = onnx.numpy_helper.from_array(np.array([3], np.int64))
    m = model([n("ConstantOfShape", ["two"], ["dims"], value=fill), n("Reshape", ["x", "dims"], ["sq"]),
               n("Shape", ["sq"], ["s"]), n("Reshape", ["z", "s"], ["zs"]), n("Add", ["sq", "zs"], ["y"])],
              {"x": [9], "z": [9]}, {"y": None}, {"two": np.array([2])})
    records = run_passes(irm := to_ir(m), [_declared("fold_rounds")])
    assert [r.name for r in records] == [f"fold_rounds[{i}]/{s}" for i in (1, 2, 3) for s in ("shapes", "fold_small")]
    assert [r.result.counts["small constants folded"] for r in records[1::2]] == [1, 1, 0]
    assert dict(ops(irm)) == {"Reshape": 2, "Add": 1}


def test_every_node_is_named():
    m = model([n("Relu", ["x"], ["r"]), n("Sigmoid", ["r"], ["y"])], {"x": [2]}, {"y": [2]})
    m.graph.node[1].name = "kept"
    irm, counts = rewritten(m, constants.name_nodes)
    assert counts["nodes and values named"] == 1
    assert all(node.name for node in irm.graph) and [x.name for x in irm.graph][1] == "kept"
    _, again = rewritten(onnx.shape_inference.infer_shapes(m), constants.name_nodes, constants.name_nodes)
    assert again["nodes and values named"] == 1  # the second finds every node named


# ---- crops of constants -----------------------------------------------------------------------------------------

def _crops(step: int = 1) -> onnx.ModelProto:
    """SD3's position-embedding table [1, P*P, C] cropped to the image's tokens (a Slice), then reshaped."""
    return model([n("Slice", ["table", "s0", "s1", "ax", "st"], ["crop"]), n("Reshape", ["crop", "shape"], ["pos"]),
                  n("Add", ["x", "pos"], ["y"])], {"x": [1, 3, 2, 4]}, {"y": [1, 3, 2, 4]},
                 {"table": w(1, 16, 4), "s0": np.array([2]), "s1": np.array([2 + 6 * step]), "ax": np.array([1]),
                  "st": np.array([step]), "shape": np.array([1, 3, 2, 4])})


@pytest.mark.parametrize(("step", "crops"), [(1, 2), (2, 0)])
def test_crops_of_a_constant_are_constants_and_are_recorded(step, crops):
    """The Slice (steps of one) and the Reshape after it become one constant derived from the table (the Reshape
    reads the derived crop in the same walk); ``finish`` records the table as cropped for this size. Near miss:
    a Slice with step 2 (a crop is a contiguous range) stays, and nothing is recorded."""
    m = _crops(step)
    irm, counts = rewritten(m, constants.raise_opset, constants.crop_constants, sweep, constants.finish_canonical_form)
    assert counts["crops of constants folded"] == crops
    assert dict(ops(irm)) == ({"Add": 1} if crops else {"Slice": 1, "Reshape": 1, "Add": 1})
    assert irm.metadata_props.get(SIZED_CONSTANTS_KEY) == ("table" if crops else None)
    if crops:
        assert "table" not in irm.graph.initializers  # the derived crop replaced it


def test_the_crop_rounds_stop_when_a_round_crops_nothing():
    irm = to_ir(_crops())
    records = run_passes(irm, [_declared("crop_rounds")])
    assert [r.name for r in records] == [f"crop_rounds[{i}]/{s}" for i in (1, 2) for s in ("crop", "sweep")]
    assert [r.result.counts for r in records] == [{"crops of constants folded": 2}, {"dead nodes removed": 2},
                                                  {"crops of constants folded": 0}, {"dead nodes removed": 0}]


# ---- finish -----------------------------------------------------------------------------------------------------

def test_finish_keeps_the_output_names_and_removes_what_nobody_reads():
    m = model([n("Relu", ["x"], ["y"]), n("Sigmoid", ["x"], ["unread"])], {"x": [2]}, {"y": [2]},
              {"unused": w(2)})
    irm = to_ir(m)
    constants.raise_opset(irm)  # notes the outputs' names and the node count
    irm.graph.outputs[0].name = "renamed"  # as a folded If hands its branch's output name up
    result = constants.finish_canonical_form(irm)
    assert result.modified and result.counts == {"nodes removed": 1}
    assert [v.name for v in irm.graph.outputs] == ["y"] and "unused" not in irm.graph.initializers
    assert dict(ops(irm)) == {"Relu": 1}


# ---- input shapes -----------------------------------------------------------------------------------------------

def _dynamic() -> onnx.ModelProto:
    g = helper.make_graph([n("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", T.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["b", 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def test_input_shapes_are_bound_and_carried_through():
    irm = to_ir(_dynamic())
    constants.bind_input_shapes(irm, {"x": [2, 4]})
    constants.infer_shapes(irm)
    assert list(irm.graph.inputs[0].shape) == [2, 4] and list(irm.graph.outputs[0].shape) == [2, 4]


@pytest.mark.parametrize(("shapes", "message"), [({"z": [2, 4]}, "the model has no input 'z'"),
                                                 ({"x": [2, 4, 1]}, "has rank 2, not 3"),
                                                 ({"x": [2, 5]}, "cannot make it")])
def test_an_input_shape_that_cannot_be_bound_is_one_line(shapes, message):
    with pytest.raises(SdnpuError, match=message):
        constants.bind_input_shapes(to_ir(_dynamic()), shapes)
