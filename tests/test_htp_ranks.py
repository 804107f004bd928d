"""Nodes the HTP refuses for their rank or type, in forms it takes (``sdnpu.passes.htp.ranks``, the standard
pipeline's ``htp_ranks``) on small graphs in the zoo's spellings, as op counts and ranks, onnx's full check and
onnxruntime's numbers before and after (data movement and sums over the same elements: exact in fp32); then one
graph of all of them on Qualcomm's compiler and its HTP emulator, taken whole and computed right."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from sdnpu.passes.pipeline import CompileOptions, compile_model

from .graphs import model, ops, to_ir, to_proto
from .htp_graphs import FP32, same

QNN = CompileOptions.named("qnn-htp")


def _counts(m: onnx.ModelProto) -> tuple[dict[str, int], onnx.ModelProto]:
    after = to_ir(m)
    records = compile_model(after, QNN)
    return {r.name: r.result.counts for r in records}["htp_ranks"], to_proto(after)


def _max_rank(m: onnx.ModelProto, op_types: tuple[str, ...] | None = None) -> int:
    inferred = onnx.shape_inference.infer_shapes(m)
    shapes = {v.name: len(v.type.tensor_type.shape.dim) for v in [*inferred.graph.value_info, *inferred.graph.input]}
    return max(shapes.get(x, 0) for n in inferred.graph.node if op_types is None or n.op_type in op_types
               for x in [*n.input, *n.output] if x)


def _normalize(opset: int, keepdims: int = 1) -> list[onnx.NodeProto]:
    """``F.normalize(x, dim=1)`` of a 3-D VAE's [B, C, F, H, W] (Qwen-Image's and Wan's RMS norm), as dynamo
    exports it: ReduceL2 over channels, clamped, divided into x (keepdims 0: the norm viewed back)."""
    axes = ([helper.make_node("Constant", [], ["axes"], value=onnx.numpy_helper.from_array(np.asarray([1], np.int64)))]
            if opset >= 18 else [])
    reduce = (helper.make_node("ReduceL2", ["x", "axes"], ["n"], keepdims=keepdims) if opset >= 18 else
              helper.make_node("ReduceL2", ["x"], ["n"], axes=[1], keepdims=keepdims))
    back = [] if keepdims else [helper.make_node("Unsqueeze", ["n", "one"], ["n1"])]
    return [*axes, reduce, *back, helper.make_node("Clip", ["n1" if not keepdims else "n", "eps"], ["c"]),
            helper.make_node("Div", ["x", "c"], ["y"])]


@pytest.mark.parametrize("opset,keepdims", [(17, 1), (18, 1), (18, 0)])
def test_a_rank5_reduction_runs_over_a_lower_rank_view(opset, keepdims):
    inits = {"eps": np.asarray(1e-12, np.float32), "one": np.asarray([1], np.int64)}
    m = model(_normalize(opset, keepdims), {"x": [2, 8, 1, 4, 6]}, {"y": None}, inits, opset=opset)
    counts, after = _counts(m)
    assert counts["reductions over a lower-rank view"] == 1
    assert _max_rank(after, ("ReduceL2",)) <= 4  # [1, 2, 8, 24]: batch, channels, the rest (the 1 gone)
    same(m, after, tol=FP32)


def test_a_reduction_the_table_takes_is_left_as_it_is():
    """The table takes a rank-5 ReduceMean (QNN compiles it): nothing to do."""
    m = model([helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=1)], {"x": [2, 8, 1, 4, 6]},
              {"y": None}, opset=17)
    counts, after = _counts(m)
    assert counts["reductions over a lower-rank view"] == 0 and ops(after) == {"ReduceMean": 1}


def test_gathers_of_rank6_data_run_over_a_rank3_view():
    """HiDream's rotary: ``x.reshape(*x.shape[:-1], -1, 1, 2)`` then ``x[..., 0]`` and ``x[..., 1]`` (QNN: "Failed
    to add node" for the rank-6 Reshape and both Gathers)."""
    nodes = [helper.make_node("Reshape", ["x", "s6"], ["x6"]),
             helper.make_node("Gather", ["x6", "i0"], ["re"], axis=-1),
             helper.make_node("Gather", ["x6", "i1"], ["im"], axis=5),
             helper.make_node("Sub", ["re", "im"], ["y"])]
    inits = {"s6": np.asarray([1, 10, 2, 16, 1, 2], np.int64), "i0": np.asarray(0, np.int64),
             "i1": np.asarray(1, np.int64)}
    m = model(nodes, {"x": [1, 10, 2, 32]}, {"y": None}, inits)
    counts, after = _counts(m)
    assert counts["Gathers of rank-6 data over a rank-3 view"] == 2
    assert _max_rank(after) <= 5 and ops(after)["Reshape"] == 3  # one shared view, a view back for each
    same(m, after, tol=dict(rtol=0, atol=0))


