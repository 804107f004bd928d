"""Shared by the tests of HTP's forms (``tests/test_htp_<module>.py``, ``sdnpu.passes.htp``): the tolerance of a
float32 rewrite, the comparison before and after (onnx's full check, onnxruntime's numbers), the cosine, a graph
run on Qualcomm's compiler and its HTP emulator, and SD3's patch embedding (the five nodes of the fault the norms'
rewrite avoids; the standard pipeline's test reads it too)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from .graphs import feeds_for, model, run, to_proto

FP32 = dict(rtol=1e-5, atol=1e-5)  # float32's rounding: the rewrites reorder or negate, nothing more


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def same(before: onnx.ModelProto, after, tol=FP32) -> None:
    proto = to_proto(after) if not isinstance(after, onnx.ModelProto) else after
    onnx.checker.check_model(proto, full_check=True)
    feeds = feeds_for(before)
    for a, b in zip(run(before, feeds), run(proto, feeds), strict=True):
        np.testing.assert_allclose(b, a, **tol)


def on_htp(m: onnx.ModelProto, path, feeds):
    """``m`` compiled by QNN's compiler and run on the HTP (its emulator off a Snapdragon): its first output; the
    test is skipped where onnxruntime-qnn is not installed."""
    qnn = pytest.importorskip("sdnpu.backends.qnn_htp")
    onnx.save(m, str(path))
    sess = qnn.session(path)
    return sess.run(None, feeds)[0]


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


def attention(m: int = 16, n: int = 20, heads: int = 6, *, d: int = 8, mask_rows: bool = True,
              read_probs: bool = False, transposed: bool = False) -> onnx.ModelProto:
    """softmax((Q Kᵀ) s + bias + mask) V over [2, heads, m, n] scores, as diffusers' eager attentions export it: a
    scale, a per-head bias ([1, heads, m, n]) and a mask broadcast along the heads ([1, 1, m, n], or [1, 1, 1, n]
    a key mask, without ``mask_rows``); the probabilities a graph output too with ``read_probs``, the output
    also read through a Transpose to [2, m, heads, d] with ``transposed``."""
    from onnx import TensorProto as T

    rng = np.random.default_rng(0)
    b = 2
    mask = np.where(rng.random((1, 1, m if mask_rows else 1, n)) > 0.2, 0, -1e4).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(mask, "mask"),
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
    if transposed:
        nodes.append(helper.make_node("Transpose", ["o"], ["y"], perm=[0, 2, 1, 3]))
        outs.append(helper.make_tensor_value_info("y", T.FLOAT, [b, m, heads, d]))
    ins = [helper.make_tensor_value_info(x, T.FLOAT, [b, heads, m if x == "q" else n, d]) for x in "qkv"]
    g = helper.make_graph(nodes, "attention", ins, outs, initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]))
