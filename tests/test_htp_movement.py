"""Rank-6 movements in rank 4 (a pixel shuffle as DepthToSpace, any other permutation as rank-4 steps)
(``sdnpu.passes.htp.movement``) on small graphs, as op counts, onnx's full check and onnxruntime's numbers before
and after (fp32: every rewrite is exact or changes float32's last bits)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.passes import htp
from sdnpu.passes.pipeline import CompileOptions, compile_model

from .graphs import model, ops, to_ir, to_proto
from .htp_graphs import same


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
    same(m, after, tol=dict(rtol=0, atol=0))  # data movement: the same values exactly


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
    same(m, proto, tol=dict(rtol=0, atol=0))


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
    same(m, proto, tol=dict(rtol=0, atol=0))
