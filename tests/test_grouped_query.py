"""Grouped-query attention as Lumina 2 brought it, through the whole compiler: the canonical steps' Tile repeats,
NaN guards and neutral masks, then the attention rule's grouped-query heads and guarded CPU attention: what they
rewrite, what they leave, and that the numbers stay. (Lumina 2's unrolled loops: tests/test_canonical_loops.py.)"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdnpu.onnxrun import run_onnx

B, S, C = 2, 3, 4


def _model(nodes: list, inputs: dict[str, tuple[int, ...]], output: str, shape: tuple[int, ...], inits: dict) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _attention(mask: str, guard: bool) -> onnx.ModelProto:
    """q in 4 heads, k and v in 2 heads repeated twice (Unsqueeze, Tile, Reshape), scores scaled, ``mask`` added
    (``zeros``: [B, 1, 1, S] of 0; ``padding``: -inf on the last key of batch row 0; ``all``: every key of batch
    row 0; ``computed``: 0 / -inf from an input ``keep`` [B, S] > 0, as TorchScript writes a boolean mask),
    Softmax, the NaN guard or not, times v, heads merged."""
    h, kv, d = 4, 2, 2
    nodes = [helper.make_node("Reshape", ["q", "qs"], ["q4"]), helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3])]
    inits = {"qs": np.asarray([B, S, h, d], np.int64), "kvs": np.asarray([B, S, kv, d], np.int64),
             "ax3": np.asarray([3], np.int64), "reps": np.asarray([1, 1, 1, 2, 1], np.int64),
             "hs": np.asarray([B, S, h, d], np.int64), "scale": np.asarray(d ** -0.5, np.float32),
             "zero": np.asarray([0.0], np.float32), "flat": np.asarray([B, S, h * d], np.int64)}
    for t, perm in (("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes += [helper.make_node("Reshape", [t, "kvs"], [f"{t}4"]), helper.make_node("Unsqueeze", [f"{t}4", "ax3"], [f"{t}5"]),
                  helper.make_node("Tile", [f"{t}5", "reps"], [f"{t}t"]), helper.make_node("Reshape", [f"{t}t", "hs"], [f"{t}r"]),
                  helper.make_node("Transpose", [f"{t}r"], [f"{t}h"], perm=perm)]
    nodes += [helper.make_node("MatMul", ["qh", "kh"], ["qk"]), helper.make_node("Mul", ["qk", "scale"], ["sc"])]
    scores = "sc"
    inputs = {"q": (B, S, h * d), "k": (B, S, kv * d), "v": (B, S, kv * d)}
    if mask == "computed":
        inputs["keep"] = (B, S)
        inits |= {"keep_shape": np.asarray([B, 1, 1, S], np.int64), "nothing": np.asarray(0.0, np.float32),
                  "ninf": np.asarray(-np.inf, np.float32)}
        nodes += [helper.make_node("Greater", ["keep", "nothing"], ["kept"]),
                  helper.make_node("Reshape", ["kept", "keep_shape"], ["kept4"]),
                  helper.make_node("Where", ["kept4", "nothing", "ninf"], ["mask"]),
                  helper.make_node("Add", ["sc", "mask"], ["masked"])]
        scores = "masked"
    elif mask != "none":
        m = np.zeros((B, 1, 1, S), np.float32)
        if mask == "padding":
            m[0, 0, 0, -1] = -np.inf
        elif mask == "all":
            m[0] = -np.inf
        inits["mask"] = m
        nodes.append(helper.make_node("Add", ["sc", "mask"], ["masked"]))
        scores = "masked"
    nodes.append(helper.make_node("Softmax", [scores], ["p"], axis=-1))
    probs = "p"
    if guard:
        nodes += [helper.make_node("IsNaN", ["p"], ["nan"]), helper.make_node("Where", ["nan", "zero", "p"], ["pg"])]
        probs = "pg"
    nodes += [helper.make_node("MatMul", [probs, "vh"], ["o"]), helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["ot", "flat"], ["y"])]
    return _model(nodes, inputs, "y", (B, S, h * d), inits)


@pytest.mark.parametrize(("mask", "guard", "channel"), [
    ("zeros", True, False),   # no mask, no NaN: the guard and the zeros go, the NPU takes it
    ("none", False, False),
    # a per-batch row of -inf, constant or computed, which the kernel's one load-time row cannot be: a channel of
    # Q and K (the heads 4x as wide), the guard's zeros from one more key that only an all-masked row picks
    ("padding", True, True),
    ("all", True, True),  # a batch row without keys: the guard gives its zeros
    ("computed", True, True),
    ("computed", False, True),
])
def test_grouped_query_attention(mask, guard, channel, tmp_path):
    from sdnpu.convert.compile import compile_file

    model = _attention(mask, guard)
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    report = compile_file(path, tmp_path / "dd")
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "dd" / "replaced.onnx")).graph.node)
    assert ops["Tile"] == 0, ops  # the heads repeated by a Concat: on the NPU where the attention is
    assert ops["SDFlatMHA"] == 1 and ops["IsNaN"] == 0 and ops["Softmax"] == 0 and ops["MultiHeadAttention"] == 0, ops
    # the repeats' two SDConcats; with the channel Q's, K's two (d = 2: the mask right after k, then zeros), V's,
    # the sentinel key's two under the guard, the 2q SDMul and the SDGemm that keeps each head's first quarter
    concats = 2 + (4 + 2 * guard if channel else 0)
    assert ops["SDConcat"] == concats and ops["SDGemm"] == ops["SDMul"] == int(channel), ops
    # the computed mask's CPU side: its Greater, Reshape, Where, the expansion over the heads and its Reshape
    cpu = {"Greater", "Where", "Reshape", "Expand"} if mask == "computed" else set()
    assert {n["op_type"] for n in report["cpu_nodes"]} - {"CastAvx"} == cpu, report["cpu_nodes"]
    assert report["summary"]["offloaded_nodes"] == 1 + concats + 2 * channel
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal((B, S, n)).astype(np.float32) for k, n in (("q", 8), ("k", 4), ("v", 4))}
    draws = [feeds]
    if mask == "computed":  # some keys masked; then every key of batch row 0
        draws = [feeds | {"keep": np.asarray([[1, -1, 1], [1, 1, -1]], np.float32)},
                 feeds | {"keep": np.asarray([[-1, -1, -1], [1, -1, 1]], np.float32)}]
    for f in draws:
        want = run_onnx(path, f)["y"]
        got = run_onnx(tmp_path / "dd" / "replaced.onnx", f)["y"]
        assert np.array_equal(np.isnan(want), np.isnan(got))
        if not np.isnan(want).any():
            assert np.isfinite(got).all()
        if mask == "all" or (guard and f.get("keep", np.ones(1))[0].max() < 0):
            assert not want[0].any() and not got[0].any()  # every query of batch row 0 lost its keys: zeros
        # bf16 on the NPU: within bf16's half step 2^-9 of the range, twice (measured 1.4e-3)
        ok = ~np.isnan(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=0, atol=2 * 2.0 ** -9 * np.abs(want[ok]).max())
