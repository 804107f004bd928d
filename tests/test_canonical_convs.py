"""Convolutions over a view (``sdnpu.passes.canonical.convs``) on tiny graphs: a Conv3d or Conv1d becomes a 2-D
Conv over a view of its input (frames folded into the batch, a temporal conv over the [B, C, F, H*W] view, frames
stacked in channels), onnx's full check passes and onnxruntime computes the same numbers within a few units of
float32's rounding (the 2-D conv adds the same products in another order, and zeros); its near misses stay as
they were. The weight steps replay what the rewrite computed."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from sdnpu.formats.weights import STEPS
from sdnpu.passes.canonical import convs
from sdnpu.passes.canonical.driver import sweep

from .graphs import model, ops, rewritten

R = np.random.default_rng(0)
COUNT = "Conv3d / Conv1d -> Conv over a view"


def w(*shape: int) -> np.ndarray:
    return (R.standard_normal(shape) * 0.2).astype(np.float32)


def conv(x: list[int], weight: list[int], y: list[int], **attrs) -> onnx.ModelProto:
    return model([helper.make_node("Conv", ["x", "w", "b"], ["y"], **attrs)], {"x": x}, {"y": y},
                 {"w": w(*weight), "b": w(weight[0])})


def conv2d_attrs(irm) -> dict:
    node = next(n for n in irm.graph if n.op_type == "Conv")
    assert len(node.inputs[1].shape) == 4
    return {k: list(a.value) if isinstance(a.value, (list, tuple)) else a.value for k, a in node.attributes.items()}


@pytest.mark.parametrize(("x", "weight", "y", "attrs", "kernel", "movement"), [
    # frames folded into the batch: (1, 3, 3) over three frames
    ([1, 4, 3, 5, 5], [6, 4, 1, 3, 3], [1, 6, 3, 5, 5], {"pads": [0, 1, 1, 0, 1, 1]}, [3, 3], {"Transpose", "Reshape"}),
    # a causal 3x3x3 over one frame (Wan, Qwen-Image): only the last tap meets data
    ([1, 4, 1, 5, 5], [6, 4, 3, 3, 3], [1, 6, 1, 5, 5], {"pads": [2, 1, 1, 0, 1, 1]}, [3, 3], {"Reshape"}),
    # SVD's temporal conv (3, 1, 1) over two frames: a (3, 1) conv over [B, C, F, H*W], no data movement
    ([1, 4, 2, 3, 3], [6, 4, 3, 1, 1], [1, 6, 2, 3, 3], {"pads": [1, 0, 0, 1, 0, 0]}, [3, 1], {"Reshape"}),
    # a causal 3x3x3 over two frames: frames stacked in channels (1.33x the multiply-accumulates)
    ([1, 4, 2, 5, 5], [6, 4, 3, 3, 3], [1, 6, 2, 5, 5], {"pads": [2, 1, 1, 0, 1, 1]}, [3, 3], {"Transpose", "Reshape"}),
])
def test_a_conv3d_is_a_2d_conv_over_a_view(x, weight, y, attrs, kernel, movement):
    irm, counts = rewritten(conv(x, weight, y, **attrs), convs.view_convs_as_2d, sweep, ulps=16)
    assert counts[COUNT] == 1
    assert set(ops(irm)) == {"Conv", *movement}, ops(irm)
    assert conv2d_attrs(irm)["kernel_shape"] == kernel


@pytest.mark.parametrize("k", [1, 3])
def test_a_conv1d_is_a_2d_conv_over_a_view(k):
    m = conv([2, 4, 7], [6, 4, k], [2, 6, 7], pads=[k // 2, k // 2])
    irm, counts = rewritten(m, convs.view_convs_as_2d, sweep, ulps=16)
    assert counts[COUNT] == 1 and dict(ops(irm)) == {"Reshape": 2, "Conv": 1}
    assert conv2d_attrs(irm)["kernel_shape"] == [k, 1]


@pytest.mark.parametrize(("x", "weight", "y", "attrs", "reason"), [
    # eight frames, 3x3x3: stacked in channels it would take 64 / 22 = 2.9x the multiply-accumulates
    ([1, 2, 8, 3, 3], [2, 2, 3, 3, 3], [1, 2, 8, 3, 3], {"pads": [1, 1, 1, 1, 1, 1]}, "2.9x"),
    # groups cut the stacked channels by frame
    ([1, 4, 2, 3, 3], [4, 2, 3, 3, 3], [1, 4, 2, 3, 3], {"pads": [2, 1, 1, 0, 1, 1], "group": 2}, "with groups"),
])
def test_a_conv3d_that_no_2d_conv_writes_stays_and_says_why(x, weight, y, attrs, reason):
    m = conv(x, weight, y, **attrs)
    irm, counts = rewritten(m, convs.view_convs_as_2d)
    assert counts[COUNT] == 0 and dict(ops(irm)) == {"Conv": 1}
    assert reason in convs.stacking_reason(next(iter(irm.graph)))


def test_frames_in_channels_places_each_tap_where_its_frame_meets_the_output():
    """Block (t, f) of the stacked weight is tap k with f = t * stride - pad + k * dilation, zeros elsewhere."""
    a = w(2, 3, 3, 1, 1)
    got = STEPS["frames_in_channels"](a, frames=2, out_frames=2, stride=1, pad=2, dilation=1).reshape(2, 2, 2, 3)
    np.testing.assert_array_equal(got[0, :, 0], a[:, :, 2, 0, 0])  # t0 reads f0 through the last tap
    np.testing.assert_array_equal(got[0, :, 1], 0)  # t0 never reads f1 (causal)
    np.testing.assert_array_equal(got[1, :, 0], a[:, :, 1, 0, 0])
    np.testing.assert_array_equal(got[1, :, 1], a[:, :, 2, 0, 0])
    taps = convs.frame_taps(2, 3, 1, 2, 0, 1)
    assert taps.out_frames == 2 and taps.used == 3 and taps.folded_tap is None
    assert convs.frame_taps(1, 3, 1, 2, 0, 1).folded_tap == 2


@pytest.mark.parametrize(("frames", "movement"), [(1, {"Reshape"}), (2, {"Transpose", "Reshape"})])
def test_a_replicated_first_frame_in_front_is_the_weight_s(frames, movement):
    """CogVideoX's causal padding, ``torch.cat([x[:, :, :1]] * 2 + [x], dim=2)`` before a 3x3x3 conv: the conv
    reads x, each tap that meets a copy of frame 0 added to frame 0's block (over one frame: one 2-D conv with
    the sum of the taps)."""
    shape = [1, 4, frames, 5, 5]
    nodes = [helper.make_node("Slice", ["x", "zero", "one", "two"], ["first"]),
             helper.make_node("Concat", ["first", "first", "x"], ["padded"], axis=2),
             helper.make_node("Conv", ["padded", "w", "b"], ["y"], pads=[0, 1, 1, 0, 1, 1])]
    m = model(nodes, {"x": shape}, {"y": [1, 6, frames, 5, 5]},
              {"w": w(6, 4, 3, 3, 3), "b": w(6), "zero": np.array([0]), "one": np.array([1]), "two": np.array([2])})
    irm, counts = rewritten(m, convs.view_convs_as_2d, sweep, ulps=16)
    assert counts[COUNT] == 1
    assert set(ops(irm)) == {"Conv", *movement}, ops(irm)
