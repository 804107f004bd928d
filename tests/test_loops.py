"""Loops written out (``sdnpu.passes.loops``) and the attention spellings Lumina 2 brought (canonicalize's Tile
repeats, NaN guards and neutral masks; the attention rule's grouped-query heads and guarded CPU attention): what
they rewrite, what they leave, and that the numbers stay."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdnpu.onnxrun import run_onnx
from sdnpu.passes.pipeline import canonicalize

B, S, C = 2, 3, 4


def _model(nodes: list, inputs: dict[str, tuple[int, ...]], output: str, shape: tuple[int, ...], inits: dict) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in inputs.items()],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, shape)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    onnx.checker.check_model(model, full_check=True)
    return model


def _loops(miss: str) -> onnx.ModelProto:
    """Lumina 2's joint sequence (two streams written item by item into zeros), then its unpatchify item by item,
    stacked; ``miss``: a near miss."""
    total = 2 * S + (1 if miss == "unwritten" else 0)
    nodes, inits = [], {"zeros": np.zeros((B, total, C), np.float32)}
    joint = "zeros"
    for i in range(B):
        inits[f"i{i}"] = np.asarray(i, np.int64)
        for k, (src, start) in enumerate((("ctx", 0), ("x", S))):
            inits[f"rows{i}{k}"] = np.stack(np.meshgrid([i], np.arange(start, start + S), indexing="ij"), -1)
            nodes += [helper.make_node("Gather", [src, f"i{i}"], [f"g{i}{k}"], axis=0),
                      helper.make_node("Unsqueeze", [f"g{i}{k}", "ax0"], [f"u{i}{k}"]),
                      helper.make_node("ScatterND", [joint, f"rows{i}{k}", f"u{i}{k}"], [f"j{i}{k}"])]
            joint = f"j{i}{k}"
    inits["ax0"] = np.asarray([0], np.int64)
    nodes.append(helper.make_node("Relu", [joint], ["joint"]))  # the sequence goes through a layer
    order = list(reversed(range(B))) if miss == "out_of_order" else list(range(B))
    items = []
    for n, i in enumerate(order):
        perm = [2, 1, 0] if miss == "other_chain" and n == B - 1 else [1, 2, 0]
        inits.update({"s": np.asarray([S], np.int64), "e": np.asarray([2 * S], np.int64), f"v{n}": np.asarray(
            [S, 1, C] if perm == [1, 2, 0] else [S, C, 1], np.int64)})
        nodes += [helper.make_node("Gather", ["joint", f"i{i}"], [f"item{n}"], axis=0),
                  helper.make_node("Slice", [f"item{n}", "s", "e", "ax0"], [f"sl{n}"]),
                  helper.make_node("Reshape", [f"sl{n}", f"v{n}"], [f"r{n}"]),
                  helper.make_node("Transpose", [f"r{n}"], [f"t{n}"], perm=perm),
                  helper.make_node("Unsqueeze", [f"t{n}", "ax0"], [f"o{n}"])]
        items.append(f"o{n}")
    nodes.append(helper.make_node("Concat", items, ["y"], axis=0))
    return _model(nodes, {"ctx": (B, S, C), "x": (B, S, C)}, "y", (B, 1, C, S), inits)


@pytest.mark.parametrize(("miss", "assembled", "stacked"), [("none", 1, 1), ("unwritten", 0, 1),
                                                           ("out_of_order", 1, 0), ("other_chain", 1, 0)])
def test_unrolled_loops_are_the_batched_movement(miss, assembled, stacked, tmp_path):
    """The joint sequence is one Concat of the two streams (not where a block of the zeros stays unwritten),
    the items' unpatchify one batched Slice, Transpose and Reshape (not stacked out of order, not where one
    item's chain differs); the numbers are the same, element for element."""
    model = _loops(miss)
    ir_model = ir.serde.deserialize_model(model)
    counts = canonicalize(ir_model).counts
    assert counts["assembled by movement -> Concat"] == assembled, counts
    assert counts["stacked per-item chains -> batched"] == stacked, counts
    ops = Counter(n.op_type for n in ir_model.graph)
    if assembled:
        assert ops["ScatterND"] == 0
    if stacked:
        assert ops["Gather"] == (0 if assembled else 2 * B), ops
    rng = np.random.default_rng(0)
    feeds = {"ctx": rng.standard_normal((B, S, C)).astype(np.float32),
             "x": rng.standard_normal((B, S, C)).astype(np.float32)}
    onnx.save(model, tmp_path / "a.onnx")
    ir.save(ir_model, tmp_path / "b.onnx")
    np.testing.assert_array_equal(run_onnx(tmp_path / "b.onnx", feeds)["y"], run_onnx(tmp_path / "a.onnx", feeds)["y"])


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
