"""HTP's forms (``sdnpu.passes.htp``): each rewrite on small graphs, as op counts, onnx's full check and
onnxruntime's numbers before and after (fp32: every rewrite is exact or changes float32's last bits); then the
faults they avoid, reproduced on Qualcomm's compiler and its HTP emulator (onnxruntime-qnn): each graph small,
each QNN session made once."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.formats.keys import FP16_GUARDS_KEY
from sdnpu.passes import htp
from sdnpu.passes.pipeline import CompileOptions, compile_model

from .graphs import feeds_for, model, ops, run, to_ir, to_proto

FP32 = dict(rtol=1e-5, atol=1e-5)  # float32's rounding: the rewrites reorder or negate, nothing more


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _same(before: onnx.ModelProto, after, tol=FP32) -> None:
    proto = to_proto(after) if not isinstance(after, onnx.ModelProto) else after
    onnx.checker.check_model(proto, full_check=True)
    feeds = feeds_for(before)
    for a, b in zip(run(before, feeds), run(proto, feeds), strict=True):
        np.testing.assert_allclose(b, a, **tol)


# --- the SD3 patch-embedding fault ---------------------------------------------------------------------------

def patch_embed(batch: int = 2, c: int = 4, side: int = 16, d: int = 32) -> onnx.ModelProto:
    """SD3's patch embedding, the five nodes that reproduce QNN's fault: Conv(k2, s2) -> Reshape -> Transpose ->
    Add(pos[1, N, D]) -> LayerNormalization (no affine, eps 1e-6)."""
    rng = np.random.default_rng(0)
    n = (side // 2) ** 2
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="conv"),
             helper.make_node("Reshape", ["p", "shape"], ["r"], name="flatten"),
             helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1], name="tokens"),
             helper.make_node("Add", ["t", "pos"], ["h"], name="pos_add"),
             helper.make_node("LayerNormalization", ["h", "one", "zero"], ["y"], axis=-1, epsilon=1e-6,
                              name="norm1")]
    pos = np.sin(np.arange(n * d, dtype=np.float32).reshape(1, n, d) * 0.37)
    inits = {"w": (rng.standard_normal((d, c, 2, 2)) * 0.1).astype(np.float32),
             "b": (rng.standard_normal(d) * 0.1).astype(np.float32),
             "shape": np.asarray([batch, d, n], np.int64), "pos": pos.astype(np.float32),
             "one": np.ones(d, np.float32), "zero": np.zeros(d, np.float32)}
    return model(nodes, {"x": [batch, c, side, side]}, {"y": None}, inits)


def test_a_broadcast_add_before_a_layer_norm_becomes_a_sub_of_its_negation():
    m = patch_embed()
    after = to_ir(m)
    result = htp.rewrite_broadcast_into_layernorm(after)
    assert result.counts["broadcast Add -> Sub before LayerNorm"] == 1
    assert ops(after)["Add"] == 0 and ops(after)["Sub"] == 1 and ops(after)["LayerNormalization"] == 1
    _same(m, after)


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
    _same(m, after)


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


# --- float64 ---------------------------------------------------------------------------------------------------

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


# --- fp16 headroom --------------------------------------------------------------------------------------------

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
    _same(m, after)  # the softmax weights do not change
    assert "masked" in json.loads(after.metadata_props[FP16_GUARDS_KEY])


def test_a_constant_read_outside_the_mask_is_left_alone():
    m = causal_attention()
    m.graph.node.append(helper.make_node("ReduceMin", ["mask"], ["low"], keepdims=0))
    m.graph.output.append(helper.make_tensor_value_info("low", T.FLOAT, []))
    after = to_ir(m)
    assert not htp.clamp_masks(after).modified


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
    _same(m, after, tol=dict(rtol=1e-4, atol=1e-4))  # eps / s**2 and the weights / s: float32's rounding
    assert "big" in json.loads(after.metadata_props[FP16_GUARDS_KEY])


def test_a_large_value_read_by_anything_but_a_norm_is_not_scaled():
    m = overflowing_conv()
    m.graph.output.append(helper.make_tensor_value_info("big", T.FLOAT, [1, 8, 16, 16]))
    after = to_ir(m)
    assert not htp.scale_into_norms(after, {"big": 1e6}).modified


# --- rank-6 unpatchify -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["einsum", "transpose"])
def test_a_rank6_unpatchify_becomes_depth_to_space(spelling):
    n, h, w, p, c = 2, 4, 4, 2, 3
    perm = [0, 5, 1, 3, 2, 4]
    move = (helper.make_node("Einsum", ["x6"], ["y6"], equation="nhwpqc->nchpwq") if spelling == "einsum" else
            helper.make_node("Transpose", ["x6"], ["y6"], perm=perm))
    nodes = [helper.make_node("Reshape", ["x", "s6"], ["x6"]), move,
             helper.make_node("Reshape", ["y6", "s4"], ["y"])]
    m = model(nodes, {"x": [n, h * w, p * p * c]}, {"y": None},
              {"s6": np.asarray([n, h, w, p, p, c], np.int64), "s4": np.asarray([n, c, h * p, w * p], np.int64)})
    after = to_ir(m)
    assert htp.lower_pixel_shuffles(after).counts["rank-6 pixel shuffles -> DepthToSpace"] == 1
    assert ops(after) == {"Reshape": 1, "Transpose": 1, "DepthToSpace": 1}
    _same(m, after, tol=dict(rtol=0, atol=0))  # data movement: the same values exactly


def test_the_standard_pipeline_keeps_the_graphs_signature():
    m = patch_embed()
    after = to_ir(m)
    compile_model(after, CompileOptions.named("qnn-htp"))
    proto = to_proto(after)
    assert [(i.name, i.type) for i in proto.graph.input] == [(i.name, i.type) for i in m.graph.input]
    assert [o.name for o in proto.graph.output] == [o.name for o in m.graph.output]
    _same(m, proto)


# --- the faults, on Qualcomm's compiler and its emulator --------------------------------------------------------

qnn = pytest.importorskip("sdnpu.backends.qnn_htp")


def _on_htp(m: onnx.ModelProto, path, feeds):
    onnx.save(m, str(path))
    sess = qnn.session(path)
    return sess.run(None, feeds)[0]


def test_qnn_computes_the_patch_embedding_wrong_and_its_rewrite_right(tmp_path):
    """The repro: QNN takes the five nodes whole and gives batch row 1 without the addend (measured cosine
    0.93 at this size); the rewritten graph agrees with fp32."""
    m = patch_embed()
    feeds = feeds_for(m)
    ref = run(m, feeds)[0]
    assert _cosine(_on_htp(m, tmp_path / "raw.onnx", feeds), ref) < 0.99
    after = to_ir(m)
    htp.rewrite_broadcast_into_layernorm(after)
    assert _cosine(_on_htp(to_proto(after), tmp_path / "fixed.onnx", feeds), ref) > 0.9999


def test_qnn_loses_an_overflowing_value_and_its_guard_keeps_it(tmp_path):
    """fp16 overflow, proved on a constructed graph: untreated, QNN's output is far off (cosine 0.33 measured);
    with the value scaled into its norm, right."""
    m = overflowing_conv()
    feeds = feeds_for(m)
    ref = run(m, feeds)[0]
    assert _cosine(_on_htp(m, tmp_path / "raw.onnx", feeds), ref) < 0.9
    big = float(np.abs(run(onnx.utils.Extractor(m).extract_model(["x"], ["big"]), feeds)[0]).max())
    after = to_ir(m)
    htp.scale_into_norms(after, {"big": big})
    assert _cosine(_on_htp(to_proto(after), tmp_path / "fixed.onnx", feeds), ref) > 0.9999


def test_qnn_refuses_float64_and_takes_the_float32_tables(tmp_path):
    """QNN refuses the float64 Expand, then fails composing the graph (error 7004): no session at all."""
    m = rotary_in_float64()
    onnx.save(m, str(tmp_path / "raw.onnx"))
    with pytest.raises(Exception):
        qnn.session(tmp_path / "raw.onnx")
    after = to_ir(m)
    htp.demote_float64(after)
    ids = np.arange(64, dtype=np.float32)
    got = _on_htp(to_proto(after), tmp_path / "fixed.onnx", {"ids": ids})
    # the bound: the HTP computes in fp16, whose rounding of an angle up to 63 rad is up to 63 * 2**-11 = 0.031
    # rad, and cos moves by at most that much (measured: 0.027)
    np.testing.assert_allclose(got, run(m, {"ids": ids})[0], atol=63 * 2.0 ** -11)


# --- the RMS norm and the sinusoids ------------------------------------------------------------------------------

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
    _same(m, after)


def timestep_embedding(t: float) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """diffusers' get_timestep_embedding as exported, with Flux's scale: t * 1000, a column, times 8 frequencies
    (10000^(-i/8)), then Cos and Sin concatenated."""
    freqs = np.exp(-np.log(10000.0) * np.arange(8) / 8).astype(np.float32)
    nodes = [helper.make_node("Mul", ["t", "thousand"], ["scaled"]),
             helper.make_node("Unsqueeze", ["scaled", "last"], ["col"]),
             helper.make_node("Mul", ["col", "freqs"], ["angles"]),
             helper.make_node("Cos", ["angles"], ["c"]), helper.make_node("Sin", ["angles"], ["s"]),
             helper.make_node("Concat", ["c", "s"], ["y"], axis=-1)]
    m = model(nodes, {"t": [2]}, {"y": None}, {"thousand": np.float32(1000.0), "last": np.asarray([1], np.int64),
                                               "freqs": freqs})
    return m, {"t": np.asarray([t, 0.25], np.float32)}


def test_sinusoids_are_reduced_exactly_in_float32():
    m, feeds = timestep_embedding(0.987)
    after = to_ir(m)
    assert htp.reduce_angles_exactly(after).counts["sin/cos of x * W reduced exactly"] == 1
    proto = to_proto(after)
    onnx.checker.check_model(proto, full_check=True)
    assert ops(proto)["Sin"] == 1 and ops(proto)["Cos"] == 1 and ops(proto)["Gather"] == 6
    # float32 reference: angles up to 987 rad, each float32-rounded (a few 1e-5 rad); the rewrite reads them from
    # float64 tables, so it is the closer of the two to the exact values
    angles = np.float64(feeds["t"])[:, None] * 1000 * np.exp(-np.log(10000.0) * np.arange(8) / 8)
    exact = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1)
    ours, theirs = run(proto, feeds)[0], run(m, feeds)[0]
    assert np.abs(ours - exact).max() <= np.abs(theirs - exact).max() + 1e-6
    assert np.abs(ours - exact).max() < 1e-4


def test_qnn_computes_large_angles_wrong_and_their_reduction_right(tmp_path):
    """Flux.1's timestep embedding at t = 0.987 (987 rad): the HTP's fp16 product and its Sin drift; reduced
    exactly, the error is fp16's rounding of the values. The NPU reads the input in fp16 (0.987 arrives as
    0.98682: 0.18 rad at this scale, which no rewrite inside the graph can undo), so the reference is the fp32
    graph on the input as the NPU reads it."""
    m, feeds = timestep_embedding(0.987)
    ref = run(m, {k: v.astype(np.float16).astype(np.float32) for k, v in feeds.items()})[0]
    raw = _on_htp(m, tmp_path / "raw.onnx", feeds)
    after = to_ir(m)
    htp.reduce_angles_exactly(after)
    fixed = _on_htp(to_proto(after), tmp_path / "fixed.onnx", feeds)
    assert np.abs(raw - ref).max() > 0.05
    assert np.abs(fixed - ref).max() < 0.01


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
    _same(m, after)


@pytest.mark.parametrize("perm", [[0, 2, 4, 1, 3, 5], [0, 2, 4, 3, 5, 1], [0, 3, 5, 1, 2, 4]],
                         ids=["patchify cpq", "patchify pqc", "other"])
def test_any_rank6_permutation_between_reshapes_becomes_rank4_steps(perm):
    n, c, h, p = 2, 3, 4, 2
    nodes = [helper.make_node("Reshape", ["x", "s6"], ["x6"]), helper.make_node("Transpose", ["x6"], ["y6"], perm=perm),
             helper.make_node("Reshape", ["y6", "s3"], ["y"])]
    m = model(nodes, {"x": [n, c, h * p, h * p]}, {"y": None},
              {"s6": np.asarray([n, c, h, p, h, p], np.int64), "s3": np.asarray([n, h * h, c * p * p], np.int64)})
    after = to_ir(m)
    assert htp.lower_rank6_movements(after).counts["rank-6 permutations -> rank-4 steps"] == 1
    proto = to_proto(after)
    ranks = [len(v.type.tensor_type.shape.dim) for v in onnx.shape_inference.infer_shapes(proto).graph.value_info]
    assert max(ranks) <= 4
    _same(m, proto, tol=dict(rtol=0, atol=0))


def test_a_torchscript_unpatchify_with_computed_shapes_becomes_rank4_steps():
    """CogView4's TorchScript export: ``x.reshape(B, H, W, -1, p, p).permute(...).flatten(4, 5).flatten(2, 3)``, each
    flatten a Reshape to a shape computed from a Shape of the value before it. The pipeline's first fold makes the
    first shape a constant; only shape inference after it lets a second fold see the Shapes (QNN refused the rank-6
    Reshape and Transpose, "Failed to add node", measured)."""
    n, side, p, c = 2, 8, 2, 4

    def const(name: str, v: list[int]) -> onnx.NodeProto:
        return helper.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(v, np.int64)))

    # first a view whose shape is computed too, with a Slice bound from constant arithmetic (TorchScript's
    # ``x.view(*x.shape[:5 % 3], -1)``): its output's shape stays unknown to shape inference until a fold
    nodes = [helper.make_node("Shape", ["x"], ["xs"]), const("b0", [0]), const("five", [5]), const("three", [3]),
             helper.make_node("Mod", ["five", "three"], ["two"]), const("one", [1]),
             helper.make_node("Reshape", ["two", "one"], ["b1"]),
             helper.make_node("Slice", ["xs", "b0", "b1"], ["lead"]), const("tail", [-1]),
             helper.make_node("Concat", ["lead", "tail"], ["view"], axis=0),
             helper.make_node("Reshape", ["x", "view"], ["xv"]),
             const("s6", [n, side, side, -1, p, p]), helper.make_node("Reshape", ["xv", "s6"], ["x6"]),
             helper.make_node("Transpose", ["x6"], ["y6"], perm=[0, 3, 1, 4, 2, 5])]
    prev = "y6"
    for i, keep in enumerate((4, 2)):
        nodes += [helper.make_node("Shape", [prev], [f"shape{i}"]), const(f"lo{i}", [0]), const(f"hi{i}", [keep]),
                  const(f"ax{i}", [0]), helper.make_node("Slice", [f"shape{i}", f"lo{i}", f"hi{i}", f"ax{i}"],
                                                         [f"kept{i}"]),
                  const(f"rest{i}", [-1]), helper.make_node("Concat", [f"kept{i}", f"rest{i}"], [f"to{i}"], axis=0),
                  helper.make_node("Reshape", [prev, f"to{i}"], [f"flat{i}"])]
        prev = f"flat{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    m = model(nodes, {"x": [n, side * side, p * p * c]}, {"y": None})
    bare = onnx.ModelProto()
    bare.CopyFrom(m)
    del bare.graph.value_info[:]  # as an export is: shapes for the inputs and outputs only
    after = to_ir(bare)
    records = compile_model(after, CompileOptions.named("qnn-htp"))
    counts = {r.name: r.result.counts for r in records}
    assert counts["prepare"]["constant folding rounds"] >= 2
    assert counts["htp_rank6"]["rank-6 permutations -> rank-4 steps"] == 1
    proto = to_proto(after)
    ranks = [len(v.type.tensor_type.shape.dim) for v in onnx.shape_inference.infer_shapes(proto).graph.value_info]
    assert max(ranks) <= 5 and "Shape" not in ops(proto)  # the first flatten's rank 5 QNN takes
    _same(m, proto, tol=dict(rtol=0, atol=0))


def test_a_constant_of_a_constant_shape_becomes_the_initializer_it_makes():
    """onnxruntime folds it before QNN sees the graph (ONNX's expanded LayerNorm counts its axes so: QNN took those
    node tests whole while the table refused the ConstantOfShape); onnxscript's folder leaves it. One whose shape
    is not a constant stays."""
    fill = onnx.numpy_helper.from_array(np.asarray([0.5], np.float32))
    nodes = [helper.make_node("ConstantOfShape", ["dims"], ["half"], value=fill),
             helper.make_node("Add", ["x", "half"], ["y"]),
             helper.make_node("Shape", ["x"], ["xs"]),
             helper.make_node("ConstantOfShape", ["xs"], ["zeros"]), helper.make_node("Add", ["y", "zeros"], ["z"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, ["n", 4])],
                          [helper.make_tensor_value_info("z", T.FLOAT, ["n", 4])],
                          [onnx.numpy_helper.from_array(np.asarray([4], np.int64), "dims")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])
    after = to_ir(m)
    records = compile_model(after, CompileOptions.named("qnn-htp"))
    assert records[0].result.counts["ConstantOfShape of a constant shape -> initializer"] == 1
    assert ops(after)["ConstantOfShape"] == 1  # the dynamic one
    proto = to_proto(after)
    onnx.checker.check_model(proto, full_check=True)
    x = {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}
    np.testing.assert_array_equal(run(proto, x)[0], x["x"] + 0.5)
    np.testing.assert_array_equal(run(m, x)[0], run(proto, x)[0])


def test_a_scale_after_the_frequencies_is_folded_too():
    """diffusers' get_timestep_embedding(scale=1000) (AuraFlow) scales the product, not the timestep."""
    freqs = np.exp(-np.log(10000.0) * np.arange(8) / 8).astype(np.float32)
    nodes = [helper.make_node("Unsqueeze", ["t", "last"], ["col"]),
             helper.make_node("Mul", ["col", "freqs"], ["product"]),
             helper.make_node("Mul", ["product", "thousand"], ["angles"]),
             helper.make_node("Sin", ["angles"], ["y"])]
    m = model(nodes, {"t": [2]}, {"y": None}, {"thousand": np.float32(1000.0), "last": np.asarray([1], np.int64),
                                               "freqs": freqs})
    after = to_ir(m)
    assert htp.reduce_angles_exactly(after).counts["sin/cos of x * W reduced exactly"] == 1
    feeds = {"t": np.asarray([0.987, 0.25], np.float32)}
    np.testing.assert_allclose(run(to_proto(after), feeds)[0], run(m, feeds)[0], atol=1e-4)


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
    _same(m, after)


