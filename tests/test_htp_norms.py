"""A broadcast into a LayerNormalization and a product with a reciprocal, rewritten (``sdnpu.passes.htp.norms``) on
small graphs, as op counts, onnx's full check and onnxruntime's numbers before and after (fp32: every rewrite is
exact or changes float32's last bits); then the fault the first avoids, reproduced on Qualcomm's compiler and its
HTP emulator (onnxruntime-qnn)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.passes import htp

from .graphs import feeds_for, model, ops, run, to_ir, to_proto
from .htp_graphs import cosine, on_htp, patch_embed, same


# --- the SD3 patch-embedding fault --------------------------------------------------------------------------------

def test_a_broadcast_add_before_a_layer_norm_becomes_a_sub_of_its_negation():
    m = patch_embed()
    after = to_ir(m)
    result = htp.rewrite_broadcast_into_layernorm(after)
    assert result.counts["broadcast Add -> Sub before LayerNorm"] == 1
    assert ops(after)["Add"] == 0 and ops(after)["Sub"] == 1 and ops(after)["LayerNormalization"] == 1
    same(m, after)


def test_a_broadcast_mul_before_a_layer_norm_writes_the_norm_out():
    nodes = [helper.make_node("Mul", ["x", "k"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g", "b"], ["y"], axis=-1, epsilon=1e-5)]
    rng = np.random.default_rng(1)
    m = model(nodes, {"x": [2, 8, 16]}, {"y": None}, {"k": rng.standard_normal((1, 8, 16)).astype(np.float32),
                                                     "g": rng.standard_normal(16).astype(np.float32),
                                                     "b": rng.standard_normal(16).astype(np.float32)})
    after = to_ir(m)
    assert htp.rewrite_broadcast_into_layernorm(after).counts["LayerNorm after a broadcast Mul written out"] == 1
    assert ops(after)["LayerNormalization"] == 0 and ops(after)["ReduceMean"] == 2
    same(m, after)


@pytest.mark.parametrize("addend", [[1, 1, 16], [16], [2, 8, 16]], ids=["channel row", "vector", "full shape"])
def test_an_add_broadcast_only_along_the_last_axis_is_left_alone(addend):
    """The fault needs a broadcast along an axis other than the last (measured: a [1, 1, D] or [D] addend, or a
    full-shape one, is exact): those keep QNN's one LayerNorm."""
    nodes = [helper.make_node("Add", ["x", "k"], ["h"]),
             helper.make_node("LayerNormalization", ["h", "g"], ["y"], axis=-1)]
    m = model(nodes, {"x": [2, 8, 16]}, {"y": None}, {"k": np.ones(addend, np.float32), "g": np.ones(16, np.float32)})
    after = to_ir(m)
    assert not htp.rewrite_broadcast_into_layernorm(after).modified
    assert ops(after)["Add"] == 1


def test_a_cast_to_the_same_type_between_the_add_and_the_norm_is_looked_through():
    """TorchScript's SD3 export writes Add -> Cast(float) -> LayerNormalization: the same fault (measured cosine
    0.856 on the zoo's SD3 transformer before this)."""
    m = patch_embed()
    nodes = list(m.graph.node)
    add = next(n for n in nodes if n.op_type == "Add")
    norm = next(n for n in nodes if n.op_type == "LayerNormalization")
    cast = helper.make_node("Cast", ["h"], ["h_float"], to=T.FLOAT, name="noop_cast")
    norm.input[0] = "h_float"
    m.graph.node.insert(list(m.graph.node).index(add) + 1, cast)
    after = to_ir(m)
    assert htp.rewrite_broadcast_into_layernorm(after).counts["broadcast Add -> Sub before LayerNorm"] == 1
    same(m, after)


# --- the RMS norm -------------------------------------------------------------------------------------------------

def rms_norm(d: int = 16) -> onnx.ModelProto:
    """T5's RMS norm as exported: Pow, ReduceMean, Add(eps), Sqrt, Reciprocal, Mul, then its weight times that
    (the weight first: the order that fails QNN's compile)."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["sq"]),
             helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
             helper.make_node("Add", ["ms", "eps"], ["mse"]),
             helper.make_node("Sqrt", ["mse"], ["rms"]),
             helper.make_node("Reciprocal", ["rms"], ["inv"]),
             helper.make_node("Mul", ["x", "inv"], ["normed"]),
             helper.make_node("Mul", ["gamma", "normed"], ["y"])]
    rng = np.random.default_rng(3)
    return model(nodes, {"x": [1, 8, d]}, {"y": None},
                 {"two": np.float32(2.0), "axes": np.asarray([-1], np.int64), "eps": np.float32(1e-6),
                  "gamma": rng.standard_normal(d).astype(np.float32)})


def test_a_product_with_a_reciprocal_becomes_a_division():
    m = rms_norm()
    after = to_ir(m)
    assert htp.divide_reciprocal_products(after).counts["x * (1 / d) -> x / d"] == 1
    assert ops(after)["Reciprocal"] == 0 and ops(after)["Div"] == 1
    same(m, after)


# --- the fault, on Qualcomm's compiler and its emulator -----------------------------------------------------------

def test_qnn_computes_the_patch_embedding_wrong_and_its_rewrite_right(tmp_path):
    """The repro: QNN takes the five nodes whole and gives batch row 1 without the addend (measured cosine
    0.93 at this size); the rewritten graph agrees with fp32."""
    m = patch_embed()
    feeds = feeds_for(m)
    ref = run(m, feeds)[0]
    assert cosine(on_htp(m, tmp_path / "raw.onnx", feeds), ref) < 0.99
    after = to_ir(m)
    htp.rewrite_broadcast_into_layernorm(after)
    assert cosine(on_htp(to_proto(after), tmp_path / "fixed.onnx", feeds), ref) > 0.9999
