"""fp16's range guarded: attention masks' minus infinity raised, values near 65504 scaled into their norms
(``sdnpu.passes.htp.headroom``) on small graphs, as op counts, onnx's full check and onnxruntime's numbers before
and after (fp32: every rewrite is exact or changes float32's last bits); then the overflow the second avoids, on
Qualcomm's compiler and its HTP emulator (onnxruntime-qnn)."""

from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper

from sdnpu.formats.keys import FP16_GUARDS_KEY
from sdnpu.passes import htp

from .graphs import feeds_for, model, run, to_ir, to_proto
from .htp_graphs import cosine, on_htp, same


# --- attention masks ----------------------------------------------------------------------------------------------

def causal_attention() -> onnx.ModelProto:
    """CLIP's self-attention as exported: scores plus a constant causal mask of float32's lowest value."""
    n = 8
    mask = np.triu(np.full((n, n), np.finfo(np.float32).min, np.float32), 1)[None, None]
    nodes = [helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Add", ["s", "mask"], ["masked"]),
             helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["y"])]
    return model(nodes, {"q": [1, 2, n, 4], "kt": [1, 2, 4, n], "v": [1, 2, n, 4]}, {"y": None}, {"mask": mask})


def test_an_attention_mask_below_fp16s_range_is_raised_to_minus_1e4():
    m = causal_attention()
    after = to_ir(m)
    assert htp.clamp_masks(after).counts["attention masks -> -1e4"] == 1
    mask = after.graph.initializers["mask"].const_value.numpy()
    assert mask.min() == htp.MASK_FLOOR and (mask[0, 0, 0, 1:] == htp.MASK_FLOOR).all() and mask[0, 0, 1, 0] == 0
    same(m, after)  # the softmax weights do not change
    assert "masked" in json.loads(after.metadata_props[FP16_GUARDS_KEY])


def test_a_constant_read_outside_the_mask_is_left_alone():
    m = causal_attention()
    m.graph.node.append(helper.make_node("ReduceMin", ["mask"], ["low"], keepdims=0))
    m.graph.output.append(helper.make_tensor_value_info("low", T.FLOAT, []))
    after = to_ir(m)
    assert not htp.clamp_masks(after).modified


def test_a_mask_every_layer_shares_is_raised_once_for_all():
    """CLIP's causal mask is one constant read by every layer's attention: its readers count together."""
    n = 8
    mask = np.triu(np.full((n, n), np.finfo(np.float32).min, np.float32), 1)[None, None]
    nodes = []
    for i in range(2):
        nodes += [helper.make_node("MatMul", ["q", "kt"], [f"s{i}"]),
                  helper.make_node("Add", [f"s{i}", "mask"], [f"masked{i}"]),
                  helper.make_node("Softmax", [f"masked{i}"], [f"p{i}"], axis=-1)]
    nodes.append(helper.make_node("Add", ["p0", "p1"], ["y"]))
    m = model(nodes, {"q": [1, 2, n, 4], "kt": [1, 2, 4, n]}, {"y": None}, {"mask": mask})
    after = to_ir(m)
    assert htp.clamp_masks(after).counts["attention masks -> -1e4"] == 1
    guarded = json.loads(after.metadata_props[FP16_GUARDS_KEY])
    assert {"masked0", "masked1"} <= set(guarded)
    same(m, after)


# --- values near fp16's limit -------------------------------------------------------------------------------------

def overflowing_conv(scale: float = 30000.0) -> onnx.ModelProto:
    """A Conv whose outputs pass fp16's largest value (65504), read only by a norm: the norm's output is small,
    the value between is not."""
    rng = np.random.default_rng(0)
    c = 8
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["big"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("InstanceNormalization", ["big", "s", "t"], ["y"], epsilon=1e-5, name="norm")]
    return model(nodes, {"x": [1, c, 16, 16]}, {"y": None},
                 {"w": (rng.standard_normal((c, c, 3, 3)) * scale).astype(np.float32),
                  "b": (rng.standard_normal(c) * 100).astype(np.float32), "s": np.ones(c, np.float32),
                  "t": np.zeros(c, np.float32)})


def test_a_value_near_fp16s_limit_is_scaled_into_the_norm_that_reads_it():
    m = overflowing_conv()
    big = float(np.abs(run(onnx.utils.Extractor(m).extract_model(["x"], ["big"]), feeds_for(m))[0]).max())
    assert big > 65504
    after = to_ir(m)
    assert htp.scale_into_norms(after, {"big": big}).counts["linear -> norm scaled into fp16"] == 1
    same(m, after, tol=dict(rtol=1e-4, atol=1e-4))  # eps / s**2 and the weights / s: float32's rounding
    assert "big" in json.loads(after.metadata_props[FP16_GUARDS_KEY])


def test_a_large_value_read_by_anything_but_a_norm_is_not_scaled():
    m = overflowing_conv()
    m.graph.output.append(helper.make_tensor_value_info("big", T.FLOAT, [1, 8, 16, 16]))
    after = to_ir(m)
    assert not htp.scale_into_norms(after, {"big": 1e6}).modified


# --- the fault, on Qualcomm's compiler and its emulator -----------------------------------------------------------

def test_qnn_loses_an_overflowing_value_and_its_guard_keeps_it(tmp_path):
    """fp16 overflow, proved on a constructed graph: untreated, QNN's output is far off (cosine 0.33 measured);
    with the value scaled into its norm, right."""
    m = overflowing_conv()
    feeds = feeds_for(m)
    ref = run(m, feeds)[0]
    assert cosine(on_htp(m, tmp_path / "raw.onnx", feeds), ref) < 0.9
    big = float(np.abs(run(onnx.utils.Extractor(m).extract_model(["x"], ["big"]), feeds)[0]).max())
    after = to_ir(m)
    htp.scale_into_norms(after, {"big": big})
    assert cosine(on_htp(to_proto(after), tmp_path / "fixed.onnx", feeds), ref) > 0.9999