def test_a_bool_gather_nd_gathers_int32():
    """Qwen2's padding mask: ``mask[batch, positions]`` of a bool [B, S] (QNN: "Failed to create GatherND node")."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["m"]),
             helper.make_node("GatherND", ["m", "idx"], ["g"]),
             helper.make_node("Where", ["g", "x", "zero"], ["y"])]
    idx = np.stack(np.meshgrid(np.arange(2), np.arange(7)[::-1], indexing="ij"), -1).astype(np.int64)
    m = model(nodes, {"x": [2, 7]}, {"y": None}, {"zero": np.asarray(0.0, np.float32), "idx": idx})
    counts, after = _counts(m)
    assert counts["bool gathers on int32"] == 1
    assert ops(after)["Cast"] == 2 and ops(after)["GatherND"] == 1
    same(m, after, tol=dict(rtol=0, atol=0))


def _index_upsample(h: int, c: int) -> tuple[list[onnx.NodeProto], dict[str, np.ndarray]]:
    """A 3-D VAE's nearest-exact upsampling of one frame as dynamo exports it (``_unsafe_index``): [1, C, H, W]
    moved to [H, W, 1, C], a GatherND of a constant grid of index pairs, moved back to [1, C, 2H, 2W]."""
    grid = np.stack(np.meshgrid(np.arange(2 * h) // 2, np.arange(2 * h) // 2, indexing="ij"), -1).astype(np.int64)
    return ([helper.make_node("Transpose", ["img"], ["hw"], perm=[2, 3, 0, 1]),
             helper.make_node("GatherND", ["hw", "grid"], ["up_hw"]),
             helper.make_node("Transpose", ["up_hw"], ["up"], perm=[2, 3, 0, 1])], {"grid": grid})


@pytest.mark.parametrize("k_slice", [(2, [5, 5, 1, 3]), (1, [5, 2, 3]), (2, [5, 5, 3])])
def test_a_gather_nd_of_slices_of_two_axes_runs_over_a_flat_view(k_slice):
    """Slices of two or more axes are gathered from the view whose slices have one (QNN computes the first form
    wrong: the emulator test below); a GatherND whose slices have one axis already is left."""
    k, shape = k_slice
    rng = np.random.default_rng(0)
    idx = np.stack([rng.integers(0, shape[a], (4, 6)) for a in range(k)], -1).astype(np.int64)
    m = model([helper.make_node("GatherND", ["x", "idx"], ["y"])], {"x": shape}, {"y": None}, {"idx": idx})
    counts, after = _counts(m)
    flat = len(shape) - k >= 2
    assert counts["GatherND slices viewed flat"] == int(flat)
    assert ops(after).get("Reshape", 0) == (2 if flat else 0)
    onnx.checker.check_model(after, full_check=True)
    same(m, after, tol=dict(rtol=0, atol=0))


def _upsample() -> list[onnx.NodeProto]:
    """Wan 2.2's ``DupUp3D`` over one frame, as dynamo exports it: each pixel of [B, C, 1, H, W] copied 4 times
    along a new axis, the copies moved into 2 x 2 blocks in rank 8, viewed as [B, C, 1, 2H, 2W]."""
    return [helper.make_node("Unsqueeze", ["x", "two"], ["u"]),
            helper.make_node("Expand", ["u", "rep"], ["e"]),
            helper.make_node("Reshape", ["e", "s8"], ["r8"]),
            helper.make_node("Transpose", ["r8"], ["t8"], perm=[0, 1, 2, 5, 6, 3, 7, 4]),
            helper.make_node("Reshape", ["t8", "s5"], ["y"])]


def _upsample_inits(b: int, c: int, h: int, w: int) -> dict[str, np.ndarray]:
    return {"two": np.asarray([2], np.int64), "rep": np.asarray([1, 1, 4, 1, 1, 1], np.int64),
            "s8": np.asarray([b, c, 1, 2, 2, 1, h, w], np.int64),
            "s5": np.asarray([b, c, 1, 2 * h, 2 * w], np.int64)}


def test_a_nearest_upsampling_in_rank8_movements_becomes_a_resize():
    m = model(_upsample(), {"x": [1, 3, 1, 4, 5]}, {"y": None}, _upsample_inits(1, 3, 4, 5))
    counts, after = _counts(m)
    assert counts["nearest upsampling movements -> Resize"] == 1
    assert ops(after)["Resize"] == 1 and _max_rank(after) <= 5
    same(m, after, tol=dict(rtol=0, atol=0))


def test_a_movement_chain_that_is_not_an_upsampling_is_left():
    """The same chain with the copies' axes swapped in the Transpose: a pixel's copies no longer land in its own
    block (a near miss): left as it is."""
    nodes = _upsample()
    nodes[3] = helper.make_node("Transpose", ["r8"], ["t8"], perm=[0, 1, 2, 5, 3, 6, 7, 4])
    inits = _upsample_inits(1, 3, 4, 4)
    inits["s5"] = np.asarray([1, 3, 1, 8, 8], np.int64)
    m = model(nodes, {"x": [1, 3, 1, 4, 4]}, {"y": None}, inits)
    counts, _ = _counts(m)
    assert counts["nearest upsampling movements -> Resize"] == 0


def test_qnn_takes_the_forms_whole_and_computes_them_right(tmp_path):
    """One graph of the forms (and the GatherND QNN takes but computes wrong), on Qualcomm's compiler with CPU
    fallback disabled and its HTP emulator: every node taken (before the rewrites QNN refused each of them: its op
    trace on the zoo's Wan 2.2 and Qwen-Image VAE decoders, HiDream and Qwen2), and the emulated fp16 outputs against
    fp32 (the compile's own check: without the flat view, the GatherND's cosine was 0.014)."""
    pytest.importorskip("sdnpu.backends.qnn_htp")
    from sdnpu.convert.compile import compile_file

    b, c, h, w = 1, 8, 4, 4
    # 130 x 130 index pairs over [65, 65, 1, 8]: 98% of the values wrong on the emulator before the flat view
    up_nodes, up_inits = _index_upsample(65, 8)
    nodes = [*_upsample(), *[helper.make_node(n.op_type, [{"x": "y"}.get(i, i) for i in n.input],
                                              [{"y": "z"}.get(o, o) for o in n.output],
                                              **{a.name: helper.get_attribute_value(a) for a in n.attribute})
                             for n in _normalize(17)],
             helper.make_node("Reshape", ["z", "s6"], ["z6"]),
             helper.make_node("Gather", ["z6", "i0"], ["even"], axis=-1),
             helper.make_node("Gather", ["z6", "i1"], ["odd"], axis=-1),
             helper.make_node("Sub", ["even", "odd"], ["out"]),
             helper.make_node("Greater", ["keep", "zero"], ["pos"]),
             helper.make_node("GatherND", ["pos", "idx"], ["picked"]),
             helper.make_node("Cast", ["picked"], ["mask"], to=T.FLOAT),
             *up_nodes]
    idx = np.stack(np.meshgrid(np.arange(2), np.arange(7)[::-1], indexing="ij"), -1).astype(np.int64)
    inits = {**_upsample_inits(b, c, h, w), "eps": np.asarray(1e-12, np.float32),
             "s6": np.asarray([b, c, 2 * h, w, 1, 2], np.int64), "i0": np.asarray(0, np.int64),
             "i1": np.asarray(1, np.int64), "zero": np.asarray(0.0, np.float32), "idx": idx, **up_inits}
    m = model(nodes, {"x": [b, c, 1, h, w], "keep": [2, 7], "img": [1, 8, 65, 65]},
              {"out": None, "mask": None, "up": None}, inits, opset=17)
    (tmp_path / "m").mkdir()
    onnx.save(m, str(tmp_path / "m" / "model.onnx"))
    report = compile_file(tmp_path / "m" / "model.onnx", tmp_path / "out", QNN)
    fired = next(p["counts"] for p in report["passes"] if p["name"] == "htp_ranks")
    assert all(fired.get(k) for k in ("nearest upsampling movements -> Resize", "reductions over a lower-rank view",
                                      "Gathers of rank-6 data over a rank-3 view", "bool gathers on int32",
                                      "GatherND slices viewed flat")), fired
    q = report["qnn"]
    assert q["whole"] and q["trace"]["unsupported_nodes"] == 0, q["trace"].get("refused")
    assert report["summary"]["cpu_nodes"] == 0  # sdnpu's table agrees
    assert report["fidelity"]["min_cosine"] > 0.999


def test_an_outer_product_einsum_becomes_a_matmul():
    """Flux.1's rotary in its TorchScript export, ``torch.outer(pos, omega)`` as ``Einsum("i,j->ij")``: QNN has no
    form for it ("Einsum unsupported equation: i,j->ij", measured on the zoo's Flux.1, Flux.2 and Chroma); a
    matrix-product Einsum QNN takes stays."""
    nodes = [helper.make_node("Einsum", ["x", "w"], ["y"], equation="i,j->ij"),
             helper.make_node("Einsum", ["y", "v"], ["z"], equation="ij,jk->ik")]
    m = model(nodes, {"x": [6]}, {"z": None}, {"w": np.linspace(0.1, 1.0, 4).astype(np.float32),
                                                "v": np.ones((4, 3), np.float32)})
    counts, after = _counts(m)
    assert counts["refused Einsums -> MatMul"] == 1 and ops(after)["Einsum"] == 1 and ops(after)["MatMul"] == 1
    assert all(n.name for n in after.graph.node)  # named: the table's reasons and QNN's trace name nodes
    same(m, after, tol=dict(rtol=0, atol=0))