def _attention(read_probs: bool = False, heads: int = 6) -> onnx.ModelProto:
    """softmax((Q Kᵀ) s + bias + mask) V over [2, heads, 16, 20] scores, as diffusers' eager attentions export it:
    a scale, a per-head bias (sliced with the heads) and a mask broadcast along them (read whole by each group)."""
    rng = np.random.default_rng(0)
    b, m, n, d = 2, 16, 20, 8
    inits = [onnx.numpy_helper.from_array(np.where(rng.random((1, 1, m, n)) > 0.2, 0, -1e4).astype(np.float32),
                                          "mask"),
             onnx.numpy_helper.from_array(rng.standard_normal((1, heads, m, n)).astype(np.float32), "bias"),
             onnx.numpy_helper.from_array(np.asarray(0.35, np.float32), "scale")]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "kt"], ["s"]),
             helper.make_node("Mul", ["s", "scale"], ["s2"]),
             helper.make_node("Add", ["bias", "s2"], ["s3"]),
             helper.make_node("Add", ["s3", "mask"], ["s4"]),
             helper.make_node("Softmax", ["s4"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "v"], ["o"])]
    outs = [helper.make_tensor_value_info("o", T.FLOAT, [b, heads, m, d])]
    if read_probs:
        outs.append(helper.make_tensor_value_info("p", T.FLOAT, [b, heads, m, n]))
    ins = [helper.make_tensor_value_info(x, T.FLOAT, [b, heads, m if x == "q" else n, d]) for x in "qkv"]
    g = helper.make_graph(nodes, "attention", ins, outs, initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))


