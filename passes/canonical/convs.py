"""Convolutions over a view: a Conv3d or Conv1d is a 2-D Conv over a view of its input, which the conv rule then
takes as any other (the target's conv is 2-D).

    Conv1d   x [B, C, L], w [OC, IC, K]
             ==> Reshape [B, C, L, 1] -> Conv(w [OC, IC, K, 1]) -> Reshape [B, OC, L']
    Conv3d   x [B, C, F, H, W], w [OC, IC, KT, KH, KW], over frames ``f = t * st - pt + k * dt``
             frames folded into the batch, where every output frame t reads input frame t alone through one
             tap k0 (kernel (1, KH, KW); a causal conv over one frame, whose front padding leaves only the last
             tap on data):
             ==> Transpose [B, F, C, H, W] -> Reshape [B*F, C, H, W] -> Conv(w[:, :, k0]) -> Reshape
                 [B, F, OC, H', W'] -> Transpose [B, OC, F, H', W']
             frames stacked in channels otherwise (kernel (KT, 1, 1) over frames, a causal conv over F frames):
             ==> Transpose [B, F, C, H, W] -> Reshape [B, F*C, H, W] -> Conv(M [F'*OC, F*C, KH, KW]) -> Reshape
                 [B, F', OC, H', W'] -> Transpose [B, OC, F', H', W']
             with M's block (t, f) the tap from input frame f to output frame t, zeros where there is none
             (``sdnpu.formats.weights``' step ``frames_in_channels``).

Both are exact: the 2-D conv multiplies the same products and adds zeros for the taps that meet the temporal
padding. Frames in channels costs F' * F blocks of multiply-accumulates where the Conv3d has one per tap that
meets data; it is written only where that is at most ``STACK_OVERHEAD`` times the Conv3d's own (up to 2 * KT
frames; one frame is always 1x) and without groups (a group would cut the stacked channels by frame).
Otherwise the Conv3d stays, and the conv rule says why (``stacking_reason``). The transposes are views where
F is 1; between frames they are data movement the layout pass moves to where it cancels.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.passes.canonical.driver import RULE, graph_of, node_rewrite
from sdnpu.passes.irutil import Builder, attr, const, replace, static_shape
from sdnpu.passes.provenance import step

STACK_OVERHEAD = 2.0  # frames in channels: at most this many times the Conv3d's own multiply-accumulates


@dataclass(frozen=True)
class FrameTaps:
    """Which input frame and tap each output frame of a Conv3d reads: ``taps[t]`` the (f, k) pairs."""

    frames: int
    out_frames: int
    taps: tuple[tuple[tuple[int, int], ...], ...]
    replicate: int = 0  # copies of the first frame in front of the input (CogVideoX's causal padding)

    @property
    def used(self) -> int:
        return sum(len(t) for t in self.taps)

    @property
    def folded_tap(self) -> int | None:
        """Where each output frame t reads input frame t alone (frames into the batch): the tap k0 it reads it
        through (over one frame, whose taps may be several where it is replicated: the first of them)."""
        if self.out_frames != self.frames or any(f != i for i, t in enumerate(self.taps) for f, _ in t):
            return None
        if self.frames == 1 and self.taps[0]:
            return self.taps[0][0][1]
        ks = {t[0][1] for t in self.taps if len(t) == 1}
        if len(ks) != 1 or any(len(t) != 1 for t in self.taps):
            return None
        return ks.pop()

    @property
    def overhead(self) -> float:
        """Frames in channels' multiply-accumulates over the Conv3d's own (its taps that meet data)."""
        return self.out_frames * self.frames / max(self.used, 1)


def frame_taps(frames: int, kt: int, stride: int, pad: int, pad_end: int, dilation: int,
               replicate: int = 0) -> FrameTaps:
    """The taps over ``frames`` frames with ``pad`` zero frames in front (``pad_end`` behind) and, inside them,
    ``replicate`` copies of the first frame (each a tap on frame 0)."""
    out_frames = (frames + replicate + pad + pad_end - dilation * (kt - 1) - 1) // stride + 1
    taps = []
    for t in range(max(out_frames, 0)):
        row = []
        for k in range(kt):
            f = t * stride - pad + k * dilation - replicate
            if -replicate <= f < frames:
                row.append((max(f, 0), k))
        taps.append(tuple(row))
    return FrameTaps(frames, out_frames, tuple(taps), replicate)


def replicated_front(x: ir.Value | None) -> tuple[ir.Value, int] | None:
    """``Concat([x[:, :, :1]] * r + [x], axis=2)`` (CogVideoX's causal padding: the first frame repeated in
    front, ``torch.cat([x[:, :, :1]] * (k - 1) + [x], dim=2)``): x and r; None for anything else."""
    cat = x.producer() if x is not None else None
    if cat is None or cat.op_type != "Concat" or cat.domain not in ("", "ai.onnx") or len(cat.inputs) < 2:
        return None
    src = cat.inputs[-1]
    shape = static_shape(src)
    if src is None or shape is None or len(shape) != 5 or int(attr(cat, "axis", 0)) % 5 != 2:
        return None
    for v in cat.inputs[:-1]:
        sl = v.producer() if v is not None else None
        if sl is None or sl.op_type != "Slice" or sl.inputs[0] is not src or static_shape(v) != (*shape[:2], 1,
                                                                                                  *shape[3:]):
            return None
        starts, axes = const(sl.inputs[1]), const(sl.inputs[3]) if len(sl.inputs) > 3 else None
        if starts is None or int(starts.reshape(-1)[0]) != 0 or \
                (axes is not None and int(axes.reshape(-1)[0]) % 5 != 2):
            return None
    return src, len(cat.inputs) - 1


def conv3d_taps(node: ir.Node) -> FrameTaps | None:
    """The frame taps of a Conv with a 5-D weight and static shapes (None otherwise), over the frames before
    a replicated front (``replicated_front``) where the Conv pads no frames in front itself."""
    w_shape, x_shape = static_shape(node.inputs[1]), static_shape(node.inputs[0])
    if w_shape is None or x_shape is None or len(w_shape) != 5 or len(x_shape) != 5:
        return None
    pads = [int(p) for p in attr(node, "pads", [0] * 6)]
    stride = int(attr(node, "strides", [1, 1, 1])[0])
    dilation = int(attr(node, "dilations", [1, 1, 1])[0])
    front = replicated_front(node.inputs[0]) if pads[0] == 0 else None
    if front is not None:
        return frame_taps(x_shape[2] - front[1], w_shape[2], stride, 0, pads[3], dilation, front[1])
    return frame_taps(x_shape[2], w_shape[2], stride, pads[0], pads[3], dilation)


def stacking_reason(node: ir.Node) -> str | None:
    """Why a Conv3d was not written as a 2-D conv (the conv rule's reason), or None where it would be."""
    taps = conv3d_taps(node)
    if taps is None:
        return None
    if taps.folded_tap is not None:
        return None
    if int(attr(node, "group", 1)) != 1:
        return (f"a 3-D convolution with groups over {taps.frames} frames: the target's conv is 2-D, and with "
                "groups the frames cannot be stacked in its channels")
    if taps.overhead > STACK_OVERHEAD:
        return (f"a 3-D convolution over {taps.frames} frames: the target's conv is 2-D, and as one 2-D conv of "
                f"frames stacked in channels it would take {taps.overhead:.1f}x its multiply-accumulates (at most "
                f"{STACK_OVERHEAD:g}x is written)")
    return None


def _shape(b: Builder, x: ir.Value, shape: list[int]) -> ir.Value:
    return b.op("Reshape", [x, b.const(np.asarray(shape, np.int64), "shape")], dtype=x.dtype,
                shape=shape).outputs[0]


def _frames_first(b: Builder, x: ir.Value, shape: tuple[int, ...]) -> ir.Value:
    """[B, C, F, H, W] -> [B, F, C, H, W] (no node where F is 1: the Reshape after it is the same view)."""
    if shape[2] == 1:
        return x
    return b.op("Transpose", [x], {"perm": [0, 2, 1, 3, 4]}, dtype=x.dtype,
                shape=[shape[0], shape[2], shape[1], shape[3], shape[4]]).outputs[0]


@node_rewrite("Conv3d / Conv1d -> Conv over a view", "Conv")
def view_convs_as_2d(node: ir.Node) -> bool:
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    x_shape, w_shape, y_shape = static_shape(x), static_shape(w), static_shape(node.outputs[0])
    if x is None or w is None or x_shape is None or w_shape is None or y_shape is None or const(w) is None \
            or len(w_shape) not in (3, 5) or attr(node, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET"):
        return False
    if bias is not None and const(bias) is None:
        return False
    graph = graph_of(node)
    b = Builder(graph, RULE)
    group = int(attr(node, "group", 1))
    if len(w_shape) == 3:
        y = _conv1d(b, node, x, w, bias, x_shape, w_shape, y_shape, group)
    else:
        y = _conv3d(b, node, x, w, bias, x_shape, w_shape, y_shape, group)
        if y is None:
            return False
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [y])
    return True


def _conv1d(b: Builder, node: ir.Node, x: ir.Value, w: ir.Value, bias: ir.Value | None, x_shape: tuple[int, ...],
            w_shape: tuple[int, ...], y_shape: tuple[int, ...], group: int) -> ir.Value:
    pads = [int(p) for p in attr(node, "pads", [0, 0])]
    stride = int(attr(node, "strides", [1])[0])
    dilation = int(attr(node, "dilations", [1])[0])
    w2 = b.derived(w, [step("reshape", shape=[*w_shape, 1])], [*w_shape, 1], f"{w.name}_2d")
    x2 = _shape(b, x, [*x_shape, 1])
    conv = b.op("Conv", [x2, w2, *([bias] if bias is not None else [])],
                {"kernel_shape": [w_shape[2], 1], "pads": [pads[0], 0, pads[1], 0], "strides": [stride, 1],
                 "dilations": [dilation, 1], "group": group}, dtype=x.dtype, shape=[*y_shape, 1])
    return _shape(b, conv.outputs[0], list(y_shape))


def _conv3d(b: Builder, node: ir.Node, x: ir.Value, w: ir.Value, bias: ir.Value | None, x_shape: tuple[int, ...],
            w_shape: tuple[int, ...], y_shape: tuple[int, ...], group: int) -> ir.Value | None:
    taps = conv3d_taps(node)
    assert taps is not None
    pads = [int(p) for p in attr(node, "pads", [0] * 6)]
    strides = [int(s) for s in attr(node, "strides", [1, 1, 1])]
    dilations = [int(d) for d in attr(node, "dilations", [1, 1, 1])]
    if taps.replicate:  # the conv reads the frames before their replicated front, the weight taps it
        x = replicated_front(x)[0]  # type: ignore[index]
        x_shape = static_shape(x)  # type: ignore[assignment]
    n, c, frames, h, wd = x_shape
    oc, ic, kt, kh, kw = w_shape
    fo, ho, wo = y_shape[2:]
    k0 = taps.folded_tap
    if k0 is None and kh == kw == 1 and not any(pads[i] for i in (1, 2, 4, 5)) and strides[1:] == [1, 1] \
            and taps.out_frames > 0 and not taps.replicate:  # temporal: a (KT, 1) conv over [B, C, F, H*W]
        w2 = b.derived(w, [step("reshape", shape=[oc, ic, kt, 1])], [oc, ic, kt, 1], f"{w.name}_2d")
        conv = b.op("Conv", [_shape(b, x, [n, c, frames, h * wd]), w2, *([bias] if bias is not None else [])],
                    {"kernel_shape": [kt, 1], "pads": [pads[0], 0, pads[3], 0], "strides": [strides[0], 1],
                     "dilations": [dilations[0], 1], "group": group}, dtype=x.dtype, shape=[n, oc, fo, h * wd])
        return _shape(b, conv.outputs[0], list(y_shape))
    if k0 is not None:  # frames into the batch: tap k0's weight
        rows, cin, cout = n * frames, ic, oc
        spec = {"frames": 1, "out_frames": 1, "stride": 1, "pad": k0 * dilations[0], "dilation": dilations[0]}
        if frames == 1:  # every tap that meets the one frame (several where it is replicated)
            spec.update(pad=pads[0], replicate=taps.replicate)
    elif stacking_reason(node) is None and fo > 0:  # frames in channels
        rows, cin, cout = n, frames * ic, fo * oc
        spec = {"frames": frames, "out_frames": fo, "stride": strides[0], "pad": pads[0], "dilation": dilations[0],
                "replicate": taps.replicate}
    else:
        return None
    w2 = b.derived(w, [step("frames_in_channels", **spec)], [cout, cin, kh, kw], f"{w.name}_2d")
    inputs = [_shape(b, _frames_first(b, x, x_shape), [rows, c * (1 if k0 is not None else frames), h, wd]), w2]
    if bias is not None and k0 is not None:
        inputs.append(bias)
    elif bias is not None:
        reps = fo
        inputs.append(b.derived(bias, [step("reshape", shape=[1, oc]), step("broadcast", shape=[reps, oc]),
                                       step("reshape", shape=[reps * oc])], [reps * oc], f"{bias.name}_2d"))
    conv = b.op("Conv", inputs, {"kernel_shape": [kh, kw], "pads": [pads[1], pads[2], pads[4], pads[5]],
                                 "strides": strides[1:], "dilations": dilations[1:], "group": group},
                dtype=x.dtype, shape=[rows, cout, ho, wo])
    if fo == 1:
        return _shape(b, conv.outputs[0], list(y_shape))
    framed = _shape(b, conv.outputs[0], [n, fo, oc, ho, wo])
    return b.op("Transpose", [framed], {"perm": [0, 2, 1, 3, 4]}, dtype=x.dtype, shape=list(y_shape)).outputs[0]
