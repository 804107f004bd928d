"""The layout pass on small graphs: the NCHW<->NHWC Transposes the fusions put around each NHWC dispatch op cancel
where two meet, travel through the element-wise ops between them (their constants permuted offline), and
movement chains simplify; the numbers stay (fp32: layout changes no precision) and the graph stays valid."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from sdnpu.ops.target import get_target
from sdnpu.passes.fuse import fuse
from sdnpu.passes.layout import lay_out_nhwc
from sdnpu.passes.pipeline import canonicalize

from .graphs import feeds_for, model, ops, run, to_ir, with_functions
from .lowering import n, w

TARGET = get_target()


def conv(x: str, y: str, c: int = 8) -> tuple[onnx.NodeProto, dict[str, np.ndarray]]:
    return n("Conv", [x, f"w{y}", f"b{y}"], [y], pads=[1, 1, 1, 1]), {f"w{y}": w(c, 8, 3, 3), f"b{y}": w(c)}


def fused(m: onnx.ModelProto):
    irm = to_ir(m)
    canonicalize(irm)
    fuse(irm, TARGET)
    return irm


def assert_same(m: onnx.ModelProto, irm) -> None:
    out = with_functions(irm, TARGET)
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(m)
    for a, b in zip(run(m, feeds), run(out, feeds), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)


def two_convs(between: list[onnx.NodeProto] | None = None, inits: dict | None = None) -> onnx.ModelProto:
    c1, i1 = conv("x", "h")
    c2, i2 = conv("g" if between else "h", "y")
    return model([c1, *(between or []), c2], {"x": [1, 8, 6, 6]}, {"y": [1, 8, 6, 6]}, {**i1, **i2, **(inits or {})})


def test_the_boundary_between_two_nhwc_ops_cancels():
    m = two_convs()
    irm = fused(m)
    assert ops(irm)["Transpose"] == 4  # each SDConv wrapped: NCHW->NHWC before, NHWC->NCHW after
    result = lay_out_nhwc(irm)
    assert result.modified and result.counts["transposes cancelled"] >= 1
    assert ops(irm)["Transpose"] == 2 and ops(irm)["SDConv"] == 2  # only the graph's own edge
    assert_same(m, irm)


def test_transposes_travel_through_elementwise_ops_and_permute_their_constants():
    """conv -> Add(bias [1, C, 1, 1]) -> Mul(scale) -> conv: the Transposes meet past both ops, the bias is
    stored [1, 1, 1, C]."""
    m = two_convs([n("Add", ["h", "bias"], ["a"]), n("Mul", ["a", "k"], ["g"])],
                  {"bias": w(1, 8, 1, 1), "k": np.array(0.5, np.float32)})
    irm = fused(m)
    result = lay_out_nhwc(irm)
    assert result.counts["transposes pushed"] >= 2
    assert ops(irm)["Transpose"] == 2
    add = next(node for node in irm.graph if node.op_type == "Add")
    bias = next(v for v in add.inputs if v.const_value is not None)
    assert list(bias.shape) == [1, 1, 1, 8]
    assert_same(m, irm)


def test_a_4d_graph_input_meeting_nhwc_values_turns_nhwc_at_the_edge():
    """conv(x) + r, then conv: r (a residual entering the graph) gets its own NCHW->NHWC Transpose instead of
    the conv's value going back to NCHW around the Add."""
    c1, i1 = conv("x", "h")
    c2, i2 = conv("g", "y")
    m = model([c1, n("Add", ["h", "r"], ["g"]), c2], {"x": [1, 8, 6, 6], "r": [1, 8, 6, 6]}, {"y": [1, 8, 6, 6]},
              {**i1, **i2})
    irm = fused(m)
    lay_out_nhwc(irm)
    readers = [node for node in irm.graph if node.op_type == "Transpose" and node.inputs[0].name == "r"]
    assert len(readers) == 1 and list(readers[0].attributes["perm"].value) == [0, 2, 3, 1]
    assert ops(irm)["Transpose"] == 3  # x in, r in, y out
    assert_same(m, irm)


@pytest.mark.parametrize("perms, left", [([[0, 2, 3, 1], [0, 3, 1, 2]], 0), ([[0, 2, 3, 1], [0, 2, 3, 1]], 1)],
                         ids=["inverse pair: gone", "not inverse: one composed Transpose"])