@pytest.mark.parametrize(("limit_heads", "groups"), [(2, [2, 2, 2]), (4, [3, 3]), (1, [1] * 6), (5, [3, 3])])
def test_an_attention_past_the_scores_limit_is_computed_in_head_groups(monkeypatch, limit_heads, groups):
    """The scores past the limit (here ``limit_heads`` heads' worth): the fewest even groups that fit, each its
    own products and softmax over its heads, concatenated; bit for bit the attention's numbers."""
    from sdnpu.passes.htp import heads

    proto = _attention()
    monkeypatch.setattr(heads, "SCORES_LIMIT", limit_heads * 2 * 16 * 20 * 4)
    m = to_ir(proto)
    result = htp.group_attention_heads(m)
    out = to_proto(m)
    onnx.checker.check_model(out, full_check=True)
    assert result.counts == {"attentions in head groups": 1, "head groups": len(groups)}
    assert ops(out)["Softmax"] == ops(out)["Concat"] * len(groups) == len(groups)
    splits = [n for n in out.graph.node if n.op_type == "Split"]
    sizes = {tuple(onnx.numpy_helper.to_array(i)) for i in out.graph.initializer if i.name.endswith("_sizes")}
    assert len(splits) == 4 and sizes == {tuple(groups)}  # Q, Kᵀ, V and the per-head bias; the mask read whole
    feeds = feeds_for(proto)
    np.testing.assert_array_equal(run(out, feeds)[0], run(proto, feeds)[0])


def test_an_attention_within_the_limit_or_whose_probabilities_are_read_keeps_its_form(monkeypatch):
    from sdnpu.passes.htp import heads

    monkeypatch.setattr(heads, "SCORES_LIMIT", 2 * 2 * 16 * 20 * 4)
    m = to_ir(_attention(read_probs=True))
    assert not htp.group_attention_heads(m).modified  # the probabilities are a graph output: nothing to split
    monkeypatch.setattr(heads, "SCORES_LIMIT", 6 * 2 * 16 * 20 * 4)
    assert not htp.group_attention_heads(to_ir(_attention())).modified  # all six heads' scores fit
