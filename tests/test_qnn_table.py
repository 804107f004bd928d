"""The qnn-htp table (``sdnpu.ops.qnn_htp``) and what it says of nodes (``sdnpu.passes.standard``): every entry
cites its source; the limits refuse what QNN's op builders refuse, with the reason; and on ONNX's own node tests
the table and Qualcomm's compiler agree (a sample here, every case in ``bench/bench_qnn_table.py``)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.ops.qnn_htp import SOURCES, arch
from sdnpu.ops.target import get_target
from sdnpu.passes.standard import node_info, refusals

from .graphs import model, to_ir

TARGET = get_target("qnn-htp")


@pytest.mark.parametrize("op", sorted(TARGET.ops))
def test_every_entry_cites_its_source(op):
    spec = TARGET.ops[op]
    assert spec.source.split()[0] in SOURCES, spec.source


def _refusal(nodes, inputs, outputs, inits=None):
    m = to_ir(model(nodes, inputs, outputs, inits))
    return {n.op_type: why for n, why in refusals(m.graph, TARGET).items()}


def test_a_resize_of_the_channels_is_refused_with_qnns_words():
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="nearest")]
    why = _refusal(nodes, {"x": [1, 2, 4, 4]}, {"y": None}, {"scales": np.asarray([1, 2, 2, 2], np.float32)})
    assert "may only change" in why["Resize"]


def test_a_layer_norm_over_other_axes_than_the_last_is_refused():
    nodes = [helper.make_node("LayerNormalization", ["x", "g"], ["y"], axis=1)]
    why = _refusal(nodes, {"x": [2, 4, 8]}, {"y": None}, {"g": np.ones((4, 8), np.float32)})
    assert "only the last axis" in why["LayerNormalization"]


def test_a_rank6_transpose_is_refused():
    nodes = [helper.make_node("Transpose", ["x"], ["y"], perm=[0, 2, 1, 3, 4, 5])]
    why = _refusal(nodes, {"x": [1, 2, 3, 2, 2, 2]}, {"y": None})
    assert "rank-6" in why["Transpose"]


def test_narrow_integer_arithmetic_is_refused_and_wide_is_taken():
    def one(dtype):
        g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info(n, dtype, [4]) for n in "ab"],
                              [helper.make_tensor_value_info("y", dtype, [4])])
        m = ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]))
        return refusals(m.graph, TARGET)
    assert not one(T.INT32) and not one(T.INT64)
    assert "uint8 operands" in next(iter(one(T.UINT8).values()))


def test_float64_and_bfloat16_are_named():
    g = helper.make_graph([helper.make_node("Neg", ["a"], ["y"])], "g",
                          [helper.make_tensor_value_info("a", T.BFLOAT16, [4])],
                          [helper.make_tensor_value_info("y", T.BFLOAT16, [4])])
    m = ir.serde.deserialize_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)]))
    assert "bfloat16" in next(iter(refusals(m.graph, TARGET).values()))


def test_node_info_reads_shapes_types_and_small_constants():
    m = to_ir(model([helper.make_node("Reshape", ["x", "s"], ["y"])], {"x": [2, 6]}, {"y": None},
                    {"s": np.asarray([3, 4], np.int64)}))
    info = node_info(next(iter(m.graph)))
    assert info.inputs[0] == ("FLOAT", (2, 6)) and info.outputs[0] == ("FLOAT", (3, 4)) and 1 in info.constant
    assert list(info.values[1]) == [3, 4]


def test_the_htp_generations():
    assert (arch(None).arch, arch(None).soc_model) == (73, 60)
    assert arch("v81").soc_model == 87 and arch(75).soc_model == 57


# ONNX's node tests where the table and QNN's compiler must agree: taken (True) or refused (False) with CPU
# fallback disabled; one or two cases per family the table has a limit for (all measured with
# bench/bench_qnn_table.py, which runs every case)
AGREED = {"test_add": True, "test_add_int8": False, "test_add_uint32": False, "test_pow_types_int32_int32": False,
          "test_resize_upsample_scales_nearest": True, "test_resize_upsample_scales_cubic": False,
          "test_instancenorm_example": True, "test_group_normalization_example": True, "test_scatternd_max": False,
          "test_max_one_input": False, "test_gathernd_example_int32_batch_dim1": False, "test_not_2d": False,
          "test_reshape_reordered_all_dims": True, "test_softmax_axis_1": True, "test_conv_with_strides_padding": True,
          "test_shape": True, "test_erf": False, "test_gelu_default_1": True, "test_depthtospace_example": True}


def test_the_table_and_qnn_agree_on_onnxs_node_tests(tmp_path):
    qnn = pytest.importorskip("sdnpu.backends.qnn_htp")
    from sdnpu.passes.pipeline import CompileOptions, compile_model

    from .node_tests import cases

    found = {c.name: c for c in cases("^(" + "|".join(AGREED) + ")$")}
    assert set(found) == set(AGREED)
    for name, taken in AGREED.items():
        path = tmp_path / f"{name}.onnx"
        onnx.save(found[name].model, str(path))
        m = ir.load(str(path))
        compile_model(m, CompileOptions.named("qnn-htp"))
        table = not any("sdnpu.cpu_reason" in n.metadata_props for n in m.graph)
        ir.save(m, str(path))
        try:
            qnn.session(path)
            took = True
        except Exception:
            took = False
        assert (table, took) == (taken, taken), name