def test_transpose_pairs_compose(perms, left):
    nodes = [n("Transpose", ["x"], ["t1"], perm=perms[0]), n("Transpose", ["t1"], ["t2"], perm=perms[1]),
             n("Relu", ["t2"], ["y"])]
    shape = list(np.transpose(np.zeros((1, 2, 3, 4)), perms[0]).transpose(perms[1]).shape)
    m = model(nodes, {"x": [1, 2, 3, 4]}, {"y": shape})
    irm = to_ir(m)
    lay_out_nhwc(irm)
    assert ops(irm)["Transpose"] == left and ops(irm)["Relu"] == 1
    assert_same(m, irm)


def test_a_reshape_transpose_chain_that_only_reshapes_becomes_one_reshape():
    """Reshape [1, 24] -> [1, 6, 1, 4], a Transpose that swaps the size-1 axis with its neighbour, a Reshape to
    [1, 6, 4]: movement that keeps the element order, so one Reshape does it."""
    nodes = [n("Reshape", ["x", "s1"], ["a"]), n("Transpose", ["a"], ["b"], perm=[0, 2, 1, 3]),
             n("Reshape", ["b", "s2"], ["c"]), n("Relu", ["c"], ["y"])]
    m = model(nodes, {"x": [1, 24]}, {"y": [1, 6, 4]},
              {"s1": np.array([1, 6, 1, 4]), "s2": np.array([1, 6, 4])})
    irm = to_ir(m)
    result = lay_out_nhwc(irm)
    assert result.counts["chains simplified"] == 1
    assert ops(irm)["Transpose"] == 0 and ops(irm)["Reshape"] == 1
    assert_same(m, irm)


def test_nothing_to_do_is_reported_as_no_change():
    m = model([n("Relu", ["x"], ["y"])], {"x": [1, 8, 6, 6]}, {"y": [1, 8, 6, 6]})
    result = lay_out_nhwc(to_ir(m))
    assert not result.modified and not any(result.counts.values())


@pytest.mark.parametrize("chain", ["frame_swap", "head_split", "channels_split"])
def test_a_chain_that_swaps_frames_and_pixels_is_written_as_the_swap(chain):
    """ModelScope's temporal transformer reads NHWC frames [B, F*H, W, C] as NCHW, views them [B, C, F, H, W]
    and permutes them to [B, H, W, F, C]: three nodes whose movement is the frame swap of [B, F, H*W, C]
    (``layout.frame_swap``), written as a Reshape, Transpose(0, 2, 1, 3) and a Reshape. Near misses keep their
    chains: a head split (the channels cut: not a swap of whole tokens) and a Transpose of the channels."""
    b, f, h, wd, c = 1, 2, 3, 4, 8
    if chain == "frame_swap":
        nodes = [n("Transpose", ["x"], ["a"], perm=[0, 3, 1, 2]), n("Reshape", ["a", "s"], ["r"]),
                 n("Transpose", ["r"], ["t"], perm=[0, 3, 4, 2, 1]), n("Relu", ["t"], ["y"])]
        shape, out = [b, c, f, h, wd], [b, h, wd, f, c]
    elif chain == "head_split":
        nodes = [n("Reshape", ["x", "s"], ["r"]), n("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3]),
                 n("Relu", ["t"], ["y"])]
        shape, out = [b, f * h * wd, 2, c // 2], [b, 2, f * h * wd, c // 2]
    else:
        nodes = [n("Reshape", ["x", "s"], ["r"]), n("Transpose", ["r"], ["t"], perm=[0, 1, 3, 2]),
                 n("Relu", ["t"], ["y"])]
        shape, out = [b, f * h, wd, c], [b, f * h, c, wd]
    m = model(nodes, {"x": [b, f * h, wd, c]}, {"y": out}, {"s": np.array(shape)})
    irm = to_ir(m)
    lay_out_nhwc(irm)
    swaps = [node for node in irm.graph if node.op_type == "Transpose"
             and tuple(node.attributes["perm"].value) == (0, 2, 1, 3)]
    if chain == "frame_swap":
        assert len(swaps) == 1 and ops(irm)["Transpose"] == 1 and list(swaps[0].inputs[0].shape) == [b, f, h * wd, c]
    else:
        assert ops(irm)["Transpose"] == 1 and [list(node.attributes["perm"].value) for node in irm.graph
                                               if node.op_type == "Transpose"] == [[0, 2, 1, 3] if chain ==
                                                                                   "head_split" else [0, 1, 3, 2]]
        assert not swaps or list(swaps[0].inputs[0].shape) == shape
    assert_same(m, irm)
