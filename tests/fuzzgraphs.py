"""Hypothesis strategies for random ONNX graphs built from the op families the fusion rules know, spelled as
the exporters write them, and for near misses that must *not* fuse.

``case(family)`` draws a ``(onnx.ModelProto, description)``: a start tensor, one step of ``family``, then up
to two more steps of any family that fits the tensor's rank (so Conv -> GroupNorm+SiLU -> Conv, attention
after a LayerNorm, a movement chain between two convolutions, ... come up); now and then an intermediate
(or the input) is also a graph output, or the output goes through an Identity. Structure (kernel, stride,
heads, spelling, ...) is drawn by hypothesis, so it shrinks; weight values come from a numpy generator
seeded by a drawn integer. Small constants are sometimes Constant nodes (TorchScript) rather than
initializers. Every model is opset 20, has static shapes everywhere, activations of a few hundred to a few
thousand elements (MAX_ELEMS caps the steps that grow them), and passes
``onnx.checker.check_model(full_check=True)``. A quarter of the graphs are fp16
(inputs, weights and outputs, as an fp16 export has them).

Families (``FAMILIES``):
  conv         Conv with random kernel/stride/pads (asymmetric too)/dilation/groups (depthwise too), bias or
               not, + SiLU, after TorchScript's zero Pad; ConvTranspose (kernel == stride 1-3, or overlapping,
               grouped, output-padded), bias or not
  gemm         MatMul + bias ([N], [1, N], [1, 1, N]), Gemm (transB, bias or not), tied weights, activation
               x activation MatMul
  attention    self/cross attention, 1-4 heads, dynamo / TorchScript / plain spellings of the head split and
               the scale, causal mask, k and v sharing one projection
  norm         GroupNorm as exported (Reshape, InstanceNormalization, Reshape, Mul, Add [+ SiLU]),
               LayerNormalization, LayerNorm decomposed, InstanceNormalization (InstanceNorm1d/2d, affine or
               not, after TorchScript's flattening Reshape, + SiLU), L2 norms (F.normalize: ReduceL2 or the root
               of a sum or mean of squares, eps by Clip, Max or Add, Expand or not, Div or * Reciprocal, Qwen-
               Image's * sqrt(D) * gamma) over the last axis or the channels, an RMS norm over the channels
  activation   SiLU, Gelu (none / tanh), Erf GELU (three spellings), tanh GELU decomposed, QuickGelu, GEGLU
               (Split or Slices), Sigmoid, Softmax; constants 0-d, [1] or rank-raising [1, 1, ..]
  resize       nearest Resize, integer factors, scales or sizes, every coordinate mode and rounding
  elementwise  Add/Sub/Mul/Div with broadcast constants or branches, Concat (2-3 inputs), Slice (negative
               starts and steps), Split, Expand
  embedding    the sinusoidal timestep embedding (the fp32 island), CLIP's Gather and end-of-text pooling
  movement     Reshape/Transpose (perm or none)/Squeeze/Unsqueeze/Flatten/Identity chains, NCHW<->NHWC
               round trips, [B, C, H, W] <-> [B, HW, C]
  block        resnet (with a time embedding), VAE attention, transformer, up/downsample, UNet skip concat
  mmdit        SD3's MMDiT: RMSNorm (both spellings, scaled or not), joint attention (image and text streams,
               per-head norms or not, cut back into both streams or the image only), AdaLayerNorm's projection
               chunked by a Split (equal or uneven parts)
  near_miss    ``NEAR_MISSES``: a shared intermediate (SiLU's sigmoid, a pre-activation, softmax or q heads
               as outputs, a GroupNorm intermediate, LayerNorm's statistics), a non-constant weight (Conv
               weight or bias, MatMul weight, GroupNorm/LayerNorm gamma as graph inputs), an unsupported
               attribute (Conv auto_pad, kernel/stride above the NPU's, Gemm transA/alpha/beta, Resize
               linear/cubic/fractional/down/channels, LayerNorm over two axes, softmax over another axis),
               an almost-right pattern (a non-causal mask, interleaved heads, a wrong head merge, a scale on
               v or per head, 1.7 for 1.702, erf(x / 1.5), GEGLU's halves swapped or uneven, a reflect /
               non-zero / cropping Pad before a Conv, a neutral constant that raises the rank, an RMSNorm over
               another axis or scaled per row, a joint attention cut where the streams do not meet or whose
               softmax is over the queries, a projection chunked along the batch, an L2 norm over a middle axis
               or two axes, with eps 0.1 / 0.5 outside the root, of another tensor than the one reduced).
  generality   rotary embeddings (rotate-half and interleaved pairs; the halves' products joined, stacked or
               scattered; near misses), AdaLN modulation (chunks,
               tables, scale-shift), streams cut back along the sequence, Einsum, a modulation table read a
               few rows at a time (Slice, flatten + chunk, one Split; overlapping rows, step 2, a row output),
               tanh / sigmoid gates of one conditioning vector (a shared projection, another op, another
               input), token padding (constant-mask Where, one-part Split, zero Pad, select_scatter, a row's
               Gather; a Pad that pads, a scatter that writes half), size conditions (several inputs'
               sinusoid columns concatenated; other frequencies, an intermediate read elsewhere)
  mutation     ``MUTATIONS``: each rule's and glue lowering's pattern with what is around it changed, on its
               own input (ranks 1-5; odd, prime and size-1 dimensions), usually written by a dispatch op:
               GroupNorm with the batch folded into the groups ([1, B*G, -1]) or the groups on two axes
               ([B, G, C/G, -1]), rank 3-5; Conv 1-D/2-D/3-D, dilations, groups, strides 1-3, asymmetric
               pads, auto_pad; attention with prime heads and widths, batch 3, 256 queries (flash SDMHA),
               Softmax on the last axis written positive or on another axis; LayerNorm on ranks 1-5, any
               axis, gamma [1, K], statistics read; GEGLU over an odd width (TorchScript's chunk Slices, a
               dropped column), Split sizes or num_outputs; Gemm alpha/beta/transA/transB and every bias
               shape, MatMul on ranks 1-5 or with the weight first; Resize given scales (near 2 too) or sizes,
               with or without axes; InstanceNormalization on ranks 3-5 (batches 1-3, affine or not,
               flattened, + SiLU); L2 and RMS norms on ranks 2-5 over any axis or two, every root and eps
               spelling, eps 1e-30 to 0.5, a scalar (sqrt(D) or not), channel, row or no weight after; SiLU /
               quick_gelu / Gelu, Add/Sub/Mul/Div in every broadcast, Concat on any axis of ranks 1-5; CLIP's
               end-of-text pooling (legacy, and ArgMax(Cast(Equal(ids, eos), int)) with GatherND or Gather); a
               standalone Softmax over logits around 1e4. Intermediates of the pattern are now and then graph
               outputs or read by another node.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto as T
from onnx import helper

OPSET = 20
MAX_ELEMS = 4096  # per tensor: keeps each case at a few milliseconds of onnxruntime
F32, F16 = T.FLOAT, T.FLOAT16
NP_DTYPE = {F32: np.float32, F16: np.float16}


class G:
    """A graph under construction: tracks every value's static shape so steps can choose parameters."""

    def __init__(self, draw: Callable[[st.SearchStrategy[Any]], Any], seed: int, dtype: int) -> None:
        self.draw = draw
        self.rng = np.random.default_rng(seed)
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.shape: dict[str, tuple[int, ...]] = {}
        self.types: dict[str, int] = {}
        self.activations: list[str] = []  # float values computed by nodes (candidates for extra outputs)
        self.desc: list[str] = []
        self._n = 0

    # -- drawing --------------------------------------------------------------------------------------
    def pick(self, options: list[Any] | tuple[Any, ...]) -> Any:
        return self.draw(st.sampled_from(list(options)))

    def num(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def flag(self) -> bool:
        return self.draw(st.booleans())

    # -- values ---------------------------------------------------------------------------------------
    @property
    def np_dtype(self) -> type:
        return NP_DTYPE[self.dtype]

    def fresh(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}_{self._n}"

    def input(self, shape: tuple[int, ...] | list[int], prefix: str = "x") -> str:
        name = self.fresh(prefix)
        self.inputs.append(name)
        self.shape[name], self.types[name] = tuple(shape), self.dtype
        return name

    def tensor(self, array: np.ndarray, prefix: str) -> str:
        """An initializer, or for a small array now and then a Constant node (TorchScript's scalars)."""
        name = self.fresh(prefix)
        array = np.asarray(array)
        if array.size <= 16 and self.num(0, 4) == 0:
            self.nodes.append(helper.make_node("Constant", [], [name],
                                               value=onnx.numpy_helper.from_array(array, name)))
        else:
            self.inits.append(onnx.numpy_helper.from_array(array, name))
        self.shape[name] = tuple(np.shape(array))
        return name

    def weight(self, shape: tuple[int, ...] | list[int], scale: float | None = None, prefix: str = "w",
               offset: float = 0.0) -> str:
        """Random weights in the graph's float type; default scale 1/sqrt(fan-in) keeps activations O(1)."""
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        s = scale if scale is not None else 1.0 / math.sqrt(max(fan_in, 1))
        return self.tensor((self.rng.standard_normal(tuple(shape)) * s + offset).astype(self.np_dtype), prefix)

    def fconst(self, value: float | np.ndarray, prefix: str = "c") -> str:
        return self.tensor(np.asarray(value, self.np_dtype), prefix)

    def ints(self, values: list[int], prefix: str = "shape") -> str:
        return self.tensor(np.asarray(values, np.int64), prefix)

    def scalar(self, value: float, prefix: str = "c", raise_rank: int = 0) -> str:
        """A one-value constant: 0-d (dynamo), [1] (TorchScript), or with ``raise_rank`` of rank up to that,
        [1, 1, ...], which broadcasts what it meets to a higher rank (valid ONNX, and a trap for rules that
        only look at the value)."""
        shapes: list[tuple[int, ...]] = [(), (), (1,)]
        if raise_rank and self.num(0, 5) == 0:
            shapes = [(1,) * k for k in range(2, raise_rank + 1)] or shapes
        return self.fconst(np.full(self.pick(shapes), value), prefix)

    def bin(self, op_type: str, a: str, b: str) -> str:
        """A broadcasting binary op; the output shape follows numpy's (= ONNX's) broadcasting."""
        return self.op(op_type, [a, b], np.broadcast_shapes(self.shape[a], self.shape[b]))

    def op(self, op_type: str, inputs: list[str], shape: tuple[int, ...] | list[int], **attrs: Any) -> str:
        return self.op_n(op_type, inputs, [shape], **attrs)[0]

    def op_n(self, op_type: str, inputs: list[str], shapes: list[tuple[int, ...] | list[int]],
             **attrs: Any) -> list[str]:
        outs = [self.fresh(op_type.lower()) for _ in shapes]
        self.nodes.append(helper.make_node(op_type, inputs, outs, **attrs))
        for o, s in zip(outs, shapes, strict=True):
            self.shape[o], self.types[o] = tuple(int(d) for d in s), self.dtype
            self.activations.append(o)
        return outs

    def output(self, name: str) -> None:
        if name not in self.outputs:
            self.outputs.append(name)

    def model(self) -> onnx.ModelProto:
        vi = helper.make_tensor_value_info
        g = helper.make_graph(self.nodes, "fuzz", [vi(n, self.types[n], self.shape[n]) for n in self.inputs],
                              [vi(n, self.types[n], self.shape[n]) for n in self.outputs], self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="sdnpu-fuzz",
                              doc_string=" -> ".join(self.desc))
        m = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
        onnx.checker.check_model(m, full_check=True)
        return m


def _size(shape: tuple[int, ...] | list[int]) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _silu(g: G, y: str) -> str:
    s = g.op("Sigmoid", [y], g.shape[y])
    return g.op("Mul", [y, s] if g.flag() else [s, y], g.shape[y])


def _project(g: G, x: str, n: int, bias: bool | None = None, keep_rank: bool = False) -> str:
    """A linear layer on the last axis (MatMul + Add, as both exporters write nn.Linear). The bias is [n],
    or now and then [1, n] or [1, 1, n] (which makes a 2-D product 3-D, unless ``keep_rank``)."""
    shape = g.shape[x]
    y = g.op("MatMul", [x, g.weight((shape[-1], n))], (*shape[:-1], n))
    if bias if bias is not None else g.flag():
        b = g.weight(g.pick([(n,), (n,), (1, n)] + ([] if keep_rank else [(1, 1, n)])), 0.1, "b")
        y = g.bin("Add", y, b) if g.flag() else g.bin("Add", b, y)
    return y


# ---- conv ----------------------------------------------------------------------------------------------

@dataclass
class ConvSpec:
    oc: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    pads: list[int]
    dilations: tuple[int, int]
    group: int
    out: tuple[int, int, int, int]


def _conv_spec(g: G, shape: tuple[int, ...], max_kernel: int = 7, max_stride: int = 3) -> ConvSpec:
    b, c, h, w = shape
    group = g.pick(_divisors(c)) if g.num(0, 2) == 0 else 1
    per_group = g.num(1, max(1, 16 // group))
    oc = group * per_group
    if g.num(0, 5) == 0:  # depthwise, as ConvNeXt/SD-variants write it
        group, oc = c, c
    kernel = (g.pick([1, 1, 3, 3, 2, 5, max_kernel]), g.pick([1, 1, 3, 3, 2, 5, max_kernel]))
    kernel = (kernel[0], kernel[0]) if g.num(0, 3) else kernel
    dil = (g.num(1, 2), g.num(1, 2)) if g.num(0, 4) == 0 else (1, 1)
    strides = (g.num(1, max_stride), g.num(1, max_stride))
    strides = (strides[0], strides[0]) if g.num(0, 3) else strides
    sym = g.num(0, 3)
    pads = [g.num(0, 3) for _ in range(4)]
    if sym:
        pads = [pads[0], pads[1], pads[0], pads[1]]
    out = []
    for i, size in enumerate((h, w)):
        span = dil[i] * (kernel[i] - 1) + 1
        if size + pads[i] + pads[i + 2] < span:
            pads[i + 2] += span - size - pads[i] - pads[i + 2]
        out.append((size + pads[i] + pads[i + 2] - span) // strides[i] + 1)
    while b * oc * out[0] * out[1] > MAX_ELEMS and oc > group:
        oc -= group
    return ConvSpec(oc, kernel, strides, pads, dil, group, (b, oc, out[0], out[1]))


def _conv(g: G, x: str, spec: ConvSpec, weight: str | None = None, bias: str | bool | None = None,
          **extra: Any) -> str:
    c = g.shape[x][1]
    w = weight or g.weight((spec.oc, c // spec.group, *spec.kernel))
    if bias is None:
        bias = g.flag()
    ins = [x, w] + ([bias] if isinstance(bias, str) else [g.weight((spec.oc,), 0.1, "b")] if bias else [])
    attrs: dict[str, Any] = {"strides": list(spec.strides), "dilations": list(spec.dilations), "group": spec.group}
    if "auto_pad" not in extra:
        attrs["pads"] = spec.pads
    if g.flag():
        attrs["kernel_shape"] = list(spec.kernel)
    attrs.update(extra)
    return g.op("Conv", ins, spec.out, **attrs)


def step_conv(g: G, x: str) -> str:
    shape = g.shape[x]
    if g.num(0, 4) == 0:  # TorchScript's downsampler: a zero Pad on H and W in front of the Conv
        pads = [0, 0, g.num(0, 1), g.num(0, 1), 0, 0, g.num(0, 1), g.num(0, 1)]
        padded = (shape[0], shape[1], shape[2] + pads[2] + pads[6], shape[3] + pads[3] + pads[7])
        x = g.op("Pad", [x, g.ints(pads, "pads"), g.fconst(0.0)], padded, mode="constant")
        shape = padded
        g.desc.append(f"Pad{pads}")
    spec = _conv_spec(g, shape)
    y = _conv(g, x, spec)
    silu = g.flag()
    g.desc.append(f"Conv(oc={spec.oc}, k={spec.kernel}, s={spec.strides}, p={spec.pads}, d={spec.dilations}, "
                  f"g={spec.group}){'+SiLU' if silu else ''}")
    return _silu(g, y) if silu else y


def step_conv_transpose(g: G, x: str) -> str:
    """A ConvTranspose: mostly kernel == stride (1-3, non-overlapping: Kandinsky 3's upsampling, an unpatchify),
    which becomes SDConvs; else an overlapping (k 4, s 2, p 1), grouped or output-padded one, which stays."""
    b, c, h, w = g.shape[x]
    kind = g.pick(["phases", "phases", "phases", "overlapping", "grouped", "output_padding"])
    s = g.num(1, 3) if kind == "phases" else 2
    k, pad, group, extra = s, 0, 1, 0
    if kind == "overlapping":
        k, pad = 4, 1
    elif kind == "grouped":
        group = g.pick([d for d in _divisors(c) if d > 1] or [1])
    elif kind == "output_padding":
        extra = 1
    oc = group * g.num(1, max(1, 8 // group))
    while b * oc * (h * s) * (w * s) > MAX_ELEMS and oc > group:
        oc -= group
    out = (b, oc, (h - 1) * s - 2 * pad + k + extra, (w - 1) * s - 2 * pad + k + extra)
    ins = [x, g.weight((c, oc // group, k, k))] + ([g.weight((oc,), 0.1, "b")] if g.flag() else [])
    attrs: dict[str, Any] = {"strides": [s, s], "pads": [pad] * 4, "group": group}
    if extra:
        attrs["output_padding"] = [extra, extra]
    if g.flag():
        attrs["kernel_shape"] = [k, k]
    g.desc.append(f"ConvTranspose(oc={oc}, k={k}, s={s}, p={pad}, g={group}, out_pad={extra})")
    return g.op("ConvTranspose", ins, out, **attrs)


def step_video_conv(g: G, x: str) -> str:
    """A Conv3d over frames of a [B, C, F, H', W] view (issue 42): kernel (1, k, k) over frames, a temporal
    (kt, 1, 1) conv (SVD), or a causal 3x3x3 whose frame padding is all in front (Wan, Qwen-Image), that padding
    in the Conv's pads (dynamo), a zero Pad in front of it (TorchScript), or the first frame repeated in front
    (CogVideoX; its near miss the last frame); back to [B, OC, F*H'', W']."""
    b, c, h, w = g.shape[x]
    frames = g.pick([f for f in (1, 2, 3) if h % f == 0])
    x5 = g.op("Reshape", [x, g.ints([b, c, frames, h // frames, w])], (b, c, frames, h // frames, w))
    kind = g.pick(["spatial", "temporal", "causal", "causal_pad", "replicated", "replicated_last"])
    oc = g.num(1, 8)
    kernel, pads = {"spatial": ((1, 3, 3), [0, 1, 1, 0, 1, 1]), "temporal": ((3, 1, 1), [1, 0, 0, 1, 0, 0]),
                    "causal": ((3, 3, 3), [2, 1, 1, 0, 1, 1]), "causal_pad": ((3, 3, 3), [0] * 6),
                    "replicated": ((3, 3, 3), [0, 1, 1, 0, 1, 1]),
                    "replicated_last": ((3, 3, 3), [0, 1, 1, 0, 1, 1])}[kind]
    if kind.startswith("replicated"):  # CogVideoX: the first frame repeated in front (a near miss: the last)
        start = 0 if kind == "replicated" else frames - 1
        one = g.op("Slice", [x5, g.ints([start], "starts"), g.ints([start + 1], "ends"), g.ints([2], "axes")],
                   (b, c, 1, h // frames, w))
        x5 = g.op("Concat", [one, one, x5], (b, c, frames + 2, h // frames, w), axis=2)
    if kind == "causal_pad":
        padded = (b, c, frames + 2, h // frames + 2, w + 2)
        x5 = g.op("Pad", [x5, g.ints([0, 0, 2, 1, 1, 0, 0, 0, 1, 1], "pads"), g.fconst(0.0)], padded, mode="constant")
    ins = [x5, g.weight((oc, c, *kernel))] + ([g.weight((oc,), 0.1, "b")] if g.flag() else [])
    y = g.op("Conv", ins, (b, oc, frames, h // frames, w), pads=pads, kernel_shape=list(kernel))
    g.desc.append(f"Conv3d({kind}, frames={frames}, oc={oc})")
    return g.op("Reshape", [y, g.ints([b, oc, h, w])], (b, oc, h, w))


def step_frame_tokens(g: G, x: str) -> str:
    """A video transformer's temporal layers (SVD's temporal transformer blocks, issue 42): tokens [B, F*S, C]
    read per pixel as [B*S, F, C], a body that is token-wise (a linear layer and a residual Add), holds an
    attention over the frames or adds a row per frame (AnimateDiff's position embedding [1, F, C]), or a
    per-frame scale or a linear layer across the frames (neither token-wise: the transposes stay), then back to
    [B, F*S, C]. Spelled as SVD writes it (Reshape, Transpose, Reshape) or as a video UNet's temporal transformer
    does (ModelScope's, AnimateDiff's: the frames as NCHW [B*F, C, H, W], viewed [B, F, C, H, W], permuted to
    [B, C, F, H, W] and then to [B, H, W, F, C]; back the same way through NCHW)."""
    b, s, c = g.shape[x]
    frames = [f for f in _divisors(s) if f >= 2]
    f = g.pick(frames) if frames else 1
    p = s // f
    unet = g.flag()
    h_ = next(d for d in sorted(_divisors(p)) if d * d >= p)  # the pixels as H x W, for the UNet's spelling
    w_ = p // h_
    if unet:  # NCHW frames, then [B, C, F, H, W], then per pixel over the frames
        nchw = g.op("Transpose", [g.op("Reshape", [x, g.ints([b * f, h_, w_, c])], (b * f, h_, w_, c))],
                    (b * f, c, h_, w_), perm=[0, 3, 1, 2])
        v5 = g.op("Reshape", [nchw, g.ints([b, f, c, h_, w_])], (b, f, c, h_, w_))
        cf = g.op("Transpose", [v5], (b, c, f, h_, w_), perm=[0, 2, 1, 3, 4])
        t = g.op("Transpose", [cf], (b, h_, w_, f, c), perm=[0, 3, 4, 2, 1])
    else:
        x4 = g.op("Reshape", [x, g.ints([b, f, p, c])], (b, f, p, c))
        t = g.op("Transpose", [x4], (b, p, f, c), perm=[0, 2, 1, 3])
    t3 = g.op("Reshape", [t, g.ints([b * p, f, c])], (b * p, f, c))
    body = g.pick(["linear", "attention", "per_frame", "across", "frame_rows"])
    if body == "across":  # a linear layer over the frames of a pixel: it mixes the tokens (the transposes stay)
        r = g.op("Reshape", [t3, g.ints([b * p, f * c])], (b * p, f * c))
        h = g.op("Reshape", [_project(g, r, f * c), g.ints([b * p, f, c])], (b * p, f, c))
    elif body == "attention":
        heads = g.pick([h for h in _divisors(c) if h <= 4])
        h = attention(g, t3, heads=heads, d=c // heads, cross=False, spelling=g.pick(["dynamo", "torchscript"]),
                      causal=False)
    elif body == "per_frame":
        scale = g.tensor(g.rng.uniform(0.5, 1.5, (1, f, 1)).astype(g.np_dtype), "per_frame")
        h = g.bin("Mul", _project(g, t3, c), scale)
    elif body == "frame_rows":  # a row per frame over every pixel: [1, F, C]
        h = _project(g, g.bin("Add", t3, g.weight((1, f, c), 0.5, "frame_rows")), c)
    else:
        h = _project(g, t3, c)
    u = g.bin("Add", h, t3)
    if unet:  # back through [B, F, C, H, W] to NCHW frames, a residual Add there, then the tokens
        u5 = g.op("Reshape", [u, g.ints([b, h_, w_, f, c])], (b, h_, w_, f, c))
        back = g.op("Transpose", [u5], (b, f, c, h_, w_), perm=[0, 3, 4, 1, 2])
        frames_nchw = g.bin("Add", g.op("Reshape", [back, g.ints([b * f, c, h_, w_])], (b * f, c, h_, w_)), nchw)
        ut = g.op("Transpose", [frames_nchw], (b * f, h_, w_, c), perm=[0, 2, 3, 1])
    else:
        u4 = g.op("Reshape", [u, g.ints([b, p, f, c])], (b, p, f, c))
        ut = g.op("Transpose", [u4], (b, f, p, c), perm=[0, 2, 1, 3])
    g.desc.append(f"FrameTokens(frames={f}, pixels={p}, body={body}, spelling={'unet' if unet else 'svd'})")
    return g.op("Reshape", [ut, g.ints([b, s, c])], (b, s, c))


def step_conv1d(g: G, x: str) -> str:
    """A Conv1d over [B, C, L] (k 1 or 3): a 2-D conv over the [B, C, L, 1] view."""
    b, c, length = g.shape[x]
    k, oc = g.pick([1, 3]), g.num(1, 8)
    ins = [x, g.weight((oc, c, k))] + ([g.weight((oc,), 0.1, "b")] if g.flag() else [])
    g.desc.append(f"Conv1d(k={k}, oc={oc})")
    return g.op("Conv", ins, (b, oc, length), pads=[k // 2, k // 2])


# ---- gemm ----------------------------------------------------------------------------------------------

def step_linear(g: G, x: str) -> str:
    n = g.num(1, 32)
    while _size((*g.shape[x][:-1], n)) > MAX_ELEMS and n > 1:
        n //= 2
    bias = g.flag()
    g.desc.append(f"Linear(n={n}, bias={bias})")
    return _project(g, x, n, bias)


def step_gemm(g: G, x: str) -> str:
    """Gemm on [B, K] (the time-embedding layers), transB as torch writes it, with or without bias."""
    b, k = g.shape[x]
    n = g.num(1, 32)
    trans = g.flag()
    w = g.weight((n, k) if trans else (k, n), 1 / math.sqrt(k))
    bias = g.pick(["none", "vector", "row"])
    ins = [x, w] + ({"none": [], "vector": [g.weight((n,), 0.1, "b")], "row": [g.weight((1, n), 0.1, "b")]}[bias])
    g.desc.append(f"Gemm(n={n}, transB={int(trans)}, bias={bias})")
    return g.op("Gemm", ins, (b, n), transB=int(trans))


def step_tied_linear(g: G, x: str) -> str:
    """One square weight used by two layers (tied weights): the precision pass converts it once."""
    c = g.shape[x][-1]
    w = g.weight((c, c))
    y = g.op("MatMul", [x, w], g.shape[x])
    y = _silu(g, y)
    g.desc.append("TiedLinear x2")
    return g.op("MatMul", [y, w], g.shape[x])


def step_matmul_act(g: G, x: str) -> str:
    """Activation x activation MatMul (SDMatMul): a Gram matrix x xᵀ, a product with a vector or with a
    broadcast batch, as attention-like and pooling code writes them outside attention."""
    shape = g.shape[x]
    kind = g.pick(["gram", "vector", "broadcast"])
    if kind == "gram" and len(shape) >= 2 and _size((*shape[:-1], shape[-2])) <= MAX_ELEMS:
        perm = list(range(len(shape) - 2)) + [len(shape) - 1, len(shape) - 2]
        xt = g.op("Transpose", [x], [shape[i] for i in perm], perm=perm)
        y = g.op("MatMul", [x, xt], (*shape[:-1], shape[-2]))
    elif kind == "vector":
        v = g.input((shape[-1],), "v")
        y = g.op("MatMul", [x, v], shape[:-1])
    else:
        n = g.num(1, 8)
        w = g.input((1,) * max(0, len(shape) - 2) + (shape[-1], n), "w")
        y = g.op("MatMul", [x, w], (*shape[:-1], n))
    g.desc.append(f"MatMul(activations, {kind})")
    return y


# ---- attention -------------------------------------------------------------------------------------------

def attention(g: G, x: str, *, heads: int, d: int, cross: bool, spelling: str, causal: bool,
              softmax_escapes: bool = False, softmax_axis: int = -1, merge: str = "heads", split: str = "heads",
              mask: str = "none", q_escapes: bool = False, kv_shared: bool = False, v_scale: bool = False,
              head_scale: bool = False) -> str:
    """Attention as the torch exporters write it: projections, head split (Reshape + Transpose), scores with
    their scale (on the scores, as Div by sqrt(d), or on q and kᵀ each, like dynamo's SDPA), Softmax,
    MatMul with v, head merge, out projection."""
    b, s, c = g.shape[x]
    cm = heads * d
    if cross:
        n_ctx, c_ctx = g.num(1, 12), g.num(1, 16)
        ctx = g.input((b, n_ctx, c_ctx), "ctx")
    else:
        n_ctx, ctx = s, x
    q, k = _project(g, x, cm), _project(g, ctx, cm)
    v = k if kv_shared else _project(g, ctx, cm)

    def heads_of(t: str, length: int, kind: str) -> str:
        if split == "interleaved":  # channels as [d, h] instead of [h, d]: not a head split
            r = g.op("Reshape", [t, g.ints([b, length, d, heads])], (b, length, d, heads))
            if kind == "k":
                return g.op("Transpose", [r], (b, heads, d, length), perm=[0, 3, 2, 1])
            return g.op("Transpose", [r], (b, heads, length, d), perm=[0, 3, 1, 2])
        target = g.pick([[b, -1, heads, d], [0, 0, heads, d], [b, length, heads, d]])
        r = g.op("Reshape", [t, g.ints(target)], (b, length, heads, d))
        if kind == "k" and spelling == "torchscript" and g.flag():
            return g.op("Transpose", [r], (b, heads, d, length), perm=[0, 2, 3, 1])
        h = g.op("Transpose", [r], (b, heads, length, d), perm=[0, 2, 1, 3])
        if kind != "k":
            return h
        if spelling == "dynamo":  # kᵀ through [B*H, S, D]
            f = g.op("Reshape", [h, g.ints([-1, length, d])], (b * heads, length, d))
            ft = g.op("Transpose", [f], (b * heads, d, length), perm=[0, 2, 1])
            return g.op("Reshape", [ft, g.ints([b, heads, d, length])], (b, heads, d, length))
        return g.op("Transpose", [h], (b, heads, d, length), perm=[0, 1, 3, 2])

    qh, vh = heads_of(q, s, "q"), heads_of(v, n_ctx, "v")
    if kv_shared and split == "heads":  # kᵀ from v's head split: the two chains share nodes
        kt = g.op("Transpose", [vh], (b, heads, d, n_ctx), perm=[0, 1, 3, 2])
    else:
        kt = heads_of(k, n_ctx, "k")
    if v_scale:  # a scale on v is not the softmax's scale
        vh = g.bin("Mul", vh, g.scalar(0.5))
    if q_escapes:
        g.output(qh)
    if spelling == "dynamo":
        sc = g.fconst(d ** -0.25, "scale")
        qh = g.op("Mul", [qh, sc], g.shape[qh])
        kt = g.op("Mul", [kt, sc], g.shape[kt])
        scores = g.op("MatMul", [qh, kt], (b, heads, s, n_ctx))
    else:
        scores = g.op("MatMul", [qh, kt], (b, heads, s, n_ctx))
        if head_scale:  # one scale per head: not a scalar
            scores = g.bin("Mul", scores, g.tensor(g.rng.uniform(0.2, 1.0, (1, heads, 1, 1)).astype(g.np_dtype),
                                                   "head_scale"))
        elif g.flag():
            scores = g.bin("Div", scores, g.scalar(math.sqrt(d), "sqrt_d"))
        else:
            scores = g.bin("Mul", scores, g.scalar(d ** -0.5, "scale"))
    if causal or mask != "none":
        big = float(np.finfo(g.np_dtype).min) if g.flag() else -np.inf
        if causal:
            m = np.where(np.triu(np.ones((s, n_ctx), bool), 1), big, 0.0)
        else:
            m = g.rng.standard_normal((s, n_ctx))
        m = m.reshape((1, 1, s, n_ctx) if g.flag() else (s, n_ctx)).astype(g.np_dtype)
        mv = g.tensor(m, "mask")
        scores = g.op("Add", [scores, mv] if g.flag() else [mv, scores], g.shape[scores])
    p = g.op("Softmax", [scores], g.shape[scores], axis=softmax_axis)
    if softmax_escapes:
        g.output(p)
    o = g.op("MatMul", [p, vh], (b, heads, s, d))
    if merge == "heads":
        ot = g.op("Transpose", [o], (b, s, heads, d), perm=[0, 2, 1, 3])
        y = g.op("Reshape", [ot, g.ints(g.pick([[b, s, cm], [0, 0, -1], [b, -1, cm]]))], (b, s, cm))
    else:  # not a head merge: the heads stay in front
        y = g.op("Reshape", [o, g.ints([b, s, cm])], (b, s, cm))
    return _project(g, y, c) if g.flag() else y


def _attention_params(g: G) -> dict[str, Any]:
    heads, d = g.num(1, 4), g.num(1, 8)
    cross = g.num(0, 2) == 0
    causal = not cross and g.num(0, 3) == 0
    return {"heads": heads, "d": d, "cross": cross, "spelling": g.pick(["dynamo", "torchscript", "plain"]),
            "causal": causal, "kv_shared": g.num(0, 5) == 0}


def step_attention(g: G, x: str) -> str:
    p = _attention_params(g)
    g.desc.append("Attention(" + ", ".join(f"{k}={v}" for k, v in p.items()) + ")")
    return attention(g, x, **p)


# ---- norms -------------------------------------------------------------------------------------------------

def group_norm(g: G, x: str, *, groups: int, eps: float, silu: bool, gamma: str | None = None,
               beta: str | None = None, inorm_scale: float = 1.0, escape: str | None = None,
               back_shape: tuple[int, ...] | None = None) -> str:
    """GroupNorm as both torch exporters write it: Reshape -> InstanceNormalization -> Reshape -> Mul -> Add."""
    shape = g.shape[x]
    b, c = shape[:2]
    affine = (c,) + (1,) * (len(shape) - 2)
    if gamma is None:
        gamma = g.weight(affine if g.flag() else (1, *affine), 0.3, "gamma", offset=1.0)
    if beta is None:
        beta = g.weight(affine if g.flag() else (1, *affine), 0.3, "beta")
    grouped = (b, groups, _size(shape) // (b * groups))
    target = g.ints(g.pick([[b, groups, -1], [0, groups, -1]]))
    r = g.op("Reshape", [x, target], grouped)
    inorm = g.op("InstanceNormalization", [r, g.fconst(np.full(groups, inorm_scale)), g.fconst(np.zeros(groups))],
                 grouped, epsilon=eps)
    back = back_shape or shape
    if back_shape is None and g.flag():
        shp = g.op("Shape", [x], (len(shape),))  # TorchScript reads the shape at run time
        g.types[shp] = T.INT64
        g.activations.remove(shp)
    else:
        shp = g.ints(list(back))
    r2 = g.op("Reshape", [inorm, shp], back)
    if escape == "instance_norm":
        g.output(inorm)
    elif escape == "reshape":
        g.output(r2)
    m = g.op("Mul", [r2, gamma] if g.flag() else [gamma, r2], back)
    y = g.op("Add", [m, beta] if g.flag() else [beta, m], back)
    return _silu(g, y) if silu else y


def step_group_norm(g: G, x: str) -> str:
    c = g.shape[x][1]
    groups, eps, silu = g.pick(_divisors(c)), g.pick([1e-5, 1e-6, 1e-3]), g.flag()
    g.desc.append(f"GroupNorm(groups={groups}, eps={eps}){'+SiLU' if silu else ''}")
    return group_norm(g, x, groups=groups, eps=eps, silu=silu)


def step_layer_norm(g: G, x: str) -> str:
    shape = g.shape[x]
    c = shape[-1]
    bias, eps = g.flag(), g.pick([1e-5, 1e-6, 1e-3])
    ins = [x, g.weight((c,), 0.3, "gamma", offset=1.0)] + ([g.weight((c,), 0.3, "beta")] if bias else [])
    axis = g.pick([-1, len(shape) - 1])
    g.desc.append(f"LayerNormalization(axis={axis}, bias={bias}, eps={eps})")
    return g.op("LayerNormalization", ins, shape, axis=axis, epsilon=eps)


def step_layer_norm_decomposed(g: G, x: str) -> str:
    """LayerNorm as TorchScript writes it below opset 17: ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div."""
    shape = g.shape[x]
    red = (*shape[:-1], 1)
    axes = g.ints([-1], "axes")
    mean = g.op("ReduceMean", [x, axes], red)
    d = g.op("Sub", [x, mean], shape)
    var = g.op("ReduceMean", [g.op("Pow", [d, g.fconst(2.0)], shape), axes], red)
    n = g.op("Div", [d, g.op("Sqrt", [g.op("Add", [var, g.fconst(1e-5)], red)], red)], shape)
    y = g.op("Add", [g.op("Mul", [n, g.weight((shape[-1],), 0.3, "gamma", offset=1.0)], shape),
                     g.weight((shape[-1],), 0.3, "beta")], shape)
    g.desc.append("LayerNorm(decomposed)")
    return y


def instance_norm(g: G, x: str, *, affine: bool, eps: float, silu: bool, flatten: bool = False) -> str:
    """InstanceNormalization as torch writes InstanceNorm1d/2d/3d (affine: learned scale and bias; not: ones
    and zeros), after TorchScript's flattening Reshape [B, C, *S] -> [B, C, L] with ``flatten``."""
    shape = g.shape[x]
    if flatten and len(shape) > 3:
        flat = (shape[0], shape[1], _size(shape[2:]))
        x = g.op("Reshape", [x, g.ints(g.pick([list(flat), [0, 0, -1]]))], flat)
        shape = flat
    c = shape[1]
    # a row of one value normalizes to 0, the output is the bias: onnxruntime's kernel computes a x + (b - a mean),
    # a = scale / sqrt(eps), rounding at |a x| (~1e3 |x|): 4e-6 off a bias of 0.04, an error of the reference graph
    # itself that no sensitivity run sees (the output does not depend on x). Such rows get ones and zeros.
    affine = affine and _size(shape[2:]) > 1
    scale = g.weight((c,), 0.3, "in_scale", offset=1.0) if affine else g.fconst(np.ones(c))
    bias = g.weight((c,), 0.3, "in_bias") if affine else g.fconst(np.zeros(c))
    y = g.op("InstanceNormalization", [x, scale, bias], shape, epsilon=eps)
    return _silu(g, y) if silu else y


def step_instance_norm(g: G, x: str) -> str:
    affine, eps, silu, flatten = g.flag(), g.pick([1e-5, 1e-6, 1e-3]), g.flag(), g.num(0, 3) == 0
    g.desc.append(f"InstanceNorm(affine={affine}, eps={eps}{', flattened' if flatten else ''})"
                  f"{'+SiLU' if silu else ''}")
    return instance_norm(g, x, affine=affine, eps=eps, silu=silu, flatten=flatten)


def l2_norm(g: G, x: str, *, axes: list[int], root: str, clamp: str, eps: float, expand: bool, divide: bool,
            sqrt_d: bool, gamma: str | None = None, numerator: str | None = None) -> str:
    """x / clamp(||x||, eps) over ``axes`` as F.normalize exports it (ReduceL2, Clip, Expand, Div) and its
    neighbours: the root as Sqrt(ReduceSum(x^2)), Sqrt(ReduceSumSquare(x)) or Sqrt(ReduceMean(x^2)) (an RMS
    norm), eps by Clip, Max or Add, no Expand, x * Reciprocal; then * sqrt(D) (Qwen-Image's RMS_norm) and
    * ``gamma``. ``numerator``: divide another tensor than x (a near miss)."""
    shape = g.shape[x]
    red = tuple(1 if i in [a % len(shape) for a in axes] else d for i, d in enumerate(shape))
    ax = g.ints(axes, "axes")
    if root == "ReduceL2":
        r = g.op("ReduceL2", [x, ax], red, keepdims=1)
    elif root == "ReduceSumSquare":
        r = g.op("Sqrt", [g.op("ReduceSumSquare", [x, ax], red, keepdims=1)], red)
    else:
        sq = g.op("Pow", [x, g.scalar(2.0, "two")], shape) if g.flag() else g.op("Mul", [x, x], shape)
        r = g.op("Sqrt", [g.op(root, [sq, ax], red, keepdims=1)], red)
    e = g.fconst(eps, "eps")  # Clip's min is a scalar
    d = g.op("Clip", [r, e], red) if clamp == "Clip" else g.bin(clamp, r, e) if g.flag() else g.bin(clamp, e, r)
    if expand:
        d = g.op("Expand", [d, g.ints(list(shape))], shape)
    num = numerator or x
    y = g.bin("Div", num, d) if divide else g.bin("Mul", num, g.op("Reciprocal", [d], g.shape[d]))
    if sqrt_d:
        y = g.bin("Mul", y, g.scalar(math.sqrt(_size([shape[a] for a in axes])), "sqrt_d"))
    if gamma is not None:
        y = g.bin("Mul", y, gamma) if g.flag() else g.bin("Mul", gamma, y)
    return y


def _norm_axis_weight(g: G, shape: tuple[int, ...], axis: int) -> str:
    """A weight per channel of ``axis``: [C, 1, ..] or [1, C, 1, ..] for the channels (axis 1), [K] or [1, K]
    for the last axis."""
    rank, k = len(shape), shape[axis]
    if axis % rank == rank - 1:
        return g.weight(g.pick([(k,), (1, k)]), 0.3, "gamma", offset=1.0)
    ones = (1,) * (rank - 2)
    return g.weight(g.pick([(k, *ones), (1, k, *ones)]), 0.3, "gamma", offset=1.0)


def step_l2_norm(g: G, x: str) -> str:
    """F.normalize over the last axis or the channels, in each spelling, now and then Qwen-Image's * sqrt(C) *
    gamma."""
    shape = g.shape[x]
    axes = [a for a in [-1] + ([1] if len(shape) >= 3 else []) if shape[a] > 1]
    if not axes:  # the norm of one value is its sign (ill-conditioned at 0): an RMS norm, eps inside, instead
        g.desc.append("RMSNorm (of one value)")
        return rms_norm(g, x, scale=None)
    axis = g.pick(axes)
    p = {"root": g.pick(["ReduceL2", "ReduceL2", "ReduceSum", "ReduceSumSquare", "ReduceMean"]),
         "clamp": g.pick(["Clip", "Clip", "Max", "Add"]), "eps": g.pick([1e-12, 1e-12, 1e-8, 1e-6]),
         "expand": g.flag(), "divide": g.num(0, 3) > 0, "sqrt_d": g.flag()}
    gamma = _norm_axis_weight(g, shape, axis) if g.flag() else None
    g.desc.append(f"L2Norm(axis={axis}, " + ", ".join(f"{k}={v}" for k, v in p.items()) +
                  f"{', gamma' if gamma else ''})")
    return l2_norm(g, x, axes=[axis], gamma=gamma, **p)


def step_channel_rms_norm(g: G, x: str) -> str:
    """An RMS norm over the channels of [B, C, *S], scaled per channel (a Qwen-style norm written out)."""
    shape = g.shape[x]
    g.desc.append("RMSNorm(channels)")
    return rms_norm(g, x, axis=1, scale=_norm_axis_weight(g, shape, 1) if g.num(0, 3) else None)


# ---- activations ---------------------------------------------------------------------------------------------

def step_silu(g: G, x: str) -> str:
    g.desc.append("SiLU")
    return _silu(g, x)


def step_gelu(g: G, x: str) -> str:
    approx = g.pick(["none", "tanh"])
    g.desc.append(f"Gelu(approximate={approx})")
    return g.op("Gelu", [x], g.shape[x], approximate=approx)


def step_erf_gelu(g: G, x: str) -> str:
    """x * 0.5 * (1 + erf(x / sqrt 2)) in the spellings TorchScript and optimum write (and one neither does)."""
    r = len(g.shape[x]) + 1
    spelling = g.pick(["torchscript", "mul_inv_sqrt2", "half_first"])

    def erf(div: bool) -> str:
        arg = g.bin("Div", x, g.scalar(math.sqrt(2), raise_rank=r)) if div else \
            g.bin("Mul", x, g.scalar(1 / math.sqrt(2), raise_rank=r))
        return g.op("Erf", [arg], g.shape[arg])

    if spelling == "torchscript":
        e, one = erf(True), g.scalar(1.0, raise_rank=r)
        a = g.bin("Add", e, one) if g.flag() else g.bin("Add", one, e)
        y = g.bin("Mul", g.bin("Mul", x, a) if g.flag() else g.bin("Mul", a, x), g.scalar(0.5, raise_rank=r))
    elif spelling == "mul_inv_sqrt2":
        a = g.bin("Add", erf(False), g.scalar(1.0, raise_rank=r))
        y = g.bin("Mul", g.scalar(0.5, raise_rank=r), g.bin("Mul", x, a))
    else:
        y = g.bin("Mul", g.bin("Mul", x, g.scalar(0.5, raise_rank=r)), g.bin("Add", erf(True), g.scalar(1.0)))
    g.desc.append(f"ErfGELU({spelling})")
    return y


def step_tanh_gelu(g: G, x: str) -> str:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) written out: TorchScript's approximate='tanh' (halving
    last), transformers' gelu_new (T5: halving first), the cube as Pow or x*x*x, constants on either side."""
    r = len(g.shape[x]) + 1
    spelling = g.pick(["half_last", "half_first", "half_of_sum"])

    def mul(a: str, b: str) -> str:
        return g.bin("Mul", a, b) if g.flag() else g.bin("Mul", b, a)

    cube = g.bin("Pow", x, g.scalar(3.0)) if g.flag() else g.bin("Mul", g.bin("Mul", x, x), x)
    inner = g.bin("Add", x, mul(cube, g.scalar(0.044715, raise_rank=r)))
    arg = mul(inner, g.scalar(math.sqrt(2 / math.pi)))
    t = g.op("Tanh", [arg], g.shape[arg])
    one = g.bin("Add", t, g.scalar(1.0))
    if spelling == "half_last":
        y = g.bin("Mul", g.bin("Mul", x, one), g.scalar(0.5, raise_rank=r))
    elif spelling == "half_first":
        y = g.bin("Mul", mul(x, g.scalar(0.5, raise_rank=r)), one)
    else:
        y = g.bin("Mul", g.bin("Mul", one, g.scalar(0.5)), x)
    g.desc.append(f"TanhGELU({spelling})")
    return y


def step_quick_gelu(g: G, x: str) -> str:
    c = g.scalar(1.702, raise_rank=len(g.shape[x]) + 1)
    inner = g.bin("Mul", x, c) if g.flag() else g.bin("Mul", c, x)
    sig = g.op("Sigmoid", [inner], g.shape[inner])
    g.desc.append("QuickGelu")
    return g.bin("Mul", x, sig) if g.flag() else g.bin("Mul", sig, x)


def _halves(g: G, x: str, spelling: str) -> tuple[str, str]:
    shape = g.shape[x]
    n = shape[-1] // 2
    half = (*shape[:-1], n)
    if spelling == "split":
        h, gate = g.op_n("Split", [x], [half, half], axis=g.pick([-1, len(shape) - 1]), num_outputs=2)
        return h, gate
    big = np.iinfo(np.int64).max

    def sl(start: int, end: int) -> str:
        return g.op("Slice", [x, g.ints([start], "starts"), g.ints([end], "ends"),
                              g.ints([g.pick([-1, len(shape) - 1])], "axes"), g.ints([1], "steps")], half)

    return sl(0, n), sl(n, g.pick([2 * n, big]))


def step_geglu(g: G, x: str) -> str:
    """The transformer's GEGLU: Linear to 2n, halves (Split for dynamo, two Slices for TorchScript), h * gelu(g)."""
    n = g.num(1, 16)
    while _size((*g.shape[x][:-1], 2 * n)) > MAX_ELEMS and n > 1:
        n //= 2
    proj = _project(g, x, 2 * n)
    spelling, approx = g.pick(["split", "slices"]), g.pick(["none", "tanh"])
    h, gate = _halves(g, proj, spelling)
    gl = g.op("Gelu", [gate], g.shape[gate], approximate=approx)
    g.desc.append(f"GEGLU(n={n}, {spelling}, approximate={approx})")
    return g.op("Mul", [h, gl] if g.flag() else [gl, h], g.shape[h])


def step_sigmoid(g: G, x: str) -> str:
    g.desc.append("Sigmoid")
    return g.op("Sigmoid", [x], g.shape[x])


def step_softmax(g: G, x: str) -> str:
    axis = g.num(-len(g.shape[x]), len(g.shape[x]) - 1)
    g.desc.append(f"Softmax(axis={axis})")
    return g.op("Softmax", [x], g.shape[x], axis=axis)


# ---- resize -------------------------------------------------------------------------------------------------

def step_resize(g: G, x: str) -> str:
    b, c, h, w = g.shape[x]
    fh, fw = g.num(1, 3), g.num(1, 3)
    if g.flag():
        fw = fh
    while b * c * h * fh * w * fw > MAX_ELEMS and max(fh, fw) > 1:
        fh, fw = max(1, fh - 1), max(1, fw - 1)
    out = (b, c, h * fh, w * fw)
    coord = g.pick(["asymmetric", "half_pixel", "pytorch_half_pixel", "align_corners", "tf_half_pixel_for_nn"])
    nearest = g.pick(["floor", "round_prefer_floor", "round_prefer_ceil", "ceil"])
    if g.flag():
        ins = [x, "", g.tensor(np.array([1, 1, fh, fw], np.float32), "scales")]
    else:
        ins = [x, "", "", g.ints(list(out), "sizes")]
    g.desc.append(f"Resize(nearest, {fh}x{fw}, {coord}, {nearest}, {'scales' if ins[2] else 'sizes'})")
    return g.op("Resize", ins, out, mode="nearest", coordinate_transformation_mode=coord, nearest_mode=nearest)


# ---- element-wise and data selection ---------------------------------------------------------------------------

def _const_operand(g: G, shape: tuple[int, ...], op: str) -> tuple[str, str]:
    kinds = ["scalar", "one", "last", "channel", "full"] if len(shape) >= 3 else ["scalar", "one", "last", "full"]
    kind = g.pick(kinds)
    if kind == "scalar" and op != "Div":
        return g.scalar(float(g.rng.standard_normal()), "k", raise_rank=len(shape) + 1), kind
    shapes = {"scalar": (), "one": (1,), "last": (shape[-1],), "full": shape}
    cshape = shapes[kind] if kind in shapes else (shape[1],) + (1,) * (len(shape) - 2)
    if op == "Div":  # away from zero
        a = (g.rng.uniform(0.5, 2.0, cshape) * g.rng.choice([-1, 1], cshape)).astype(g.np_dtype)
        return g.tensor(a, "divisor"), kind
    return g.weight(cshape, 1.0, "k"), kind


def step_binary_const(g: G, x: str) -> str:
    op = g.pick(["Add", "Sub", "Mul", "Div"])
    c, kind = _const_operand(g, g.shape[x], op)
    left = op != "Div" and g.flag()
    g.desc.append(f"{op}(const {kind}{', left' if left else ''})")
    return g.bin(op, c, x) if left else g.bin(op, x, c)


def step_binary_branch(g: G, x: str) -> str:
    """x op f(x): a residual connection around a small branch, or a product of two activations."""
    op = g.pick(["Add", "Sub", "Mul"])
    branch = g.pick(["sigmoid", "self", "input"])
    if branch == "sigmoid":
        other = g.op("Sigmoid", [x], g.shape[x])
    elif branch == "self":
        other = x
    else:
        other = g.input(g.shape[x] if g.flag() else (1,) * (len(g.shape[x]) - 1) + (g.shape[x][-1],), "y")
    g.desc.append(f"{op}(x, {branch})")
    return g.op(op, [x, other] if g.flag() else [other, x], g.shape[x])


def step_concat(g: G, x: str) -> str:
    shape = g.shape[x]
    axis = g.num(-len(shape), len(shape) - 1)
    ax = axis % len(shape)
    extra = g.num(1, 4)
    oshape = list(shape)
    oshape[ax] = extra
    kind = g.pick(["input", "const", "self"])
    other = x if kind == "self" else g.input(oshape, "y") if kind == "input" else g.weight(oshape, 1.0, "k")
    if kind == "self":
        oshape[ax] = shape[ax]
    out = list(shape)
    out[ax] += oshape[ax]
    ins = [x, other] if g.flag() else [other, x]
    if g.num(0, 3) == 0:  # three inputs (glue chains SDConcat pairs)
        ins.append(x)
        out[ax] += shape[ax]
    g.desc.append(f"Concat(axis={axis}, {kind}, {len(ins)} inputs)")
    if _size(out) > MAX_ELEMS:
        return step_sigmoid(g, x)
    return g.op("Concat", ins, out, axis=axis)


def step_slice(g: G, x: str) -> str:
    shape = g.shape[x]
    n_axes = g.num(1, len(shape))
    axes = g.draw(st.permutations(list(range(len(shape)))))[:n_axes]
    starts, ends, steps, out = [], [], [], list(shape)
    big = np.iinfo(np.int64).max
    for a in axes:
        size = shape[a]
        step = g.pick([1, 1, 1, 2, -1, -2]) if size > 1 else 1
        idx = list(range(size))
        lo, hi = sorted((g.num(0, size - 1), g.num(0, size - 1)))
        if step > 0:
            start, end = lo, hi + 1
            sel = idx[start:end:step]
            s_w = start - size if g.flag() else start
            e_w = big if end == size and g.flag() else end
        else:
            start, end = hi, lo - 1
            sel = idx[start:end if end >= 0 else None:step]
            s_w = start
            e_w = -size - 1 - g.num(0, 3) if end < 0 else end
        starts.append(s_w)
        ends.append(e_w)
        steps.append(step)
        out[a] = len(sel)
    axes_w = [a - len(shape) if g.flag() else a for a in axes]
    ins = [x, g.ints(starts, "starts"), g.ints(ends, "ends")]
    if axes_w != list(range(len(axes_w))) or steps != [1] * len(steps) or g.flag():
        ins.append(g.ints(axes_w, "axes"))
        if steps != [1] * len(steps) or g.flag():
            ins.append(g.ints(steps, "steps"))
    g.desc.append(f"Slice(starts={starts}, ends={ends}, axes={axes_w}, steps={steps})")
    return g.op("Slice", ins, out)


def step_split(g: G, x: str) -> str:
    """Split along an axis into two parts, combined again (swapped Concat, or an Add when they match)."""
    shape = g.shape[x]
    axes = [a for a in range(len(shape)) if shape[a] >= 2]
    if not axes:
        return step_sigmoid(g, x)
    ax = g.pick(axes)
    first = g.num(1, shape[ax] - 1)
    parts = [list(shape), list(shape)]
    parts[0][ax], parts[1][ax] = first, shape[ax] - first
    a, b = g.op_n("Split", [x, g.ints([first, shape[ax] - first], "split")], parts, axis=ax)
    g.desc.append(f"Split(axis={ax}, [{first}, {shape[ax] - first}])")
    if parts[0] == parts[1] and g.flag():
        return g.op("Add", [a, b], parts[0])
    return g.op("Concat", [b, a], shape, axis=ax)


def step_expand(g: G, x: str) -> str:
    """Expand a size-1 axis (the UNet's timestep to the batch), or to a new leading axis."""
    shape = g.shape[x]
    ones = [i for i, d in enumerate(shape) if d == 1]
    n = g.num(2, 3)
    if ones and g.flag():
        out = list(shape)
        out[g.pick(ones)] = n
    else:
        out = [n, *shape]
    if _size(out) > MAX_ELEMS or len(out) > 4:
        return step_sigmoid(g, x)
    k = len(out) - len(shape)
    target = list(out) if g.flag() else out[:k] + [o if s == 1 else 1 for o, s in zip(out[k:], shape, strict=True)]
    g.desc.append(f"Expand({target})")
    return g.op("Expand", [x, g.ints(target)], out)


# ---- data movement ------------------------------------------------------------------------------------------------

def _factor(g: G, size: int, rank: int) -> list[int]:
    dims = []
    for _ in range(rank - 1):
        d = g.pick(_divisors(size))
        dims.append(d)
        size //= d
    dims.append(size)
    return dims


def step_movement_chain(g: G, x: str) -> str:
    """1-4 random Reshape / Transpose / Squeeze / Unsqueeze / Flatten nodes."""
    done = []
    for _ in range(g.num(1, 4)):
        shape = g.shape[x]
        kind = g.pick(["Reshape", "Transpose", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Identity"])
        if kind == "Transpose" and len(shape) >= 2 and g.num(0, 3) == 0:  # no perm: reverse the axes
            x = g.op("Transpose", [x], shape[::-1])
            done.append("Transpose()")
        elif kind == "Transpose" and len(shape) >= 2:
            perm = list(g.draw(st.permutations(list(range(len(shape))))))
            x = g.op("Transpose", [x], [shape[i] for i in perm], perm=perm)
            done.append(f"Transpose{perm}")
        elif kind == "Identity":
            x = g.op("Identity", [x], shape)
            done.append("Identity")
        elif kind == "Unsqueeze" and len(shape) < 4:
            ax = g.num(0, len(shape))
            new = list(shape)
            new.insert(ax, 1)
            x = g.op("Unsqueeze", [x, g.ints([ax], "axes")], new)
            done.append(f"Unsqueeze({ax})")
        elif kind == "Squeeze" and 1 in shape and len(shape) > 1:
            ax = shape.index(1)
            x = g.op("Squeeze", [x, g.ints([ax], "axes")], shape[:ax] + shape[ax + 1:])
            done.append(f"Squeeze({ax})")
        elif kind == "Flatten" and len(shape) >= 2:
            ax = g.num(0, len(shape))
            x = g.op("Flatten", [x], [_size(shape[:ax]), _size(shape[ax:])], axis=ax)
            done.append(f"Flatten({ax})")
        else:
            new = _factor(g, _size(shape), g.num(1, 4))
            target = list(new)
            if g.flag():
                target[g.num(0, len(new) - 1)] = -1
            x = g.op("Reshape", [x, g.ints(target)], new)
            done.append(f"Reshape{target}")
    g.desc.append("Movement(" + ", ".join(done) + ")")
    return x


def step_nhwc_roundtrip(g: G, x: str) -> str:
    """NCHW -> NHWC [-> [B, HW, C] and back] -> NCHW: the layout pass must cancel it to nothing."""
    b, c, h, w = g.shape[x]
    t = g.op("Transpose", [x], (b, h, w, c), perm=[0, 2, 3, 1])
    flat = g.flag()
    if flat:
        t = g.op("Reshape", [t, g.ints([b, h * w, c])], (b, h * w, c))
        if g.flag():
            t = _silu(g, t)
        t = g.op("Reshape", [t, g.ints([b, h, w, c])], (b, h, w, c))
    g.desc.append(f"NHWC roundtrip(flat={flat})")
    return g.op("Transpose", [t], (b, c, h, w), perm=[0, 3, 1, 2])


def step_to_tokens(g: G, x: str) -> str:
    """[B, C, H, W] -> [B, HW, C] (the VAE's attention, the UNet's transformer input)."""
    b, c, h, w = g.shape[x]
    if g.flag():
        r = g.op("Reshape", [x, g.ints(g.pick([[b, c, h * w], [b, c, -1], [0, 0, -1]]))], (b, c, h * w))
        y = g.op("Transpose", [r], (b, h * w, c), perm=[0, 2, 1])
        g.desc.append("to tokens(Reshape, Transpose)")
    else:
        t = g.op("Transpose", [x], (b, h, w, c), perm=[0, 2, 3, 1])
        y = g.op("Reshape", [t, g.ints([b, h * w, c])], (b, h * w, c))
        g.desc.append("to tokens(Transpose, Reshape)")
    return y


def step_to_image(g: G, x: str) -> str:
    b, s, c = g.shape[x]
    h = g.pick(_divisors(s))
    w = s // h
    if g.flag():
        t = g.op("Transpose", [x], (b, c, s), perm=[0, 2, 1])
        y = g.op("Reshape", [t, g.ints([b, c, h, w])], (b, c, h, w))
        g.desc.append(f"to image({h}x{w}, Transpose, Reshape)")
    else:
        r = g.op("Reshape", [x, g.ints([b, h, w, c])], (b, h, w, c))
        y = g.op("Transpose", [r], (b, c, h, w), perm=[0, 3, 1, 2])
        g.desc.append(f"to image({h}x{w}, Reshape, Transpose)")
    return y


def step_sinusoid(g: G, x: str) -> str:
    """The timestep embedding: t * 1000 * freqs -> [sin, cos] (the fp32 island) -> Linear, SiLU."""
    (b,) = g.shape[x]
    f = g.num(1, 8)
    t = g.bin("Mul", x, g.scalar(500.0))
    t = g.op("Unsqueeze", [t, g.ints([1], "axes")], (b, 1))
    freqs = np.exp(-math.log(10000) * np.arange(f) / f).reshape(1, f).astype(g.np_dtype)
    arg = g.bin("Mul", t, g.tensor(freqs, "freqs"))
    sc = [g.op("Sin", [arg], (b, f)), g.op("Cos", [arg], (b, f))]
    y = g.op("Concat", sc if g.flag() else sc[::-1], (b, 2 * f), axis=-1)
    g.desc.append(f"Sinusoid(freqs={f})")
    return _silu(g, _project(g, y, g.num(1, 16)))


def step_text(g: G, x: str | None) -> str:
    """CLIP's front and back: Gather(table, ids) -> hidden states; optionally the end-of-text pooling
    (GatherND at each row's argmax id), as dynamo writes them. Makes its own int64 ids input."""
    b, seq, c, v = g.num(1, 2), g.num(1, 12), g.num(1, 24), g.num(8, 12)
    ids = g.input((b, seq), "ids")
    g.types[ids] = T.INT64
    h = g.op("Gather", [g.weight((v, c), 1.0, "table"), ids], (b, seq, c), axis=0)
    g.desc.append(f"Embedding({v}x{c})")
    if g.flag():
        h = step_layer_norm(g, h)
        cast = g.op("Cast", [ids], (b, seq), to=T.INT32)
        g.types[cast] = T.INT32
        am = g.op("ArgMax", [cast], (b,), axis=-1, keepdims=0)
        am2 = g.op("Reshape", [am, g.ints([b, 1])], (b, 1))
        idx = g.op("Concat", [g.ints([[i] for i in range(b)], "rows"), am2], (b, 2), axis=-1)
        for v_ in (cast, am, am2, idx):
            g.activations.remove(v_)
        g.types[am] = g.types[am2] = g.types[idx] = T.INT64
        h = g.op("GatherND", [h, idx], (b, c))
        g.desc.append("TokenPool")
    return h


# ---- blocks ----------------------------------------------------------------------------------------------------------

def _gn_groups(g: G, c: int) -> int:
    return g.pick(_divisors(c))


def step_resnet_block(g: G, x: str) -> str:
    """GroupNorm+SiLU -> Conv3x3 -> GroupNorm+SiLU -> Conv3x3, plus the skip (a 1x1 Conv when channels change)."""
    b, c, h, w = g.shape[x]
    oc = g.num(1, 16)
    while b * oc * h * w > MAX_ELEMS and oc > 1:
        oc //= 2
    spec = ConvSpec(oc, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), 1, (b, oc, h, w))
    y = group_norm(g, x, groups=_gn_groups(g, c), eps=1e-5, silu=True)
    y = _conv(g, y, spec, bias=True)
    temb = g.pick(["none", "const", "input"])
    if temb == "const":  # a fixed per-channel shift
        y = g.op("Add", [y, g.weight((1, oc, 1, 1), 0.3, "temb")], g.shape[y])
    elif temb == "input":  # the UNet's time embedding: SiLU -> Linear -> [B, C, 1, 1], broadcast over H and W
        t = g.input((b, g.num(1, 16)), "temb")
        t = _project(g, _silu(g, t), oc, bias=True, keep_rank=True)
        t = g.op("Unsqueeze", [t, g.ints([2, 3], "axes")], (b, oc, 1, 1)) if g.flag() else \
            g.op("Reshape", [t, g.ints([b, oc, 1, 1])], (b, oc, 1, 1))
        y = g.op("Add", [y, t] if g.flag() else [t, y], g.shape[y])
    y = group_norm(g, y, groups=_gn_groups(g, oc), eps=1e-5, silu=True)
    y = _conv(g, y, ConvSpec(oc, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), 1, (b, oc, h, w)), bias=True)
    skip = x if oc == c else _conv(g, x, ConvSpec(oc, (1, 1), (1, 1), [0, 0, 0, 0], (1, 1), 1, (b, oc, h, w)),
                                   bias=True)
    g.desc.append(f"ResnetBlock({c}->{oc})")
    return g.op("Add", [skip, y] if g.flag() else [y, skip], (b, oc, h, w))


def step_unet_skip_block(g: G, x: str) -> str:
    """The UNet's up path: Conv -> [Resize] -> Concat with the skip on channels -> Conv, two branches meeting
    (the layout pass must push both NHWC->NCHW Transposes through the Concat)."""
    b, c, h, w = g.shape[x]
    a = _conv(g, x, ConvSpec(c, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), 1, (b, c, h, w)), bias=True)
    skip = g.pick(["input", "conv", "x"])
    if skip == "conv":
        n = g.num(1, 8)
        other = _conv(g, x, ConvSpec(n, (1, 1), (1, 1), [0, 0, 0, 0], (1, 1), 1, (b, n, h, w)), bias=True)
    elif skip == "input":
        other = g.input((b, g.num(1, 8), h, w), "skip")
    else:
        other = x
    oc = g.shape[other][1]
    cat = g.op("Concat", [a, other] if g.flag() else [other, a], (b, c + oc, h, w), axis=g.pick([1, -3]))
    if g.flag():
        cat = g.bin("Mul", cat, g.scalar(0.5))  # a scale after the concat, before the next Conv
    g.desc.append(f"UNetSkipBlock(skip={skip})")
    return _conv(g, cat, ConvSpec(c, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), 1, (b, c, h, w)), bias=True)


def step_vae_attention_block(g: G, x: str) -> str:
    """GroupNorm -> [B, HW, C] -> single-head attention -> back to NCHW -> + x."""
    b, c, h, w = g.shape[x]
    y = group_norm(g, x, groups=_gn_groups(g, c), eps=1e-6, silu=False)
    t = step_to_tokens(g, y)
    t = attention(g, t, heads=1, d=c, cross=False, spelling=g.pick(["dynamo", "torchscript", "plain"]), causal=False)
    if g.shape[t][-1] != c:
        t = _project(g, t, c)
    back = g.op("Transpose", [t], (b, c, h * w), perm=[0, 2, 1])
    back = g.op("Reshape", [back, g.ints([b, c, h, w])], (b, c, h, w))
    g.desc.append("VAEAttentionBlock")
    return g.op("Add", [back, x], (b, c, h, w))


def step_transformer_block(g: G, x: str) -> str:
    """LayerNorm -> self-attention -> + ; LayerNorm -> cross-attention -> + ; LayerNorm -> GEGLU FF -> +."""
    b, s, c = g.shape[x]
    y = x
    for cross in (False, True):
        n = g.op("LayerNormalization", [y, g.weight((c,), 0.3, "gamma", offset=1.0), g.weight((c,), 0.3, "beta")],
                 (b, s, c), axis=-1, epsilon=1e-5)
        heads = g.pick([h for h in (1, 2, 4) if h <= 8])
        a = attention(g, n, heads=heads, d=g.num(1, 8), cross=cross, spelling=g.pick(["dynamo", "torchscript"]),
                      causal=False)
        if g.shape[a][-1] != c:
            a = _project(g, a, c)
        y = g.op("Add", [a, y], (b, s, c))
    n = g.op("LayerNormalization", [y, g.weight((c,), 0.3, "gamma", offset=1.0), g.weight((c,), 0.3, "beta")],
             (b, s, c), axis=-1, epsilon=1e-5)
    ff = step_geglu(g, n)
    ff = _project(g, ff, c, bias=True)
    g.desc.append("TransformerBlock")
    return g.op("Add", [ff, y], (b, s, c))


# ---- SD3's MMDiT ------------------------------------------------------------------------------------------

def rms_norm(g: G, x: str, *, axis: int = -1, scale: str | None | bool = True) -> str:
    """torch's RMSNorm as the exporters write it: x * Reciprocal(Sqrt(ReduceMean(Pow(x, 2)) + eps)) [* w]
    (dynamo), or x / Sqrt(ReduceMean(x * x) + eps) (TorchScript's spelling), over ``axis``."""
    shape = g.shape[x]
    sq = g.op("Pow", [x, g.scalar(2.0, "two")], shape) if g.flag() else g.op("Mul", [x, x], shape)
    red = tuple(1 if i == axis % len(shape) else d for i, d in enumerate(shape))
    m = g.op("ReduceMean", [sq, g.ints([axis], "axes")], red, keepdims=1)
    r = g.op("Sqrt", [g.bin("Add", m, g.scalar(g.pick([1e-6, 1e-5]), "eps"))], red)
    y = g.bin("Mul", x, g.op("Reciprocal", [r], red)) if g.flag() else g.bin("Div", x, r)
    if scale is True:
        k = shape[-1]
        scale = g.weight(g.pick([(k,), (1, k)]), 0.3, "rms_w", offset=1.0)
    if scale:
        y = g.bin("Mul", y, scale) if g.flag() else g.bin("Mul", scale, y)
    return y


def step_rms_norm(g: G, x: str) -> str:
    g.desc.append("RMSNorm")
    return rms_norm(g, x, scale=g.num(0, 3) > 0)


def joint_attention(g: G, x: str, *, heads: int, d: int, norm: bool, spelling: str, parts: str,
                    softmax_axis: int = -1) -> str:
    """SD3's joint attention: x [B, S1, C] and a context [B, S2, C2] each projected to q, k, v, split into
    heads, Q and K normalized per head (SD3.5), the streams concatenated along the sequence, attention, heads
    merged and cut back into the streams (``parts``: both, the image only, or a cut that is not the streams')."""
    b, s1, c = g.shape[x]
    s2 = g.num(1, 6)
    ctx = g.input((b, s2, g.num(1, 12)), "ctx")
    s, cm = s1 + s2, heads * d

    def split(t: str, length: int) -> str:
        r = g.op("Reshape", [t, g.ints([b, -1, heads, d])], (b, length, heads, d))
        return g.op("Transpose", [r], (b, heads, length, d), perm=[0, 2, 1, 3])

    streams = {}
    for name, src, length in (("x", x, s1), ("c", ctx, s2)):
        hs = {t: split(_project(g, src, cm, keep_rank=True), length) for t in "qkv"}
        if norm:
            w = g.weight((d,), 0.3, "norm_w", offset=1.0)
            hs = {t: rms_norm(g, v, scale=w) if t in "qk" else v for t, v in hs.items()}
        streams[name] = hs
    qj, kj, vj = (g.op("Concat", [streams["x"][t], streams["c"][t]], (b, heads, s, d), axis=2) for t in "qkv")
    if spelling == "dynamo":
        f = g.op("Reshape", [kj, g.ints([-1, s, d])], (b * heads, s, d))
        ft = g.op("Transpose", [f], (b * heads, d, s), perm=[0, 2, 1])
        kt = g.op("Reshape", [ft, g.ints([b, heads, d, s])], (b, heads, d, s))
        sc = g.fconst(d ** -0.25, "scale")
        scores = g.op("MatMul", [g.bin("Mul", qj, sc), g.bin("Mul", kt, sc)], (b, heads, s, s))
    else:
        kt = g.op("Transpose", [kj], (b, heads, d, s), perm=[0, 1, 3, 2])
        scores = g.bin("Mul", g.op("MatMul", [qj, kt], (b, heads, s, s)), g.scalar(d ** -0.5, "scale"))
    o = g.op("MatMul", [g.op("Softmax", [scores], (b, heads, s, s), axis=softmax_axis), vj], (b, heads, s, d))
    merged = g.op("Reshape", [g.op("Transpose", [o], (b, s, heads, d), perm=[0, 2, 1, 3]), g.ints([b, s, cm])],
                  (b, s, cm))
    cut = s1 - 1 if parts == "misaligned" and s1 > 1 else s1

    def part(lo: int, hi: int) -> str:
        ends = hi if hi < s or g.flag() else 2**62
        return g.op("Slice", [merged, g.ints([lo]), g.ints([ends]), g.ints([1]), *([g.ints([1])] if g.flag() else [])],
                    (b, hi - lo, cm))

    image = part(0, cut)
    if parts != "image":
        g.output(_project(g, part(cut, s), g.num(1, 8)))
    return _project(g, image, c)


def step_joint_attention(g: G, x: str) -> str:
    p = {"heads": g.num(1, 3), "d": g.num(1, 6), "norm": g.num(0, 3) > 0,
         "spelling": g.pick(["dynamo", "plain"]), "parts": g.pick(["both", "both", "image"])}
    g.desc.append("JointAttention(" + ", ".join(f"{k}={v}" for k, v in p.items()) + ")")
    return joint_attention(g, x, **p)


def step_adaln_chunks(g: G, x: str) -> str:
    """AdaLayerNorm's conditioning: one projection of [B, K] chunked into parts (Split by num_outputs or by
    sizes), put back together (summed where they match, else concatenated in another order)."""
    b, k = g.shape[x]
    n_parts, width = g.num(2, 6), g.num(1, 8)
    sizes = [width] * n_parts if g.flag() else [g.num(1, 8) for _ in range(n_parts)]
    if g.flag():
        y = g.op("Gemm", [x, g.weight((sum(sizes), k)), *([g.weight((sum(sizes),), 0.1, "b")] if g.flag() else [])],
                 (b, sum(sizes)), transB=1)
    else:
        y = _project(g, x, sum(sizes), keep_rank=True)
    even = len(set(sizes)) == 1
    if even and g.flag():
        parts = g.op_n("Split", [y], [(b, w) for w in sizes], axis=g.pick([-1, 1]), num_outputs=n_parts)
    else:
        parts = g.op_n("Split", [y, g.ints(sizes, "sizes")], [(b, w) for w in sizes], axis=g.pick([-1, 1]))
    g.desc.append(f"AdaLNChunks({sizes})")
    if even:
        out = parts[0]
        for p in parts[1:]:
            out = g.op("Add", [out, p], (b, sizes[0]))
        return out
    return g.op("Concat", list(reversed(parts)), (b, sum(sizes)), axis=-1)


def step_upsample_block(g: G, x: str) -> str:
    b, c, h, w = g.shape[x]
    if b * c * 4 * h * w > MAX_ELEMS:
        return step_conv(g, x)
    up = g.op("Resize", [x, "", g.tensor(np.array([1, 1, 2, 2], np.float32), "scales")], (b, c, 2 * h, 2 * w),
              mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    g.desc.append("Upsample(Resize 2x, Conv3x3)")
    return _conv(g, up, ConvSpec(c, (3, 3), (1, 1), [1, 1, 1, 1], (1, 1), 1, (b, c, 2 * h, 2 * w)), bias=True)


def step_downsample_block(g: G, x: str) -> str:
    """The VAE encoder's downsampler: Pad right/bottom by one (TorchScript) or pads in the Conv (dynamo)."""
    b, c, h, w = g.shape[x]
    if min(h, w) < 2:
        return step_conv(g, x)
    out = (b, c, (h - 2) // 2 + 1, (w - 2) // 2 + 1)
    spec = ConvSpec(c, (3, 3), (2, 2), [0, 0, 1, 1], (1, 1), 1, out)
    if g.flag():
        p = g.op("Pad", [x, g.ints([0, 0, 0, 0, 0, 0, 1, 1], "pads")], (b, c, h + 1, w + 1), mode="constant")
        spec = ConvSpec(c, (3, 3), (2, 2), [0, 0, 0, 0], (1, 1), 1, out)
        g.desc.append("Downsample(Pad, Conv s2)")
        return _conv(g, p, spec, bias=True)
    g.desc.append("Downsample(Conv s2, pads)")
    return _conv(g, x, spec, bias=True)


# ---- near misses: must not fuse (or must fuse correctly) -------------------------------------------------------------

# ---- generality: rotary embeddings, modulation, streams, tables, Einsum ------------------------------------

def rotate(g: G, t: str, spelling: str) -> str:
    """The rotary embedding's rotation of the last axis, as diffusers writes it: rotate_half (cat(-x2, x1),
    halves by Slice or Split) or interleaved pairs (stack(-x_odd, x_even): a Reshape to [.., D/2, 2], the pairs
    cut by Slice or Split, negated, stacked and flattened)."""
    shape = g.shape[t]
    d = shape[-1]
    if spelling == "half":
        h = d // 2
        if g.flag():
            x1, x2 = g.op_n("Split", [t], [(*shape[:-1], h)] * 2, axis=-1, num_outputs=2)
        else:
            x1 = g.op("Slice", [t, g.ints([0]), g.ints([h]), g.ints([-1])], (*shape[:-1], h))
            x2 = g.op("Slice", [t, g.ints([h]), g.ints([2**62]), g.ints([-1])], (*shape[:-1], h))
        return g.op("Concat", [g.op("Neg", [x2], g.shape[x2]), x1], shape, axis=-1)
    pairs = (*shape[:-1], d // 2, 2)
    r = g.op("Reshape", [t, g.ints(list(pairs))], pairs)
    one = (*shape[:-1], d // 2, 1)
    if g.flag():
        even, odd = g.op_n("Split", [r], [one, one], axis=-1, num_outputs=2)
    else:
        even = g.op("Slice", [r, g.ints([0]), g.ints([1]), g.ints([-1])], one)
        odd = g.op("Slice", [r, g.ints([1]), g.ints([2]), g.ints([-1])], one)
    stacked = g.op("Concat", [g.op("Neg", [odd], one), even], pairs, axis=-1)
    return g.op("Reshape", [stacked, g.ints(list(shape))], shape)


def _tables(g: G, s: int, d: int, source: str) -> tuple[str, str]:
    """cos and sin [1, S, 1, D]: constants, graph inputs, or computed from position ids [S, A] as Flux writes
    them (per axis a Gather of the ids' column, float64 frequencies, Cos and Sin, repeat_interleave, the axes
    concatenated)."""
    if source == "constant":
        ang = g.rng.uniform(-3, 3, (1, s, 1, d))
        return g.fconst(np.cos(ang), "cos"), g.fconst(np.sin(ang), "sin")
    if source == "input":
        return g.input((1, s, 1, d), "cos"), g.input((1, s, 1, d), "sin")
    axes = [d // 2] if d % 4 else [d // 4, d // 4]
    ids = g.input((s, len(axes)), "ids")
    cos_parts, sin_parts = [], []
    for i, half in enumerate(axes):
        col = g.op("Gather", [ids, g.ints([i])], (s, 1), axis=1)
        col = g.op("Cast", [col], (s, 1), to=onnx.TensorProto.DOUBLE)
        g.types[col] = onnx.TensorProto.DOUBLE
        freqs = g.tensor((1.0 / 10000 ** (np.arange(half) / half)).reshape(1, half).astype(np.float64), "freqs")
        arg = g.op("Mul", [col, freqs], (s, half))
        g.types[arg] = onnx.TensorProto.DOUBLE
        for trig, parts in (("Cos", cos_parts), ("Sin", sin_parts)):
            t = g.op(trig, [arg], (s, half))
            g.types[t] = onnx.TensorProto.DOUBLE
            t = g.op("Reshape", [t, g.ints([s, half, 1])], (s, half, 1))
            t = g.op("Expand", [t, g.ints([s, half, 2])], (s, half, 2))
            t = g.op("Reshape", [t, g.ints([s, 2 * half])], (s, 2 * half))
            g.types[t] = onnx.TensorProto.DOUBLE
            for v in g.activations[-3:]:
                g.types[v] = onnx.TensorProto.DOUBLE
            parts.append(g.op("Cast", [t], (s, 2 * half), to=g.dtype))
    out = []
    for parts in (cos_parts, sin_parts):
        cat = g.op("Concat", parts, (s, d), axis=-1) if len(parts) > 1 else parts[0]
        out.append(g.op("Reshape", [cat, g.ints([1, s, 1, d])], (1, s, 1, d)))
    return out[0], out[1]


def step_rotary(g: G, x: str) -> str:
    """Rotary position embeddings on a projection's heads: x * cos + rotate(x) * sin, in [B, S, H, D] (Flux) or
    after the heads' transpose [B, H, S, D], the tables constant, graph inputs or computed from ids."""
    b, s, c = g.shape[x]
    heads, d = g.num(1, 3), 2 * g.num(1, 4)
    spelling, source = g.pick(["half", "pairs"]), g.pick(["constant", "input", "ids"])
    if source == "ids" and g.dtype != F32:
        source = "input"
    q = _project(g, x, heads * d, keep_rank=True)
    t = g.op("Reshape", [q, g.ints([b, s, heads, d])], (b, s, heads, d))
    cos, sin = _tables(g, s, d, source)
    moved = g.flag()
    if moved:  # the heads in front: the tables broadcast as [1, 1, S, D]
        t = g.op("Transpose", [t], (b, heads, s, d), perm=[0, 2, 1, 3])
        cos = g.op("Reshape", [cos, g.ints([1, 1, s, d])], (1, 1, s, d))
        sin = g.op("Reshape", [sin, g.ints([1, 1, s, d])], (1, 1, s, d))
    y = g.bin("Add", g.bin("Mul", t, cos), g.bin("Mul", rotate(g, t, spelling), sin))
    if moved:
        y = g.op("Transpose", [y], (b, s, heads, d), perm=[0, 2, 1, 3])
    g.desc.append(f"Rotary(heads={heads}, d={d}, {spelling}, tables {source}, heads first {moved})")
    return _project(g, g.op("Reshape", [y, g.ints([b, s, heads * d])], (b, s, heads * d)), c)


def step_rotary_products(g: G, x: str) -> str:
    """Rotary position embeddings written as the halves' products, with constant tables [1, S, 1, D/2] (or
    graph inputs: then the products stay): ``x1 c - x2 s`` and ``x1 s + x2 c`` joined (a Concat of the halves),
    stacked (interleaved: each viewed [.., D/2, 1], a Concat, a Reshape), or scattered as dynamo writes
    ``out[..., 0::2] = ...; out[..., 1::2] = ...`` (the last axis moved first, two ScatterNDs over zeros, moved
    back); the halves cut by Slice or Split, as the first and second halves or the even and odd elements."""
    b, s, c = g.shape[x]
    heads, d = g.num(1, 2), 2 * g.num(1, 4)
    h = d // 2
    q = _project(g, x, heads * d, keep_rank=True)
    t = g.op("Reshape", [q, g.ints([b, s, heads, d])], (b, s, heads, d))
    half = (b, s, heads, h)
    if g.flag():  # the first and second halves
        if g.flag():
            x1, x2 = g.op_n("Split", [t], [half] * 2, axis=-1, num_outputs=2)
        else:
            x1 = g.op("Slice", [t, g.ints([0]), g.ints([h]), g.ints([-1])], half)
            x2 = g.op("Slice", [t, g.ints([h]), g.ints([d]), g.ints([-1])], half)
    else:  # the even and odd elements, as a view [.., D/2, 2] cut and squeezed
        pairs = g.op("Reshape", [t, g.ints([b, s, heads, h, 2])], (b, s, heads, h, 2))
        cut = [g.op("Slice", [pairs, g.ints([k]), g.ints([k + 1]), g.ints([-1])], (*half, 1)) for k in (0, 1)]
        x1, x2 = (g.op("Reshape", [v, g.ints(list(half))], half) for v in cut)
    source = g.pick(["constant", "input"])
    if source == "constant":
        ang = g.rng.uniform(-3, 3, (1, s, 1, h))
        cos, sin = g.fconst(np.cos(ang), "cos"), g.fconst(np.sin(ang), "sin")
    else:
        cos, sin = g.input((1, s, 1, h), "cos"), g.input((1, s, 1, h), "sin")
    a = g.bin("Sub", g.bin("Mul", x1, cos), g.bin("Mul", x2, sin))
    r = g.bin("Add", g.bin("Mul", x1, sin), g.bin("Mul", x2, cos))
    form = g.pick(["joined", "stacked", "scattered"])
    full = (b, s, heads, d)
    if form == "joined":
        y = g.op("Concat", [a, r], full, axis=-1)
    elif form == "stacked":
        parts = [g.op("Reshape", [v, g.ints([*half, 1])], (*half, 1)) for v in (a, r)]
        y = g.op("Reshape", [g.op("Concat", parts, (*half, 2), axis=-1), g.ints(list(full))], full)
    else:
        moved = (h, s, heads, b)
        base = g.fconst(np.zeros((d, s, heads, b)), "zeros")
        for k, v in enumerate((a, r)):
            upd = g.op("Transpose", [v], moved, perm=[3, 1, 2, 0])
            base = g.op("ScatterND", [base, g.tensor(np.arange(k, d, 2, dtype=np.int64)[:, None], "rows"), upd],
                        (d, s, heads, b))
        y = g.op("Transpose", [base], full, perm=[3, 1, 2, 0])
    g.desc.append(f"RotaryProducts(heads={heads}, d={d}, {form}, tables {source})")
    return _project(g, g.op("Reshape", [y, g.ints([b, s, heads * d])], (b, s, heads * d)), c)


def nm_rotary_variants(g: G, x: str) -> str:
    """Near the rotation, but not a signed permutation of each row: the halves swapped along the sequence
    (mixing rows), or added (not one element each)."""
    b, s, c = g.shape[x]
    q = _project(g, x, 2 * (c // 2 + 1), keep_rank=True)
    d = 2 * (c // 2 + 1)
    kind = g.pick(["rows", "sum"])
    if kind == "rows" and s > 1:
        lo = g.op("Slice", [q, g.ints([0]), g.ints([1]), g.ints([1])], (b, 1, d))
        hi = g.op("Slice", [q, g.ints([1]), g.ints([s]), g.ints([1])], (b, s - 1, d))
        r = g.op("Concat", [g.op("Neg", [hi], g.shape[hi]), lo], (b, s, d), axis=1)
    else:
        h = d // 2
        x1 = g.op("Slice", [q, g.ints([0]), g.ints([h]), g.ints([-1])], (b, s, h))
        x2 = g.op("Slice", [q, g.ints([h]), g.ints([d]), g.ints([-1])], (b, s, h))
        r = g.op("Concat", [g.bin("Add", x1, x2), x1], (b, s, d), axis=-1)
    g.desc.append(f"near-miss: rotation {kind}")
    return _project(g, g.bin("Add", q, r), c)


def step_modulation(g: G, x: str) -> str:
    """AdaLN modulation: a conditioning vector's projection chunked into shift, scale and gate (through a view
    [B, n, C], a table added: PixArt's AdaLN-single; or a [B, 2C, 1, 1] view on an image: scale-shift
    resnets), then x * (1 + scale) + shift and gate * x."""
    shape = g.shape[x]
    b, c = shape[0], shape[1] if len(shape) == 4 else shape[-1]
    cond = g.input((b, g.num(1, 12)), "cond")
    n = g.pick([2, 3, 6])
    y = _project(g, cond, n * c, keep_rank=True)
    if len(shape) == 4:  # [B, nC, 1, 1], chunked along the channels
        y = g.op("Reshape", [y, g.ints([b, n * c, 1, 1])], (b, n * c, 1, 1))
        parts = g.op_n("Split", [y], [(b, c, 1, 1)] * n, axis=1, num_outputs=n)
    else:
        y = g.op("Reshape", [y, g.ints([b, n, c])], (b, n, c))
        if g.flag():
            y = g.bin("Add", g.weight((1, n, c), 0.3, "table"), y)
        if g.flag():
            parts = g.op_n("Split", [y], [(b, 1, c)] * n, axis=1, num_outputs=n)
        else:
            parts = [g.op("Slice", [y, g.ints([i]), g.ints([i + 1]), g.ints([1])], (b, 1, c)) for i in range(n)]
    shift, scale = parts[0], parts[1]
    out = g.bin("Add", g.bin("Mul", x, g.bin("Add", g.scalar(1.0, "one"), scale)), shift)
    if n > 2:
        out = g.bin("Add", x, g.bin("Mul", parts[2], out))
    g.desc.append(f"Modulation(n={n}, rank {len(shape)})")
    return out


def step_table_rows(g: G, x: str) -> str:
    """A modulation table computed once for every block and read a few rows at a time (Chroma's
    approximator): a [B, R, C] table from rows of a conditioning input (a Linear, now and then SiLU and a
    second Linear), each block's rows taken by a Slice (negative starts too), by a Slice -> Reshape [B, nC] ->
    Split(n) -> [B, 1, C] (the chunked flatten), or by one Split of the whole table; then x * (1 + scale) +
    shift per block. Near misses in the same draw: two blocks reading overlapping rows, a Slice with step 2,
    a row also read by a graph output."""
    b, _, c = g.shape[x]
    blocks, n = g.num(1, 3), g.pick([2, 3])
    rows = blocks * n + g.num(0, 2)
    t = _project(g, g.input((b, rows, g.num(1, 8)), "cond"), c, keep_rank=True)
    if g.flag():
        t = _project(g, _silu(g, t), c, keep_rank=True)
    kind = g.pick(["slice", "flatten_split", "split", "overlap", "step2"])
    x = _project(g, x, c, keep_rank=True)  # a layer's output, as in a block (a graph input stays on the CPU)
    spans = [(i * n, (i + 1) * n) for i in range(blocks)]
    if kind == "overlap" and blocks > 1:
        spans[1] = (spans[1][0] - 1, spans[1][1] - 1)
    parts: list[list[str]] = []
    if kind == "split":
        tail = rows - blocks * n
        outs = g.op_n("Split", [t, g.ints([1] * (blocks * n) + ([tail] if tail else []), "sizes")],
                      [(b, 1, c)] * (blocks * n) + ([(b, tail, c)] if tail else []), axis=1)
        parts = [outs[i * n:(i + 1) * n] for i in range(blocks)]
    for lo, hi in spans if kind != "split" else ():
        if kind == "overlap":  # the block's rows read whole: [B, n, C] -> [B, 1, nC] -> a Linear to shift, scale
            sl = g.op("Slice", [t, g.ints([lo]), g.ints([hi]), g.ints([1])], (b, n, c))
            flat = g.op("Reshape", [sl, g.ints([b, 1, n * c])], (b, 1, n * c))
            parts.append([_project(g, flat, c, keep_rank=True), _project(g, flat, c, keep_rank=True)])
        elif kind == "flatten_split":
            sl = g.op("Slice", [t, g.ints([lo]), g.ints([hi]), g.ints([1])], (b, n, c))
            flat = g.op("Reshape", [sl, g.ints([b, n * c])], (b, n * c))
            chunks = g.op_n("Split", [flat], [(b, c)] * n, axis=1, num_outputs=n)
            parts.append([g.op("Unsqueeze", [ch, g.ints([1], "axes")], (b, 1, c)) for ch in chunks])
        else:
            step = 2 if kind == "step2" else 1
            one = []
            for i in range(lo, hi):
                start = i - rows if g.flag() else i
                end = i + step if step == 1 else i + 1
                one.append(g.op("Slice", [t, g.ints([start]), g.ints([end]), g.ints([1]), g.ints([step])],
                                (b, 1, c)))
            parts.append(one)
    out = x
    for block in parts:
        shift, scale = block[0], block[1]
        out = g.bin("Add", g.bin("Mul", out, g.bin("Add", g.scalar(1.0, "one"), scale)), shift)
    if g.num(0, 3) == 0:
        g.output(parts[0][0])
        g.desc.append("a row is also an output")
    g.desc.append(f"TableRows({kind}, {blocks} blocks of {n} of {rows} rows)")
    return out


def step_streams(g: G, x: str) -> str:
    """Two streams joined along the sequence for attention and cut back (Flux, AuraFlow): the context's and
    x's rows concatenated, normed and projected row by row, attention over the joint keys, the result cut
    into the streams by Split or Slices (or only x's rows kept, as Flux's last block keeps the image)."""
    b, s1, c = g.shape[x]
    s2 = g.num(1, 6)
    ctx = _project(g, g.input((b, s2, g.num(1, 12)), "ctx"), c, keep_rank=True)
    j = g.op("Concat", [ctx, x], (b, s1 + s2, c), axis=1)
    if g.flag():
        j = g.op("LayerNormalization", [j, g.weight((c,), 0.1, "ln", offset=1.0)], (b, s1 + s2, c), axis=-1)
    heads = g.pick([h for h in (1, 2, 3) if c % h == 0] or [1])
    a = attention(g, j, heads=heads, d=max(c // heads, 1), cross=False, spelling=g.pick(["dynamo", "plain"]),
                  causal=False) if c % heads == 0 else j
    a = _project(g, a, c, keep_rank=True) if g.shape[a][-1] != c else a
    y = g.bin("Add", j, a)
    kind = g.pick(["split", "slices", "last"])
    if kind == "split":
        txt, img = g.op_n("Split", [y, g.ints([s2, s1], "sizes")], [(b, s2, c), (b, s1, c)], axis=1)
        g.output(_project(g, txt, c))
    elif kind == "slices":
        txt = g.op("Slice", [y, g.ints([0]), g.ints([s2]), g.ints([1])], (b, s2, c))
        img = g.op("Slice", [y, g.ints([s2]), g.ints([s1 + s2]), g.ints([1])], (b, s1, c))
        g.output(_project(g, txt, c))
    else:
        img = g.op("Slice", [y, g.ints([s2]), g.ints([2**62]), g.ints([1])], (b, s1, c))
    g.desc.append(f"Streams(s1={s1}, s2={s2}, cut {kind})")
    return img


def _boolean(g: G, name: str) -> str:
    """Mark ``name`` (an op's output) a bool value: not a float activation, never a graph output."""
    g.types[name] = onnx.TensorProto.BOOL
    g.activations.remove(name)
    return name


def step_grouped_attention(g: G, x: str) -> str:
    """Grouped-query attention as TorchScript writes Lumina 2's: q in H heads, k and v in H / r heads each
    repeated r times (Unsqueeze, Tile, Reshape: repeat_interleave of the heads), the scores scaled, then a mask
    added: none; zeros of [B, 1, 1, S] (no mask at all); a constant padding row (-inf on some keys of some batch
    rows, never all); one row per batch computed from an input (a Where of a comparison: a query may lose every
    key; both ride in Q and K as a channel), or that row an input itself; and near misses, a constant row that
    masks every key of a batch row (the guard then acts), a guard whose other branch is not 0, a computed mask
    that varies per query (no key row: the CPU's MultiHeadAttention). Softmax, the NaN guard
    Where(IsNaN(p), 0, p) or not, the product with v, the heads merged."""
    b, s_, c = g.shape[x]
    hkv, r, d = g.pick([1, 2]), g.pick([2, 3]), g.pick([2, 4])
    heads = hkv * r
    mask = g.pick(["none", "zeros", "padding", "computed", "all_masked", "guard_not_zero", "per_query", "input_row"])
    guard = mask in ("computed", "all_masked", "guard_not_zero", "per_query", "input_row") or g.flag()
    q, k, v = _project(g, x, heads * d), _project(g, x, hkv * d), _project(g, x, hkv * d)
    qh = g.op("Transpose", [g.op("Reshape", [q, g.ints([b, s_, heads, d])], (b, s_, heads, d))], (b, heads, s_, d),
              perm=[0, 2, 1, 3])

    def repeated(t: str) -> str:
        t4 = g.op("Reshape", [t, g.ints([b, s_, hkv, d])], (b, s_, hkv, d))
        u = g.op("Unsqueeze", [t4, g.ints([3], "axes")], (b, s_, hkv, 1, d))
        tiled = g.op("Tile", [u, g.ints([1, 1, 1, r, 1], "repeats")], (b, s_, hkv, r, d))
        return g.op("Reshape", [tiled, g.ints([b, s_, heads, d])], (b, s_, heads, d))

    kh = g.op("Transpose", [repeated(k)], (b, heads, d, s_), perm=[0, 2, 3, 1])
    vh = g.op("Transpose", [repeated(v)], (b, heads, s_, d), perm=[0, 2, 1, 3])
    scores = g.bin("Mul", g.op("MatMul", [qh, kh], (b, heads, s_, s_)), g.scalar(d ** -0.5, "scale"))
    if mask in ("zeros", "padding", "all_masked"):
        m = np.zeros((b, 1, 1, s_))
        if mask == "padding" and s_ > 1:
            m[g.num(0, b - 1), 0, 0, g.num(1, s_ - 1):] = -np.inf
        elif mask == "all_masked":
            m[g.num(0, b - 1)] = -np.inf
        scores = g.bin("Add", scores, g.fconst(m, "mask"))
    elif mask in ("computed", "per_query"):
        rows = s_ if mask == "per_query" else 1
        keep = _boolean(g, g.op("Greater", [g.input((b, rows * s_), "keep"), g.scalar(-0.5)], (b, rows * s_)))
        keep = _boolean(g, g.op("Reshape", [keep, g.ints([b, 1, rows, s_])], (b, 1, rows, s_)))
        bias = g.op("Where", [keep, g.scalar(0.0), g.scalar(-np.inf)], (b, 1, rows, s_))
        scores = g.bin("Add", scores, bias)
    elif mask == "input_row":  # the row itself an input: its values unknown (raised to the channel's floor)
        scores = g.bin("Add", scores, g.input((b, 1, 1, s_), "key_bias"))
    probs = g.op("Softmax", [scores], (b, heads, s_, s_), axis=-1)
    if guard:
        isnan = _boolean(g, g.op("IsNaN", [probs], (b, heads, s_, s_)))
        probs = g.op("Where", [isnan, g.scalar(0.5 if mask == "guard_not_zero" else 0.0), probs], (b, heads, s_, s_))
    o = g.op("Transpose", [g.op("MatMul", [probs, vh], (b, heads, s_, d))], (b, s_, heads, d), perm=[0, 2, 1, 3])
    y = g.op("Reshape", [o, g.ints([b, s_, heads * d])], (b, s_, heads * d))
    g.desc.append(f"GroupedAttention(heads={heads}, kv={hkv}, d={d}, mask={mask}, guard={guard})")
    return _project(g, y, c, keep_rank=True)


def step_decoder_attention(g: G, x: str) -> str:
    """A decoder-only text encoder's attention as transformers writes Llama's, Qwen2's and Qwen3's: q, k, v split
    into heads and transposed to [B, H, S, D] first, the rotary on q and k there (cos / sin [1, 1, S, D] or
    [S, D], rotate_half or pairs), k's and v's H / r heads repeated r times (Reshape, Expand, Reshape:
    ``repeat_kv``), the scores scaled, a causal mask (constant, or computed from an input keep-mask [B, S] and
    expanded to [B, 1, S, S] before the Add), Softmax, the product with v, the heads merged. Near misses: q's
    heads also read by another op (its Transpose stays for it), the repeat's reader not merging the heads."""
    b, s_, c = g.shape[x]
    hkv, r, d = g.pick([1, 2]), g.pick([1, 2, 3]), 2 * g.num(1, 3)
    heads = hkv * r
    mask, miss = g.pick(["causal", "computed"]), g.pick(["none", "none", "none", "q_escapes"])
    spelling, rank2 = g.pick(["half", "pairs"]), g.flag()
    q, k, v = (_project(g, x, n * d) for n in (heads, hkv, hkv))

    def split(t: str, n: int) -> str:
        r4 = g.op("Reshape", [t, g.ints([b, s_, n, d])], (b, s_, n, d))
        return g.op("Transpose", [r4], (b, n, s_, d), perm=[0, 2, 1, 3])

    ang = g.rng.uniform(-3, 3, (s_, d) if rank2 else (1, 1, s_, d))
    cos, sin = g.fconst(np.cos(ang), "cos"), g.fconst(np.sin(ang), "sin")

    def roped(t: str) -> str:
        return g.bin("Add", g.bin("Mul", t, cos), g.bin("Mul", rotate(g, t, spelling), sin))

    def repeated(t: str) -> str:
        if r == 1:
            return t
        u = g.op("Reshape", [t, g.ints([b, hkv, 1, s_, d])], (b, hkv, 1, s_, d))
        e = g.op("Expand", [u, g.ints([b, hkv, r, s_, d])], (b, hkv, r, s_, d))
        return g.op("Reshape", [e, g.ints([b, heads, s_, d])], (b, heads, s_, d))

    qh = split(q, heads)
    if miss == "q_escapes":
        g.output(g.op("Sigmoid", [qh], g.shape[qh]))
    qr = roped(qh)
    kh = repeated(roped(split(k, hkv)))
    vh = repeated(split(v, hkv))
    kt = g.op("Transpose", [kh], (b, heads, d, s_), perm=[0, 1, 3, 2])
    scores = g.bin("Mul", g.op("MatMul", [qr, kt], (b, heads, s_, s_)), g.scalar(d ** -0.5, "scale"))
    causal = np.where(np.triu(np.ones((s_, s_), bool), 1), float(np.finfo(g.np_dtype).min), 0.0)
    if mask == "causal":
        bias = g.fconst(causal.reshape(1, 1, s_, s_), "mask")
    else:  # transformers' sdpa / eager mask: causal and padding merged from a keep-mask input, then expanded
        keep = _boolean(g, g.op("Greater", [g.input((b, s_), "keep"), g.scalar(-0.5)], (b, s_)))
        keep = _boolean(g, g.op("Reshape", [keep, g.ints([b, 1, 1, s_])], (b, 1, 1, s_)))
        below = g.tensor(np.tril(np.ones((1, 1, s_, s_), bool)), "below")
        g.types[below] = onnx.TensorProto.BOOL
        both = _boolean(g, g.op("And", [keep, below], (b, 1, s_, s_)))
        wide = _boolean(g, g.op("Expand", [both, g.ints([b, 1, s_, s_])], (b, 1, s_, s_)))
        bias = g.op("Where", [wide, g.scalar(0.0), g.scalar(float(np.finfo(g.np_dtype).min))], (b, 1, s_, s_))
    scores = g.bin("Add", scores, bias)
    probs = g.op("Softmax", [scores], (b, heads, s_, s_), axis=-1)
    o = g.op("Transpose", [g.op("MatMul", [probs, vh], (b, heads, s_, d))], (b, s_, heads, d), perm=[0, 2, 1, 3])
    y = g.op("Reshape", [o, g.ints([b, s_, heads * d])], (b, s_, heads * d))
    g.desc.append(f"DecoderAttention(heads={heads}, kv={hkv}, d={d}, mask={mask}, {spelling}, tables rank "
                  f"{2 if rank2 else 4}, {miss})")
    return _project(g, y, c, keep_rank=True)


def step_unrolled_loops(g: G, x: str) -> str:
    """A module's per-item loops as an exporter unrolls them (Lumina 2's): a sequence assembled by ScatterND
    row blocks into zeros, item by item (Gather, Slice, Reshape, ScatterND), and an unpatchify run per item
    (Gather, Slice, Reshape, Transpose, Reshape, Unsqueeze) then stacked by a Concat on axis 0. Near misses: a
    block left unwritten (the zeros show), the items stacked out of order, one item's chain another."""
    b, s_, c = g.shape[x]
    miss = g.pick(["none", "none", "none", "unwritten", "out_of_order", "other_chain"])
    extra = g.num(1, 3)
    y = _project(g, x, c, keep_rank=True)
    ctx = _project(g, x, c, keep_rank=True)  # a second stream of the same tokens
    total = 2 * s_ if miss != "unwritten" else 2 * s_ + extra
    joint = g.fconst(np.zeros((b, total, c)), "zeros")
    for i in range(b):
        for part, start in ((ctx, 0), (y, s_)):
            item = g.op("Gather", [part, g.tensor(np.asarray(i, np.int64), "item")],
                        (s_, c), axis=0)
            item = g.op("Slice", [item, g.ints([0]), g.ints([s_]), g.ints([0])], (s_, c))
            item = g.op("Reshape", [item, g.ints([1, s_, c])], (1, s_, c))
            idx = np.stack(np.meshgrid([i], np.arange(start, start + s_), indexing="ij"), -1).astype(np.int64)
            joint = g.op("ScatterND", [joint, g.tensor(idx, "rows"), item], (b, total, c))
    joint = _project(g, joint, c, keep_rank=True)
    order = list(range(b))
    if miss == "out_of_order" and b > 1:
        order.reverse()
    items = []
    for n, i in enumerate(order):
        item = g.op("Gather", [joint, g.tensor(np.asarray(i, np.int64), "item")], (total, c), axis=0)
        item = g.op("Slice", [item, g.ints([s_]), g.ints([2 * s_]), g.ints([0])], (s_, c))
        if miss == "other_chain" and n == len(order) - 1:
            item = g.op("Transpose", [g.op("Reshape", [item, g.ints([s_, c, 1])], (s_, c, 1))], (1, c, s_),
                        perm=[2, 1, 0])
        else:
            item = g.op("Transpose", [g.op("Reshape", [item, g.ints([s_, 1, c])], (s_, 1, c))], (1, c, s_),
                        perm=[1, 2, 0])
        items.append(g.op("Unsqueeze", [item, g.ints([0], "axes")], (1, 1, c, s_)))
    out = g.op("Concat", items, (b, 1, c, s_), axis=0)
    g.desc.append(f"UnrolledLoops(b={b}, miss={miss})")
    return _project(g, g.op("Reshape", [out, g.ints([b, c, s_])], (b, c, s_)), s_, keep_rank=True)


def step_gates(g: G, x: str) -> str:
    """Z-Image's and Lumina 2's gates: several projections of one conditioning vector, each through the same
    op the registry lacks (tanh; now and then sigmoid), each gating x. Near misses in the same draw: a gate's
    projection also read by another op, one gate through another op, a gate from another input."""
    b, s_, c = g.shape[x]
    cond = _silu(g, _project(g, g.input((b, 1, g.num(1, 8)), "cond"), g.num(2, 12), keep_rank=True))
    x = _project(g, x, c, keep_rank=True)
    op = g.pick(["Tanh", "Tanh", "Sigmoid"])
    miss = g.pick(["none", "none", "shared", "other_op", "other_input"])
    out = x
    for i in range(g.num(2, 4)):
        src = cond if not (miss == "other_input" and i == 0) else _project(g, g.input((b, 1, 3), "cond2"), 4,
                                                                                keep_rank=True)
        pre = _project(g, src, c, bias=True, keep_rank=True)
        gate = g.op("Sigmoid" if miss == "other_op" and i == 0 else op, [pre], g.shape[pre])
        if miss == "shared" and i == 0:
            out = g.bin("Add", out, pre)
        out = g.bin("Add", out, g.bin("Mul", gate, x))
    g.desc.append(f"Gates({op}, {miss})")
    return out


def step_pad_tokens(g: G, x: str) -> str:
    """Z-Image's and Lumina 2's token padding after a layer, as torch.export writes it: Where(mask, pad_token,
    x) with a constant mask (nothing padded, or some rows; now and then the token on the other side), a Split
    into one part, a Pad of zeros, a select_scatter into a new tensor of one row (ScatterElements), then
    Gather of that row; each present or not. Near misses: a Pad that pads, a scatter that writes half."""
    b, s_, c = g.shape[x]
    y = _project(g, x, c, keep_rank=True)
    y = g.op("Reshape", [y, g.ints([b * s_, c])], (b * s_, c))
    rows = b * s_
    kind = g.pick(["none", "some", "some", "all"])
    mask = np.zeros((rows, 1), bool)
    if kind == "some":
        mask[g.num(0, rows - 1):] = True
    elif kind == "all":
        mask[:] = True
    token = g.weight((1, c), 0.5, "pad_token")
    cond = g.tensor(mask, "mask")
    y = g.op("Where", [cond, token, y] if g.flag() else [cond, y, token], (rows, c))  # either side the token
    if g.flag():
        y = g.op_n("Split", [y, g.ints([rows], "sizes")], [(rows, c)], axis=0)[0]
    pad = g.pick(["zero", "zero", "real"])
    if pad == "real":
        y = g.op("Pad", [y, g.ints([0, 0, 1, 0], "pads")], (rows + 1, c))
        y = g.op("Slice", [y, g.ints([0]), g.ints([rows]), g.ints([0])], (rows, c))
    elif g.flag():
        y = g.op("Pad", [y, g.ints([0, 0, 0, 0], "pads")], (rows, c))
    y = g.op("Reshape", [y, g.ints([1, rows, c])], (1, rows, c))
    if g.flag():
        half = g.flag() and rows > 1
        idx = np.zeros((1, rows, c), np.int64)
        data = g.fconst(np.zeros((2 if half else 1, rows, c)), "new_full")
        y = g.op("ScatterElements", [data, g.tensor(idx, "idx"), y], (2 if half else 1, rows, c), axis=0)
        y = g.op("Gather", [y, g.ints([0], "row")], (1, rows, c), axis=0)
    y = g.op("Reshape", [y, g.ints([b, s_, c])], (b, s_, c))
    g.desc.append(f"PadTokens({kind}, pad {pad})")
    return _project(g, g.bin("Add", y, x), c, keep_rank=True)


def step_size_conditions(g: G, x: str) -> str:
    """CogView4's (and SDXL-style) size conditions: several [N, k] inputs, each flattened to a column [N k, 1]
    (in one Reshape or two), times a row of frequencies plus a phase, Sin, viewed back as [N, k F] and
    concatenated, then a Linear, added to x. Near misses in the same draw: one chain with other frequencies,
    a chain's intermediate read by another op."""
    b, s_, c = g.shape[x]
    f = g.pick([2, 4, 8])
    freqs, phase = g.fconst(np.linspace(0.1, 1.0, f).reshape(1, f), "freqs"), g.fconst(np.full((1, f), 0.5), "phase")
    miss = g.pick(["none", "none", "other_freqs", "shared"])
    parts, total = [], 0
    for i in range(g.num(2, 3)):
        k = g.num(1, 3)
        xi = g.input((b, k), "cond")
        if g.flag():
            xi = g.op("Reshape", [xi, g.ints([b * k])], (b * k,))
        col = g.op("Reshape", [xi, g.ints([b * k, 1])], (b * k, 1))
        fr = g.fconst(np.linspace(0.2, 2.0, f).reshape(1, f), "freqs") if miss == "other_freqs" and i == 1 else freqs
        m = g.bin("Mul", col, fr)
        a = g.bin("Add", m, phase)
        if miss == "shared" and i == 0:
            g.output(a)
        parts.append(g.op("Reshape", [g.op("Sin", [a], (b * k, f)), g.ints([b, k * f])], (b, k * f)))
        total += k * f
    cat = g.op("Concat", parts, (b, total), axis=1)
    emb = _project(g, cat, c, keep_rank=True)
    emb = g.op("Reshape", [emb, g.ints([b, 1, c])], (b, 1, c))
    g.desc.append(f"SizeConditions({len(parts)}, {miss})")
    return g.bin("Add", _project(g, x, c, keep_rank=True), emb)


def step_einsum(g: G, x: str) -> str:
    """Einsum as DiTs write it: the unpatchify's permutation, a batched product with a weight or between two
    activations."""
    shape = g.shape[x]
    b, s, c = shape
    kind = g.pick(["permute", "weight", "pair"])
    if kind == "permute":
        y = g.op("Einsum", [x], (c, b, s), equation="bsc->cbs")
        return g.op("Einsum", [y], (b, s, c), equation="cbs->bsc")
    if kind == "weight":
        n = g.num(1, 8)
        return g.op("Einsum", [x, g.weight((c, n))], (b, s, n), equation="bsc,cn->bsn")
    other = _project(g, x, c, keep_rank=True)
    scores = g.op("Einsum", [x, other], (b, s, s), equation="bic,bjc->bij")
    return g.op("Einsum", [scores, x], (b, s, c), equation="bij,bjc->bic")


def nm_silu_sigmoid_shared(g: G, x: str) -> str:
    s = g.op("Sigmoid", [x], g.shape[x])
    y = g.op("Mul", [x, s], g.shape[x])
    if g.flag():
        g.output(s)
        g.desc.append("near-miss: SiLU whose Sigmoid is also a graph output")
        return y
    g.desc.append("near-miss: SiLU whose Sigmoid is also read by an Add")
    return g.op("Add", [y, s], g.shape[x])


def nm_conv_preactivation_used(g: G, x: str) -> str:
    spec = _conv_spec(g, g.shape[x])
    y = _conv(g, x, spec)
    a = _silu(g, y)
    g.desc.append("near-miss: Conv+SiLU whose pre-activation is also used")
    if g.flag():
        g.output(y)
        return a
    return g.op("Add", [a, y], g.shape[y])


def nm_conv_weight_input(g: G, x: str) -> str:
    spec = _conv_spec(g, g.shape[x])
    c = g.shape[x][1]
    which = g.pick(["weight", "bias"])
    w = g.input((spec.oc, c // spec.group, *spec.kernel), "w") if which == "weight" else None
    bias = g.input((spec.oc,), "b") if which == "bias" else None
    g.desc.append(f"near-miss: Conv with its {which} a graph input")
    return _conv(g, x, spec, weight=w, bias=bias)


def nm_conv_auto_pad(g: G, x: str) -> str:
    b, _, h, w = g.shape[x]
    mode = g.pick(["SAME_UPPER", "SAME_LOWER", "VALID"])
    k, s = g.pick([1, 2, 3]), g.num(1, 2)
    if mode == "VALID":
        k = min(k, h, w)
        out = (b, 4, (h - k) // s + 1, (w - k) // s + 1)
    else:
        out = (b, 4, -(-h // s), -(-w // s))
    spec = ConvSpec(4, (k, k), (s, s), [0, 0, 0, 0], (1, 1), 1, out)
    g.desc.append(f"near-miss: Conv auto_pad={mode} k={k} s={s}")
    return _conv(g, x, spec, auto_pad=mode)


def nm_conv_beyond_limits(g: G, x: str) -> str:
    b, _, h, w = g.shape[x]
    if g.flag():
        k = g.pick([8, 9])
        spec = ConvSpec(2, (k, k), (1, 1), [k // 2] * 4, (1, 1), 1, (b, 2, h + 2 * (k // 2) - k + 1,
                                                                        w + 2 * (k // 2) - k + 1))
        g.desc.append(f"near-miss: Conv kernel {k}x{k} (above the NPU's 7)")
    else:
        s = g.pick([5, 6])
        spec = ConvSpec(2, (1, 1), (s, s), [0, 0, 0, 0], (1, 1), 1, (b, 2, (h - 1) // s + 1, (w - 1) // s + 1))
        g.desc.append(f"near-miss: Conv stride {s} (above the NPU's 4)")
    return _conv(g, x, spec)


def nm_pad_conv(g: G, x: str) -> str:
    """A Pad in front of a Conv that must not become the Conv's pads: non-zero value, reflect, or a crop."""
    b, c, h, w = g.shape[x]
    kind = g.pick(["value", "reflect", "crop"] if min(h, w) >= 3 else ["value"])
    if kind == "crop":
        pads = [0, 0, -1, 0, 0, 0, 0, -1]
    else:
        pads = [0, 0, 1, 1, 0, 0, 1, 1]
    padded = (b, c, h + pads[2] + pads[6], w + pads[3] + pads[7])
    ins = [x, g.ints(pads, "pads")]
    if kind == "value":
        ins.append(g.fconst(0.5))
    p = g.op("Pad", ins, padded, mode="reflect" if kind == "reflect" else "constant")
    spec = ConvSpec(3, (3, 3), (1, 1), [0, 0, 0, 0], (1, 1), 1, (b, 3, padded[2] - 2, padded[3] - 2))
    if min(padded[2:]) < 3:
        spec = ConvSpec(3, (1, 1), (1, 1), [0, 0, 0, 0], (1, 1), 1, (b, 3, *padded[2:]))
    g.desc.append(f"near-miss: Pad({kind}) before a Conv")
    return _conv(g, p, spec)


def nm_matmul_weight_input(g: G, x: str) -> str:
    shape = g.shape[x]
    n = g.num(1, 16)
    w = g.input((shape[-1], n), "w")
    y = g.op("MatMul", [x, w], (*shape[:-1], n))
    g.desc.append("near-miss: MatMul whose weight is a graph input (+ bias)")
    return g.op("Add", [y, g.weight((n,), 0.1, "b")], g.shape[y])


def nm_matmul_used_twice(g: G, x: str) -> str:
    shape = g.shape[x]
    n = g.num(1, 16)
    y = g.op("MatMul", [x, g.weight((shape[-1], n))], (*shape[:-1], n))
    z = g.op("Add", [y, g.weight((n,), 0.1, "b")], g.shape[y])
    g.desc.append("near-miss: MatMul output read by its bias Add and by another node")
    return g.op("Mul", [z, y], g.shape[y])


def nm_gemm_attributes(g: G, x: str) -> str:
    b, k = g.shape[x]
    n = g.num(1, 16)
    kind = g.pick(["transA", "alpha", "beta"])
    attrs: dict[str, Any] = {}
    a = x
    if kind == "transA":
        a = g.op("Transpose", [x], (k, b), perm=[1, 0])
        attrs["transA"] = 1
    elif kind == "alpha":
        attrs["alpha"] = g.pick([0.5, 2.0])
    else:
        attrs["beta"] = g.pick([0.5, 2.0])
    g.desc.append(f"near-miss: Gemm with {kind}")
    return g.op("Gemm", [a, g.weight((k, n)), g.weight((n,), 0.1, "b")], (b, n), **attrs)


def nm_resize_unsupported(g: G, x: str) -> str:
    b, c, h, w = g.shape[x]
    kind = g.pick(["linear", "cubic", "fractional", "down", "channels"])
    mode = kind if kind in ("linear", "cubic") else "nearest"
    scales = {"linear": [1, 1, 2, 2], "cubic": [1, 1, 2, 2], "fractional": [1, 1, 1.5, 1.5],
              "down": [1, 1, 0.5, 0.5], "channels": [1, 2, 2, 2]}[kind]
    out = (b, int(c * scales[1]), int(h * scales[2]), int(w * scales[3]))
    if min(out) < 1 or _size(out) > MAX_ELEMS:
        return step_sigmoid(g, x)
    g.desc.append(f"near-miss: Resize {kind} ({mode}, scales {scales})")
    return g.op("Resize", [x, "", g.tensor(np.array(scales, np.float32), "scales")], out, mode=mode,
                coordinate_transformation_mode=g.pick(["asymmetric", "half_pixel"]), nearest_mode="floor")


def nm_group_norm_variants(g: G, x: str) -> str:
    shape = g.shape[x]
    c = shape[1]
    kind = g.pick(["affine_full", "affine_scalar", "instance_scale", "escapes_in", "escapes_reshape",
                   "gamma_input", "reshape_back_differs"])
    groups = g.pick(_divisors(c))
    kw: dict[str, Any] = {}
    if kind == "affine_full":
        kw["gamma"] = g.weight(shape[1:], 0.3, "gamma", offset=1.0)
    elif kind == "affine_scalar":
        kw["gamma"] = g.fconst(1.5)
    elif kind == "instance_scale":
        kw["inorm_scale"] = 2.0
    elif kind == "escapes_in":
        kw["escape"] = "instance_norm"
    elif kind == "escapes_reshape":
        kw["escape"] = "reshape"
    elif kind == "gamma_input":
        kw["gamma"] = g.input((c,) + (1,) * (len(shape) - 2), "gamma")
    elif len(shape) == 4 and shape[2] != shape[3]:
        kw["back_shape"] = (shape[0], c, shape[3], shape[2])
    g.desc.append(f"near-miss: GroupNorm {kind}")
    return group_norm(g, x, groups=groups, eps=1e-5, silu=g.flag(), **kw)


def nm_norm_reductions(g: G, x: str) -> str:
    """An L2 norm over an axis that is neither the last nor the channels, over two axes, with an eps outside
    the root far from negligible (0.1, 0.5), or of another tensor than the one reduced."""
    shape = g.shape[x]
    kinds = ["two_axes", "eps_outside", "other_numerator"] + (["middle_axis"] if len(shape) == 4 else [])
    kind = g.pick(kinds)
    p = {"root": g.pick(["ReduceL2", "ReduceMean"]), "clamp": g.pick(["Clip", "Add"]), "eps": 1e-12,
         "expand": g.flag(), "divide": True, "sqrt_d": False}
    axes = [-1]
    numerator = None
    if kind == "middle_axis":
        axes = [2]
    elif kind == "two_axes":
        axes = g.pick([[1, 2], [-2, -1]]) if len(shape) >= 3 else [-2, -1]
    elif kind == "eps_outside":
        p["eps"] = g.pick([0.1, 0.5])
    else:
        numerator = g.op("Mul", [x, g.weight(shape[-1:], 0.3, "k", offset=1.0)], shape)
    if _size([shape[a] for a in axes]) == 1:  # one value: x / |x| is its sign, ill-conditioned at 0
        p["eps"] = 0.5
    g.desc.append(f"near-miss: L2Norm {kind} (axes={axes}, {p})")
    return l2_norm(g, x, axes=axes, numerator=numerator, **p)


def nm_layer_norm_variants(g: G, x: str) -> str:
    shape = g.shape[x]
    kinds = ["stats_used", "gamma_input"] + (["axis"] if len(shape) >= 3 else [])
    kind = g.pick(kinds)
    axis = -1
    if kind == "axis":
        axis = g.pick([1, -2])
    norm_shape = shape[axis % len(shape):]
    gamma = g.input(norm_shape, "gamma") if kind == "gamma_input" else g.weight(norm_shape, 0.3, "gamma", offset=1.0)
    ins = [x, gamma, g.weight(norm_shape, 0.3, "beta")]
    g.desc.append(f"near-miss: LayerNormalization {kind}")
    if kind == "stats_used":
        stat = (*shape[:-1], 1)
        y, mean, inv = g.op_n("LayerNormalization", ins, [shape, stat, stat], axis=-1, epsilon=1e-5)
        g.types[mean] = g.types[inv] = F32  # stash_type: the statistics are fp32 whatever the input
        g.output(g.pick([mean, inv]))
        return y
    return g.op("LayerNormalization", ins, shape, axis=axis, epsilon=1e-5)


def nm_mmdit_variants(g: G, x: str) -> str:
    """An RMSNorm over another axis or scaled per row, a joint attention cut where the streams do not meet or
    normalized over the queries, a projection chunked along the batch."""
    shape = g.shape[x]
    joint = ["joint_misaligned", "joint_softmax_axis"] if len(shape) == 3 and shape[1] > 1 else []
    kinds = ["rms_axis", "rms_row_scale", *joint] + (
        ["chunks_batch"] if len(shape) == 2 and shape[0] % 2 == 0 else [])
    kind = g.pick(kinds)
    g.desc.append(f"near-miss: MMDiT {kind}")
    if kind == "rms_axis":
        return rms_norm(g, x, axis=g.pick(list(range(len(shape) - 1))))
    if kind == "rms_row_scale":
        return rms_norm(g, x, scale=g.weight((*shape[:-1], 1), 0.3, "row_w", offset=1.0))
    if kind in ("joint_misaligned", "joint_softmax_axis"):
        return joint_attention(g, x, heads=g.num(1, 2), d=g.num(1, 4), norm=g.flag(), spelling="dynamo",
                               parts="misaligned" if kind == "joint_misaligned" else "both",
                               softmax_axis=-1 if kind == "joint_misaligned" else 2)
    y = _project(g, x, g.num(1, 6), keep_rank=True)
    half = g.op_n("Split", [y], [(shape[0] // 2, g.shape[y][1])] * 2, axis=0, num_outputs=2)
    return g.op("Add", half, g.shape[half[0]])


def nm_attention_variants(g: G, x: str) -> str:
    p = _attention_params(g)
    kind = g.pick(["softmax_escapes", "q_escapes", "mask_not_causal", "softmax_axis", "wrong_merge",
                   "interleaved_split", "v_scale", "head_scale"])
    if kind == "softmax_escapes":
        p["softmax_escapes"] = True
    elif kind == "q_escapes":
        p["q_escapes"] = True
    elif kind == "mask_not_causal":
        p.update(causal=False, mask="random")
        if p["cross"]:
            p["cross"] = False
    elif kind == "softmax_axis":
        p["softmax_axis"] = g.pick([-2, 2])
    elif kind == "wrong_merge":
        p["merge"] = "wrong"
    elif kind == "v_scale":
        p["v_scale"] = True
    elif kind == "head_scale":
        p.update(head_scale=True, spelling="plain")
    else:
        p["split"] = "interleaved"
    g.desc.append(f"near-miss: attention {kind} (" + ", ".join(f"{k}={v}" for k, v in p.items()) + ")")
    return attention(g, x, **p)


def nm_activation_constants(g: G, x: str) -> str:
    s = g.shape[x]
    kind = g.pick(["quick_gelu_1.7", "sigmoid_gate_other", "erf_gelu_wrong_root", "geglu_swapped", "geglu_uneven",
                   "tanh_gelu_wrong_cube", "tanh_gelu_other_x"])
    if kind == "quick_gelu_1.7":
        y = g.op("Mul", [x, g.op("Sigmoid", [g.op("Mul", [x, g.fconst(1.7)], s)], s)], s)
    elif kind == "sigmoid_gate_other":
        other = g.op("Add", [x, g.fconst(0.5)], s)
        y = g.op("Mul", [other, g.op("Sigmoid", [x], s)], s)
    elif kind == "erf_gelu_wrong_root":
        e = g.op("Erf", [g.op("Div", [x, g.fconst(1.5)], s)], s)
        y = g.op("Mul", [g.op("Mul", [x, g.op("Add", [e, g.fconst(1.0)], s)], s), g.fconst(0.5)], s)
    elif kind in ("tanh_gelu_wrong_cube", "tanh_gelu_other_x"):
        # 0.04 x^3 is not GELU's 0.044715 x^3; halving a value other than the tanh's argument is not GELU either
        c = 0.04 if kind == "tanh_gelu_wrong_cube" else 0.044715
        cube = g.op("Mul", [g.op("Pow", [x, g.fconst(3.0)], s), g.fconst(c)], s)
        t = g.op("Tanh", [g.op("Mul", [g.op("Add", [x, cube], s), g.fconst(math.sqrt(2 / math.pi))], s)], s)
        xo = x if kind == "tanh_gelu_wrong_cube" else g.op("Add", [x, g.fconst(0.25)], s)
        y = g.op("Mul", [g.op("Mul", [xo, g.fconst(0.5)], s), g.op("Add", [t, g.fconst(1.0)], s)], s)
    elif kind == "geglu_swapped":
        proj = _project(g, x, 2 * g.num(1, 8))
        h, gate = _halves(g, proj, g.pick(["split", "slices"]))
        y = g.op("Mul", [g.op("Gelu", [h], g.shape[h]), gate], g.shape[h])
    else:  # the first n and the next n of 2n + 2 values: not the halves
        n = g.num(1, 8)
        proj = _project(g, x, 2 * n + 2)
        half = (*g.shape[proj][:-1], n)
        h = g.op("Slice", [proj, g.ints([0], "starts"), g.ints([n], "ends"), g.ints([-1], "axes")], half)
        gate = g.op("Slice", [proj, g.ints([n], "starts"), g.ints([2 * n], "ends"), g.ints([-1], "axes")], half)
        y = g.op("Mul", [h, g.op("Gelu", [gate], half)], half)
    g.desc.append(f"near-miss: {kind}")
    return y


def nm_neutral_broadcast(g: G, x: str) -> str:
    """x + 0 / x * 1 whose constant broadcasts x to a higher rank: not the identity on shapes."""
    s = g.shape[x]
    if len(s) >= 4:
        return step_sigmoid(g, x)
    op, value = g.pick([("Add", 0.0), ("Mul", 1.0), ("Div", 1.0)])
    c = g.fconst(np.full((1,) * (len(s) + 1), value))
    g.desc.append(f"near-miss: {op} by a neutral constant that raises the rank")
    return g.op(op, [x, c], (1, *s))


# ---- mutations: each rule's pattern with what is around it changed ----------------------------------------------
#
# Each step makes its own input (odd, prime and size-1 dimensions, ranks 1 to 5), usually written by an op that
# becomes a dispatch op (``_feed``: the glue lowers only what touches the NPU), then the pattern of one rule or
# glue lowering with one thing around it changed. A rule must fuse it correctly or decline with a reason.

_DIMS = (1, 2, 3, 5, 7, 11, 13, 4, 6, 8, 9, 12)


def _dim(g: G, hi: int = 13) -> int:
    """A dimension: size 1, odd and prime sizes first (they shrink towards 1), sometimes even."""
    return g.pick([d for d in _DIMS if d <= hi])


def _mshape(g: G, rank: int, batch: int = 3, hi: int = 13, budget: int = MAX_ELEMS) -> tuple[int, ...]:
    """A shape of ``rank`` with mutation dimensions (the first one a batch of 1 to ``batch``), shrunk to the budget."""
    dims = [_dim(g, batch)] + [_dim(g, hi) for _ in range(rank - 1)]
    while _size(dims) > budget:
        i = max(range(len(dims)), key=lambda j: dims[j])
        dims[i] = max(1, dims[i] // 2)
    return tuple(dims)


def _feed(g: G, shape: tuple[int, ...], prefix: str = "x") -> str:
    """An input of ``shape``, usually through an op that becomes a dispatch op: a Linear on the last axis (SDGemm
    takes ranks 1 to 4) or a 1x1 Conv on [B, C, H, W]; else the graph input itself (CPU values)."""
    x = g.input(shape, prefix)
    kinds = ["input"] + (["linear", "linear"] if 1 <= len(shape) <= 4 else []) + (["conv"] if len(shape) == 4 else [])
    kind = g.pick(kinds)
    if kind == "linear":
        return g.op("MatMul", [x, g.weight((shape[-1], shape[-1]))], shape)
    if kind == "conv":
        return g.op("Conv", [x, g.weight((shape[1], shape[1], 1, 1))], shape)
    return x


def _drain(g: G, y: str) -> str:
    """Now and then a Linear reading the result (a dispatch op after the pattern)."""
    shape = g.shape[y]
    if g.types.get(y) != g.dtype or not 1 <= len(shape) <= 4 or g.num(0, 2):
        return y
    return g.op("MatMul", [y, g.weight((shape[-1], shape[-1]))], shape)


def _share(g: G, inside: list[str], y: str) -> str:
    """Now and then an intermediate of the pattern is also a graph output, or read by another node too."""
    inside = [v for v in inside if v != y and g.types.get(v) == g.dtype]
    if not inside or g.num(0, 2):
        return y
    v = g.pick(inside)
    if g.flag() or g.shape[v] != g.shape[y]:
        g.output(v)
        g.desc.append(f"shared: {v} is also an output")
        return y
    g.desc.append(f"shared: {v} is also read by an Add")
    return g.op("Add", [y, v], g.shape[y])


def mut_group_norm(g: G, _: Any) -> str:
    """GroupNorm with the batch folded into the groups ([1, B*G, -1]), the groups split in two axes ([B, G, C/G,
    -1]), rank 3 / 4 / 5 inputs, odd channels, gamma and beta [C, 1, ..] or [1, C, 1, ..], an intermediate
    shared."""
    rank = g.pick([3, 4, 4, 5])
    b, c = g.pick([1, 2, 3]), g.pick([1, 2, 3, 4, 5, 6, 7, 9, 12])
    spatial = list(_mshape(g, rank - 1, hi=7, budget=MAX_ELEMS // (b * c)))[1:]
    shape = (b, c, *spatial)
    x = _feed(g, shape)
    groups = g.pick(_divisors(c))
    rest = _size(shape) // (b * groups)
    spelling = g.pick(["[B, G, -1]", "[0, G, -1]", "[1, B*G, -1]", "[B, G, C/G, -1]", "[1, B*G, C/G, -1]"])
    lead = b * groups if "B*G" in spelling else groups
    if "C/G" in spelling:
        grouped: tuple[int, ...] = ((1,) if "B*G" in spelling else (b,)) + (lead, c // groups, rest // (c // groups))
        target = [grouped[0], lead, c // groups, -1]
    else:
        grouped = ((1,) if "B*G" in spelling else (b,)) + (lead, rest)
        target = [0 if spelling.startswith("[0") else grouped[0], lead, -1]
    eps = g.pick([1e-5, 1e-6, 1e-3])
    r = g.op("Reshape", [x, g.ints(target)], grouped)
    inorm = g.op("InstanceNormalization", [r, g.fconst(np.ones(lead)), g.fconst(np.zeros(lead))], grouped, epsilon=eps)
    if g.flag():
        shp = g.op("Shape", [x], (rank,))
        g.types[shp] = T.INT64
        g.activations.remove(shp)
    else:
        shp = g.ints(list(shape))
    r2 = g.op("Reshape", [inorm, shp], shape)
    affine = g.pick([(c,) + (1,) * (rank - 2), (1, c) + (1,) * (rank - 2)])
    gamma, beta = g.weight(affine, 0.3, "gamma", offset=1.0), g.weight(affine, 0.3, "beta")
    m = g.op("Mul", [r2, gamma] if g.flag() else [gamma, r2], shape)
    y = g.op("Add", [m, beta] if g.flag() else [beta, m], shape)
    silu = g.flag()
    out = _silu(g, y) if silu else y
    g.desc.append(f"mutation: GroupNorm(x {list(shape)}, groups={groups}, Reshape {spelling} = {target}, "
                  f"gamma {list(affine)}){'+SiLU' if silu else ''}")
    return _drain(g, _share(g, [r, inorm, r2, m, y], out))


def mut_conv(g: G, _: Any) -> str:
    """Conv of 1, 2 or 3 spatial axes (1-D and 3-D must decline), odd and size-1 sizes, kernels 1-5 (not square),
    dilations 1-3, strides 1-3 per axis, groups and depthwise, asymmetric pads, auto_pad, no pads attribute."""
    nd = g.pick([2, 2, 2, 1, 3])
    b, c = g.pick([1, 2, 3]), g.pick([1, 2, 3, 4, 5, 6, 7, 8])
    spatial = list(_mshape(g, nd + 1, hi=9 if nd < 3 else 5, budget=MAX_ELEMS // (b * c)))[1:]
    x = _feed(g, (b, c, *spatial))
    group = g.pick(_divisors(c)) if g.num(0, 2) == 0 else 1
    oc = c if g.num(0, 5) == 0 else group * g.num(1, max(1, 12 // group))
    if oc == c and g.num(0, 1) == 0:
        group = c  # depthwise
    kernel = [g.pick([1, 1, 2, 3, 3, 5]) for _ in range(nd)]
    if g.num(0, 2):
        kernel = [kernel[0]] * nd
    dil = [g.pick([1, 1, 1, 2, 3]) for _ in range(nd)]
    strides = [g.pick([1, 1, 2, 3]) for _ in range(nd)]
    if g.num(0, 2):
        strides = [strides[0]] * nd
    auto = g.pick(["NOTSET"] * 6 + ["SAME_UPPER", "SAME_LOWER", "VALID", "absent"])
    pads = [g.pick([0, 0, 1, 2, 3]) for _ in range(2 * nd)]
    if g.num(0, 2):
        pads = pads[:nd] * 2
    if auto in ("VALID", "absent"):
        pads = [0] * (2 * nd)
    if auto.startswith("SAME"):
        dil = [1] * nd  # onnxruntime: "Dilation not supported for AutoPadType::SAME_UPPER or SAME_LOWER"
    out = []
    for i, size in enumerate(spatial):
        span = dil[i] * (kernel[i] - 1) + 1
        if auto in ("SAME_UPPER", "SAME_LOWER"):
            out.append(-(-size // strides[i]))
            continue
        if size + pads[i] + pads[i + nd] < span:
            if auto in ("VALID", "absent"):
                kernel[i], dil[i], span = 1, 1, 1
            else:
                pads[i + nd] += span - size - pads[i] - pads[i + nd]
        out.append((size + pads[i] + pads[i + nd] - span) // strides[i] + 1)
    while b * oc * _size(out) > MAX_ELEMS and oc > group:
        oc -= group
    w = g.weight((oc, c // group, *kernel))
    ins = [x, w] + ([g.weight((oc,), 0.1, "b")] if g.flag() else [])
    attrs: dict[str, Any] = {"group": group}
    if g.flag() or dil != [1] * nd:
        attrs["dilations"] = dil
    if g.flag() or strides != [1] * nd:
        attrs["strides"] = strides
    if auto == "NOTSET":
        attrs["pads"] = pads
    elif auto != "absent":
        attrs["auto_pad"] = auto
    if g.flag():
        attrs["kernel_shape"] = kernel
    y = g.op("Conv", ins, (b, oc, *out), **attrs)
    silu = g.flag()
    z = _silu(g, y) if silu else y
    g.desc.append(f"mutation: Conv{nd}d(x {[b, c, *spatial]}, oc={oc}, k={kernel}, s={strides}, d={dil}, g={group}, "
                  f"pads={pads}, auto_pad={auto}){'+SiLU' if silu else ''}")
    return _drain(g, _share(g, [y], z))


def mut_attention(g: G, _: Any) -> str:
    """Attention with prime head counts and widths, batch 1-3, sequence lengths 1 to 13 (now and then 256 for the
    flash SDMHA), Softmax on the last axis written positive or on another axis, a non-causal mask, intermediates
    shared."""
    big = g.num(0, 9) == 0
    heads, d = (g.pick([1, 2]), g.pick([1, 2])) if big else (g.pick([1, 2, 3, 5]), g.pick([1, 2, 3, 5, 7]))
    b, s = (1, 256) if big else (g.pick([1, 2, 3]), g.pick([1, 2, 3, 5, 7, 11, 13]))
    x = _feed(g, (b, s, g.pick([1, 2, 3, 5, 8])))
    cross = not big and g.num(0, 2) == 0
    p: dict[str, Any] = {"heads": heads, "d": d, "cross": cross, "spelling": g.pick(["dynamo", "torchscript", "plain"]),
                         "causal": not cross and g.num(0, 4) == 0, "kv_shared": g.num(0, 5) == 0,
                         "softmax_axis": g.pick([-1, -1, 3, 3, -2, 1, 2])}
    kind = g.pick(["none"] * 6 + ["mask", "softmax_escapes", "q_escapes", "batch_folded", "batch_folded"])
    if kind == "batch_folded":
        return _attention_batch_folded(g, x, heads, d)
    if kind == "mask" and not p["causal"]:
        p["mask"] = "random"
    elif kind in ("softmax_escapes", "q_escapes"):
        p[kind] = True
    g.desc.append("mutation: Attention(" + ", ".join(f"{k}={v}" for k, v in p.items()) + f", b={b}, s={s})")
    return attention(g, x, **p)


def _attention_batch_folded(g: G, x: str, heads: int, d: int) -> str:
    """Attention with the heads folded into the batch, as diffusers' AttnProcessor (head_to_batch_dim, baddbmm)
    and transformers' eager CLIPAttention write it: q, k, v [B*H, S, D], 3-D MatMuls, the scale on the scores
    or on q before its split, then [B*H, S, D] -> [B, H, S, D] -> [B, S, C]."""
    b, s, _ = g.shape[x]
    cm = heads * d
    where = g.pick(["scores", "q_proj"])
    q, k, v = _project(g, x, cm), _project(g, x, cm), _project(g, x, cm)
    if where == "q_proj":
        q = g.bin("Mul", q, g.scalar(d ** -0.5, "scale"))

    def fold(t: str) -> str:
        r = g.op("Reshape", [t, g.ints([b, s, heads, d])], (b, s, heads, d))
        h = g.op("Transpose", [r], (b, heads, s, d), perm=[0, 2, 1, 3])
        return g.op("Reshape", [h, g.ints([b * heads, s, d])], (b * heads, s, d))

    qf, kf, vf = fold(q), fold(k), fold(v)
    kt = g.op("Transpose", [kf], (b * heads, d, s), perm=[0, 2, 1])
    scores = g.op("MatMul", [qf, kt], (b * heads, s, s))
    if where == "scores":
        scores = g.bin("Mul", scores, g.scalar(d ** -0.5, "scale"))
    p = g.op("Softmax", [scores], g.shape[scores], axis=-1)
    o = g.op("MatMul", [p, vf], (b * heads, s, d))
    o = g.op("Reshape", [o, g.ints([b, heads, s, d])], (b, heads, s, d))
    o = g.op("Transpose", [o], (b, s, heads, d), perm=[0, 2, 1, 3])
    g.desc.append(f"mutation: Attention(heads folded into the batch, heads={heads}, d={d}, b={b}, s={s}, "
                  f"scale on {where})")
    return g.op("Reshape", [o, g.ints([b, s, cm])], (b, s, cm))


def mut_layer_norm(g: G, _: Any) -> str:
    """LayerNormalization on ranks 1 to 5, the last axis written -1 or positive, other axes (declined), gamma of
    rank 1 or 2, no beta, the statistics outputs read, odd and size-1 widths."""
    rank = g.pick([1, 2, 3, 3, 4, 5])
    shape = _mshape(g, rank)
    x = _feed(g, shape)
    axis = g.pick([-1, -1, rank - 1] + ([-2, 0, 1] if rank >= 2 else []))
    norm = shape[axis % rank:]
    gshape = g.pick([norm, (1, *norm)]) if len(norm) == 1 and rank >= 2 else norm
    ins = [x, g.weight(gshape, 0.3, "gamma", offset=1.0)] + ([g.weight(gshape, 0.3, "beta")] if g.flag() else [])
    eps = g.pick([1e-5, 1e-6, 1e-3])
    stats = g.num(0, 5) == 0
    g.desc.append(f"mutation: LayerNormalization(x {list(shape)}, axis={axis}, gamma {list(gshape)}, "
                  f"bias={len(ins) == 3}, eps={eps}{', statistics read' if stats else ''})")
    if stats:
        stat = tuple(d if i < axis % rank else 1 for i, d in enumerate(shape))
        y, mean, inv = g.op_n("LayerNormalization", ins, [shape, stat, stat], axis=axis, epsilon=eps)
        g.types[mean] = g.types[inv] = F32
        g.output(g.pick([mean, inv]))
        return y
    return _drain(g, g.op("LayerNormalization", ins, shape, axis=axis, epsilon=eps))


def mut_instance_norm(g: G, _: Any) -> str:
    """InstanceNormalization on ranks 3 to 5 (InstanceNorm1d/2d/3d), odd and size-1 sizes (a position of its
    own: the variance is 0), batches 1-3, affine or not, after a flattening Reshape, + SiLU, an intermediate
    shared."""
    rank = g.pick([3, 4, 4, 5])
    b, c = g.pick([1, 2, 3]), g.pick([1, 2, 3, 4, 5, 7, 8, 12])
    spatial = list(_mshape(g, rank - 1, hi=7, budget=MAX_ELEMS // (b * c)))[1:]
    shape = (b, c, *spatial)
    x = _feed(g, shape)
    affine, eps, silu, flatten = g.flag(), g.pick([1e-5, 1e-6, 1e-3]), g.flag(), g.num(0, 3) == 0
    y = instance_norm(g, x, affine=affine, eps=eps, silu=silu, flatten=flatten)
    g.desc.append(f"mutation: InstanceNorm(x {list(shape)}, affine={affine}, eps={eps}"
                  f"{', flattened' if flatten else ''}){'+SiLU' if silu else ''}")
    inside = [v for v in g.activations if v not in (x, y)]
    return _drain(g, _share(g, inside, y))


def mut_l2_norm(g: G, _: Any) -> str:
    """L2 and RMS norms on ranks 2 to 5 over any axis or two (the channels and the last taken, the others
    declined), every root and eps spelling, eps from 1e-30 (below float32's range as e^2 / D) to 0.5 (outside
    the root: declined above 1e-6), a scalar after (sqrt(D) or another), a weight per channel or per row, an
    intermediate shared."""
    rank = g.pick([2, 3, 4, 4, 5])
    axes = g.pick([[-1], [-1], [1], [1], [rank - 1]] + ([[rank - 2]] if rank >= 3 else []) + [[0, rank - 1]])
    shape = list(_mshape(g, rank))
    if _size([shape[a] for a in axes]) == 1:  # a norm of one value is its sign: no norm, and ill-conditioned at 0
        shape[axes[-1]] = g.pick([2, 3, 5])
    shape = tuple(shape)
    x = _feed(g, shape)
    p = {"root": g.pick(["ReduceL2", "ReduceSum", "ReduceSumSquare", "ReduceMean"]),
         "clamp": g.pick(["Clip", "Max", "Add"]), "eps": g.pick([1e-12, 1e-12, 1e-8, 1e-6, 1e-30, 1e-3, 0.5]),
         "expand": g.flag(), "divide": g.flag(), "sqrt_d": g.num(0, 2) == 0}
    if g.dtype == F16:
        p["eps"] = max(p["eps"], 1e-6)  # fp16's smallest subnormal is 6e-8
    axis = axes[0] % rank
    weight = g.pick(["none", "channel", "row", "scalar"])
    gamma = None
    if weight == "channel" and len(axes) == 1 and (axis == rank - 1 or (axis == 1 and rank >= 3)):
        gamma = _norm_axis_weight(g, shape, axis)
    elif weight == "row":
        gamma = g.weight((*shape[:-1], 1), 0.3, "row_w", offset=1.0)
    elif weight == "scalar":
        gamma = g.scalar(g.pick([3.0, 0.5]), "k")
    y = l2_norm(g, x, axes=axes, gamma=gamma, **p)
    g.desc.append(f"mutation: L2Norm(x {list(shape)}, axes={axes}, " + ", ".join(f"{k}={v}" for k, v in p.items()) +
                  f", weight={weight if gamma else 'none'})")
    inside = [v for v in g.activations if v not in (x, y) and g.shape[v] == shape]
    return _drain(g, _share(g, inside, y))


def mut_geglu(g: G, _: Any) -> str:
    """GEGLU with an odd projection width (TorchScript's Slices of torch.chunk: [0, n+1) and [n+1, end), or the
    last column dropped), Split with sizes or num_outputs, slice ends written n, 2n or INT64_MAX, positive axes,
    the halves swapped, ranks 2-4, an intermediate shared."""
    rank = g.pick([2, 3, 3, 4])
    lead = _mshape(g, rank - 1, hi=7, budget=64)
    x = _feed(g, (*lead, _dim(g, 8)))
    kind = g.pick(["even", "even", "odd_chunk", "odd_drop"])
    n = g.pick([1, 2, 3, 5, 8])
    width = {"even": 2 * n, "odd_chunk": 3, "odd_drop": 2 * n + 1}[kind]
    proj = _project(g, x, width, keep_rank=True)
    big, axis = np.iinfo(np.int64).max, g.pick([-1, rank - 1])
    if kind == "odd_chunk":  # torch.chunk(2) of 3 columns: 2 and 1, which broadcast in the product
        spans = [(0, 2), (2, g.pick([3, big]))]
    elif kind == "odd_drop":
        spans = [(0, n), (n, 2 * n)]
    else:
        spans = [(0, n), (n, g.pick([2 * n, big]))]
    sizes = [min(e, width) - s for s, e in spans]
    halves: list[str]
    if kind != "odd_drop" and g.flag():
        split_in = [proj] + ([g.ints(sizes, "split")] if g.flag() else [])
        extra = {} if len(split_in) == 2 else {"num_outputs": 2}
        halves = g.op_n("Split", split_in, [(*lead, sz) for sz in sizes], axis=axis, **extra)
        how = "Split"
    else:
        halves = []
        for (s, e), sz in zip(spans, sizes, strict=True):
            ins = [proj, g.ints([s], "starts"), g.ints([e], "ends"), g.ints([axis], "axes")]
            if g.flag():
                ins.append(g.ints([1], "steps"))
            halves.append(g.op("Slice", ins, (*lead, sz)))
        how = "Slices"
    h, gate = halves if g.num(0, 3) else halves[::-1]
    approx = g.pick(["none", "none", "tanh"])
    gl = g.op("Gelu", [gate], g.shape[gate], approximate=approx)
    y = g.bin("Mul", h, gl) if g.flag() else g.bin("Mul", gl, h)
    g.desc.append(f"mutation: GEGLU({kind}, width {width}, {how} {spans} axis={axis}, approximate={approx})")
    return _drain(g, _share(g, [proj, h, gate, gl], y))


def mut_gemm(g: G, _: Any) -> str:
    """Gemm with alpha / beta / transA / transB and every bias shape (none, [N], [1, N], [M, N], [M, 1], [1], a
    scalar); MatMul on ranks 1 to 5 with N or K of 1, the weight first, the bias raising the rank."""
    if g.flag():
        m, k, n = _dim(g, 7), _dim(g), _dim(g)
        ta, tb = g.flag(), g.flag()
        x = _feed(g, (k, m) if ta else (m, k))
        attrs: dict[str, Any] = {}
        if ta or g.num(0, 3) == 0:
            attrs["transA"] = int(ta)
        if tb or g.num(0, 3) == 0:
            attrs["transB"] = int(tb)
        for name in ("alpha", "beta"):
            if g.num(0, 3) == 0:
                attrs[name] = g.pick([1.0, 0.5, 2.0])
        bias = g.pick(["none", "[N]", "[N]", "[1, N]", "[M, N]", "[M, 1]", "[1]", "scalar"])
        bshape = {"[N]": (n,), "[1, N]": (1, n), "[M, N]": (m, n), "[M, 1]": (m, 1), "[1]": (1,), "scalar": ()}
        ins = [x, g.weight((n, k) if tb else (k, n))] + ([g.weight(bshape[bias], 0.1, "b")] if bias != "none" else [])
        g.desc.append(f"mutation: Gemm(M={m}, K={k}, N={n}, {attrs}, bias {bias})")
        return _drain(g, g.op("Gemm", ins, (m, n), **attrs))
    rank = g.pick([1, 2, 3, 4, 5])
    shape = _mshape(g, rank)
    x = _feed(g, shape)
    n = _dim(g)
    if rank >= 2 and g.num(0, 4) == 0:  # the constant first: W [P, M] @ x [.., M, K] is no linear layer
        p = _dim(g)
        y = g.op("MatMul", [g.weight((p, shape[-2])), x], (*shape[:-2], p, shape[-1]))
        g.desc.append(f"mutation: MatMul(W {[p, shape[-2]]}, x {list(shape)})")
        return _drain(g, y)
    y = mm = g.op("MatMul", [x, g.weight((shape[-1], n))], (*shape[:-1], n))
    bias = g.pick(["none", "[N]", "[N]", "[1, N]", "[1, 1, N]", "[1]", "scalar"])
    if bias != "none":
        bshape = {"[N]": (n,), "[1, N]": (1, n), "[1, 1, N]": (1, 1, n), "[1]": (1,), "scalar": ()}[bias]
        b = g.weight(bshape, 0.1, "b")
        y = g.bin("Add", y, b) if g.flag() else g.bin("Add", b, y)
    g.desc.append(f"mutation: MatMul(x {list(shape)}, W [{shape[-1]}, {n}]) + bias {bias}")
    return _drain(g, _share(g, [mm], y))


def mut_resize(g: G, _: Any) -> str:
    """Resize given scales or sizes, with or without ``axes`` (positive, negative, reversed), ranks 3 to 5, H or W
    of 1, factors 1-3 per axis or scales near 2 (2.4 on H = 2 also writes 2H), nearest / linear, every coordinate
    mode and rounding."""
    rank = g.pick([3, 4, 4, 4, 4, 5])
    shape = _mshape(g, rank, hi=7, budget=MAX_ELEMS // 9)
    x = _feed(g, shape)
    factors = [1, 1] + [g.pick([1, 2, 2, 2, 3]) for _ in range(rank - 2)]
    if g.num(0, 3) == 0:
        factors = [1, 1] + [factors[2]] * (rank - 2)
    given = g.pick(["scales", "sizes"])
    axes_kind = g.pick(["none", "none", "spatial", "negative", "reversed", "all"])
    axes = {"none": None, "all": list(range(rank)), "spatial": list(range(2, rank)),
            "negative": list(range(2 - rank, 0)), "reversed": list(range(rank - 1, 1, -1))}[axes_kind]
    picked = [a % rank for a in axes] if axes is not None else list(range(rank))
    if g.num(0, 9) == 0 and 1 in picked:
        factors[1] = 2  # channels: not an upsampling of H and W
    if given == "scales" and g.num(0, 2) == 0:  # near 2: floor(H * s) may still be 2H, the map i / s is not i / 2
        factors[2:] = [g.pick([2.0000002, 2.1, 2.3, 2.4])] * (rank - 2)
    factors = [float(np.float32(f)) if f != int(f) else int(f) for f in factors]
    out = tuple(math.floor(s * f) for s, f in zip(shape, factors, strict=True))
    if _size(out) > MAX_ELEMS:
        factors, out = [1] * rank, shape
    mode = "linear" if rank == 4 and factors[1] == 1 and g.num(0, 5) == 0 else "nearest"
    coord = g.pick(["asymmetric"] * 4 + ["half_pixel", "pytorch_half_pixel", "align_corners"]
                   + (["tf_half_pixel_for_nn"] if mode == "nearest" else []))
    rounding = g.pick(["floor"] * 3 + ["round_prefer_floor", "round_prefer_ceil", "ceil"])
    if given == "scales":
        ins = [x, "", g.tensor(np.array([factors[a] for a in picked], np.float32), "scales")]
    else:
        ins = [x, "", "", g.ints([out[a] for a in picked], "sizes")]
    attrs: dict[str, Any] = {"mode": mode, "coordinate_transformation_mode": coord}
    if mode == "nearest":
        attrs["nearest_mode"] = rounding
    if axes is not None:
        attrs["axes"] = axes
    # (onnxruntime 1.32 returns the input unresized for a keep_aspect_ratio_policy with negative axes)
    if given == "sizes" and axes_kind != "negative" and g.num(0, 3) == 0:
        attrs["keep_aspect_ratio_policy"] = g.pick(["stretch", "not_larger", "not_smaller"])
        if attrs["keep_aspect_ratio_policy"] != "stretch" and len({factors[a] for a in picked}) > 1:
            attrs["keep_aspect_ratio_policy"] = "stretch"
    y = g.op("Resize", ins, out, **attrs)
    g.desc.append(f"mutation: Resize(x {list(shape)}, {given} {factors}, axes={axes}, {mode}, {coord}"
                  f"{', ' + rounding if mode == 'nearest' else ''})")
    return _drain(g, y)


def mut_activation_glue(g: G, _: Any) -> str:
    """SiLU (either operand order, the sigmoid shared), quick_gelu (its 1.702 0-d, [1] or rank-raising), Gelu
    (none / tanh), on ranks 1 to 5 written by a dispatch op or on CPU values."""
    rank = g.pick([1, 2, 3, 4, 5])
    x = _feed(g, _mshape(g, rank))
    s = g.shape[x]
    kind = g.pick(["silu", "silu", "quick_gelu", "gelu", "gelu_tanh", "sigmoid_shared"])
    inside: list[str] = []
    if kind in ("silu", "sigmoid_shared"):
        sig = g.op("Sigmoid", [x], s)
        y = g.op("Mul", [x, sig] if g.flag() else [sig, x], s)
        inside = [sig] if kind == "sigmoid_shared" else []
    elif kind == "quick_gelu":
        c = g.scalar(1.702, raise_rank=rank + 1)
        inner = g.bin("Mul", x, c) if g.flag() else g.bin("Mul", c, x)
        sig = g.op("Sigmoid", [inner], g.shape[inner])
        y = g.bin("Mul", x, sig) if g.flag() else g.bin("Mul", sig, x)
    else:
        y = g.op("Gelu", [x], s, approximate="tanh" if kind == "gelu_tanh" else "none")
    g.desc.append(f"mutation: {kind}(x {list(s)})")
    if inside and g.flag():
        y = g.op("Add", [y, inside[0]], s)
    elif inside:
        g.output(inside[0])
    return _drain(g, y)


def mut_arithmetic_glue(g: G, _: Any) -> str:
    """Add / Sub / Mul / Div of an activation and a constant or another activation, every broadcast ([C], [1, C],
    per channel [C, 1, 1], a scalar, rank-raising [1, 1, ..], a lower-rank activation), either operand first,
    ranks 1 to 5."""
    rank = g.pick([1, 2, 3, 4, 5])
    shape = _mshape(g, rank)
    x = _feed(g, shape)
    op = g.pick(["Add", "Sub", "Mul", "Div"])
    kind = g.pick(["scalar", "[1]", "last", "[1, C]", "channel", "full", "raise", "activation", "activation_bcast"])
    shapes = {"scalar": (), "[1]": (1,), "last": (shape[-1],), "[1, C]": (1, shape[-1]), "full": shape,
              "raise": (1,) * (rank + 1), "channel": (shape[1],) + (1,) * (rank - 2) if rank >= 3 else (shape[-1],)}
    if kind.startswith("activation"):
        oshape = shape if kind == "activation" else (1,) * (rank - 1) + (shape[-1],)
        if g.flag() and len(oshape) > 1:
            oshape = oshape[1:]  # a lower rank
        other = _feed(g, oshape, "y")
        if op == "Div":  # away from zero: 0.5 + sigmoid
            other = g.bin("Add", g.op("Sigmoid", [other], oshape), g.fconst(0.5))
    elif op == "Div":
        cs = shapes[kind]
        other = g.tensor((g.rng.uniform(0.5, 2.0, cs) * g.rng.choice([-1, 1], cs)).astype(g.np_dtype), "divisor")
    else:
        other = g.weight(shapes[kind], 1.0, "k")
    first = op != "Div" and g.flag()  # x is never the divisor: it is not kept away from zero
    y = g.bin(op, other, x) if first else g.bin(op, x, other)
    g.desc.append(f"mutation: {op}(x {list(shape)}, {kind} {list(g.shape[other])}{', other first' if first else ''})")
    return _drain(g, y)


def mut_concat_glue(g: G, _: Any) -> str:
    """Concat of 2 to 4 operands (dispatch outputs, graph inputs, constants, one value twice) on any axis of
    ranks 1 to 5, written negative or positive."""
    rank = g.pick([1, 2, 2, 3, 4, 5])
    shape = _mshape(g, rank, budget=MAX_ELEMS // 8)
    axis = g.num(-rank, rank - 1)
    ax = axis % rank
    x = _feed(g, shape)
    ins, total = [x], shape[ax]
    kinds = []
    for _ in range(g.num(1, 3)):
        kind = g.pick(["dispatch", "input", "const", "same"])
        part = list(shape)
        part[ax] = _dim(g, 5)
        if kind == "same":
            v, part[ax] = x, shape[ax]
        elif kind == "const":
            v = g.weight(tuple(part), 1.0, "k")
        else:
            v = _feed(g, tuple(part), "y") if kind == "dispatch" else g.input(tuple(part), "y")
        ins.insert(g.num(0, len(ins)), v)
        total += part[ax]
        kinds.append(kind)
    out = list(shape)
    out[ax] = total
    g.desc.append(f"mutation: Concat(axis={axis}, x {list(shape)}, {kinds})")
    return _drain(g, g.op("Concat", ins, out, axis=axis))


def mut_text_pooling(g: G, _: Any) -> str:
    """CLIP's end-of-text pooling in the spellings transformers writes: legacy ArgMax(ids), and the non-legacy
    ArgMax(Cast(Equal(ids, eos_id), int)) (the bool of Equal cast to int32 / int64 / float: ONNX's ArgMax takes
    no bool, so there is always a Cast), the rows picked by GatherND or by a Gather on the flattened states,
    keepdims 0 or 1. The hidden states come from a LayerNorm (SDLayerNorm) of the token embeddings."""
    b, seq, c, v = g.pick([1, 2, 3]), g.pick([1, 2, 5, 7]), _dim(g, 16), 8
    ids = g.input((b, seq), "ids")
    g.types[ids] = T.INT64
    h = g.op("Gather", [g.weight((v, c), 1.0, "table"), ids], (b, seq, c), axis=0)
    h = g.op("LayerNormalization", [h, g.weight((c,), 0.3, "gamma", offset=1.0), g.weight((c,), 0.3, "beta")],
             (b, seq, c), axis=-1, epsilon=1e-5)
    form = g.pick(["legacy", "eq_int32", "eq_int64", "eq_float", "eq_int32_ids"])
    ints: list[str] = []

    def int_op(op_type: str, inputs: list[str], shape: tuple[int, ...], dtype: int, **attrs: Any) -> str:
        out = g.op(op_type, inputs, shape, **attrs)
        g.activations.remove(out)
        g.types[out] = dtype
        ints.append(out)
        return out

    eos = g.num(0, 7)
    if form == "legacy":
        scores = int_op("Cast", [ids], (b, seq), T.INT32, to=T.INT32)
    else:
        src, eos_v = ids, g.tensor(np.asarray(eos, np.int64), "eos")
        if form == "eq_int32_ids":  # input_ids.to(torch.int) == eos_token_id
            src = int_op("Cast", [ids], (b, seq), T.INT32, to=T.INT32)
            eos_v = g.tensor(np.asarray(eos, np.int32), "eos")
        eq = int_op("Equal", [src, eos_v], (b, seq), T.BOOL)
        to = {"eq_int64": T.INT64, "eq_float": T.FLOAT}.get(form, T.INT32)
        scores = int_op("Cast", [eq], (b, seq), to, to=to)
    keep = g.flag()
    am = int_op("ArgMax", [scores], (b, 1) if keep else (b,), T.INT64, axis=-1, keepdims=int(keep))
    if g.flag():
        col = am if keep else int_op("Unsqueeze", [am, g.ints([1], "axes")], (b, 1), T.INT64)
        idx = int_op("Concat", [g.ints([[i] for i in range(b)], "rows"), col], (b, 2), T.INT64, axis=-1)
        y = g.op("GatherND", [h, idx], (b, c))
        how = "GatherND"
    else:
        flat = g.op("Reshape", [h, g.ints([b * seq, c])], (b * seq, c))
        flat_am = am if not keep else int_op("Reshape", [am, g.ints([b])], (b,), T.INT64)
        pos = int_op("Add", [flat_am, g.ints([i * seq for i in range(b)], "offsets")], (b,), T.INT64)
        y = g.op("Gather", [flat, pos], (b, c), axis=0)
        how = "Gather"
    g.desc.append(f"mutation: TokenPool({form}, eos={eos}, keepdims={int(keep)}, {how}, b={b}, seq={seq}, c={c})")
    return y


def mut_softmax_large(g: G, _: Any) -> str:
    """A standalone Softmax over large logits, around 1e4 (a constant offset) on any axis: the logits must reach
    it unrounded, their differences are O(1). The logits are CPU values here: where an NPU op writes them
    (bf16: a step of 64 at 1e4), no bf16 compile can keep their differences, and the graph's own measured
    sensitivity to bf16 rounding is then above the oracle's cap (``fuzz_repro.CAP``), by design."""
    rank = g.pick([1, 2, 3, 4])
    shape = _mshape(g, rank)
    x = g.input(shape)
    offset = g.pick([1e4, -1e4, 3e3, 1.2e4]) if g.dtype == F32 else g.pick([100.0, -100.0])  # fp16: a step of 1/16
    logits = g.bin("Add", x, g.scalar(offset, "offset")) if g.flag() else g.bin("Add", g.scalar(offset, "offset"), x)
    axis = g.num(-rank, rank - 1)
    y = g.op("Softmax", [logits], shape, axis=axis)
    g.desc.append(f"mutation: Softmax(x {list(shape)} + {offset:g}, axis={axis})")
    return _drain(g, y)


# ---- families and the case strategy ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    fn: Callable[[G, Any], str]  # ranks (0,): the step makes its own input (x is None)
    ranks: tuple[int, ...]
    chain: bool = True  # may follow another step


STEPS: dict[str, Step] = {
    "conv": Step(step_conv, (4,)),
    "conv_transpose": Step(step_conv_transpose, (4,)),
    "video_conv": Step(step_video_conv, (4,)),
    "conv1d": Step(step_conv1d, (3,)),
    "frame_tokens": Step(step_frame_tokens, (3,)),
    "linear": Step(step_linear, (2, 3)),
    "tied_linear": Step(step_tied_linear, (2, 3)),
    "matmul_act": Step(step_matmul_act, (2, 3, 4)),
    "gemm": Step(step_gemm, (2,)),
    "attention": Step(step_attention, (3,)),
    "group_norm": Step(step_group_norm, (3, 4)),
    "layer_norm": Step(step_layer_norm, (2, 3, 4)),
    "layer_norm_decomposed": Step(step_layer_norm_decomposed, (2, 3)),
    "instance_norm": Step(step_instance_norm, (3, 4)),
    "l2_norm": Step(step_l2_norm, (2, 3, 4)),
    "channel_rms_norm": Step(step_channel_rms_norm, (3, 4)),
    "silu": Step(step_silu, (2, 3, 4)),
    "gelu": Step(step_gelu, (2, 3, 4)),
    "erf_gelu": Step(step_erf_gelu, (2, 3, 4)),
    "tanh_gelu": Step(step_tanh_gelu, (2, 3, 4)),
    "quick_gelu": Step(step_quick_gelu, (2, 3, 4)),
    "geglu": Step(step_geglu, (2, 3)),
    "sigmoid": Step(step_sigmoid, (1, 2, 3, 4)),
    "softmax": Step(step_softmax, (1, 2, 3, 4)),
    "resize": Step(step_resize, (4,)),
    "binary_const": Step(step_binary_const, (1, 2, 3, 4)),
    "binary_branch": Step(step_binary_branch, (1, 2, 3, 4)),
    "concat": Step(step_concat, (1, 2, 3, 4)),
    "slice": Step(step_slice, (1, 2, 3, 4)),
    "split": Step(step_split, (1, 2, 3, 4)),
    "expand": Step(step_expand, (1, 2, 3)),
    "sinusoid": Step(step_sinusoid, (1,)),
    "text": Step(step_text, (0,), chain=False),
    "movement_chain": Step(step_movement_chain, (1, 2, 3, 4)),
    "nhwc_roundtrip": Step(step_nhwc_roundtrip, (4,)),
    "to_tokens": Step(step_to_tokens, (4,)),
    "to_image": Step(step_to_image, (3,)),
    "resnet_block": Step(step_resnet_block, (4,)),
    "vae_attention_block": Step(step_vae_attention_block, (4,)),
    "unet_skip_block": Step(step_unet_skip_block, (4,)),
    "transformer_block": Step(step_transformer_block, (3,)),
    "upsample_block": Step(step_upsample_block, (4,)),
    "downsample_block": Step(step_downsample_block, (4,)),
    "rms_norm": Step(step_rms_norm, (2, 3, 4)),
    "joint_attention": Step(step_joint_attention, (3,)),
    "adaln_chunks": Step(step_adaln_chunks, (2,)),
    "rotary": Step(step_rotary, (3,)),
    "rotary_products": Step(step_rotary_products, (3,)),
    "modulation": Step(step_modulation, (3, 4)),
    "streams": Step(step_streams, (3,)),
    "table_rows": Step(step_table_rows, (3,)),
    "gates": Step(step_gates, (3,)),
    "pad_tokens": Step(step_pad_tokens, (3,)),
    "size_conditions": Step(step_size_conditions, (3,)),
    "einsum": Step(step_einsum, (3,)),
    "grouped_attention": Step(step_grouped_attention, (3,)),
    "decoder_attention": Step(step_decoder_attention, (3,)),
    "unrolled_loops": Step(step_unrolled_loops, (3,)),
}

NEAR_MISSES: dict[str, Step] = {
    "silu_sigmoid_shared": Step(nm_silu_sigmoid_shared, (2, 3, 4)),
    "conv_preactivation_used": Step(nm_conv_preactivation_used, (4,)),
    "conv_weight_input": Step(nm_conv_weight_input, (4,)),
    "conv_auto_pad": Step(nm_conv_auto_pad, (4,)),
    "conv_beyond_limits": Step(nm_conv_beyond_limits, (4,)),
    "pad_conv": Step(nm_pad_conv, (4,)),
    "matmul_weight_input": Step(nm_matmul_weight_input, (2, 3)),
    "matmul_used_twice": Step(nm_matmul_used_twice, (2, 3)),
    "gemm_attributes": Step(nm_gemm_attributes, (2,)),
    "resize_unsupported": Step(nm_resize_unsupported, (4,)),
    "group_norm_variants": Step(nm_group_norm_variants, (3, 4)),
    "layer_norm_variants": Step(nm_layer_norm_variants, (2, 3)),
    "norm_reductions": Step(nm_norm_reductions, (2, 3, 4)),
    "attention_variants": Step(nm_attention_variants, (3,)),
    "activation_constants": Step(nm_activation_constants, (2, 3)),
    "neutral_broadcast": Step(nm_neutral_broadcast, (1, 2, 3)),
    "mmdit_variants": Step(nm_mmdit_variants, (2, 3, 4)),
    "rotary_variants": Step(nm_rotary_variants, (3,)),
}

MUTATIONS: dict[str, Step] = {  # each makes its own input: ranks (0,)
    "group_norm": Step(mut_group_norm, (0,), chain=False),
    "conv": Step(mut_conv, (0,), chain=False),
    "attention": Step(mut_attention, (0,), chain=False),
    "layer_norm": Step(mut_layer_norm, (0,), chain=False),
    "instance_norm": Step(mut_instance_norm, (0,), chain=False),
    "l2_norm": Step(mut_l2_norm, (0,), chain=False),
    "geglu": Step(mut_geglu, (0,), chain=False),
    "gemm": Step(mut_gemm, (0,), chain=False),
    "resize": Step(mut_resize, (0,), chain=False),
    "activation_glue": Step(mut_activation_glue, (0,), chain=False),
    "arithmetic_glue": Step(mut_arithmetic_glue, (0,), chain=False),
    "concat_glue": Step(mut_concat_glue, (0,), chain=False),
    "text_pooling": Step(mut_text_pooling, (0,), chain=False),
    "softmax_large": Step(mut_softmax_large, (0,), chain=False),
}

FAMILIES: dict[str, list[str]] = {
    "conv": ["conv", "conv_transpose"],
    "video": ["video_conv", "conv1d", "frame_tokens"],
    "gemm": ["linear", "gemm", "tied_linear", "matmul_act"],
    "attention": ["attention"],
    "norm": ["group_norm", "layer_norm", "layer_norm_decomposed", "instance_norm", "l2_norm", "channel_rms_norm"],
    "activation": ["silu", "gelu", "erf_gelu", "tanh_gelu", "quick_gelu", "geglu", "sigmoid", "softmax"],
    "resize": ["resize"],
    "elementwise": ["binary_const", "binary_branch", "concat", "slice", "split", "expand"],
    "embedding": ["sinusoid", "text"],
    "movement": ["movement_chain", "nhwc_roundtrip", "to_tokens", "to_image"],
    "block": ["resnet_block", "vae_attention_block", "transformer_block", "upsample_block", "downsample_block",
              "unet_skip_block"],
    "mmdit": ["rms_norm", "joint_attention", "adaln_chunks"],
    "generality": ["rotary", "rotary_products", "modulation", "streams", "einsum", "table_rows", "gates",
                   "pad_tokens", "size_conditions", "grouped_attention", "decoder_attention", "unrolled_loops"],
    "near_miss": list(NEAR_MISSES),
    "mutation": [f"mut_{name}" for name in MUTATIONS],
}


def _start_shape(g: G, rank: int) -> tuple[int, ...]:
    b = g.num(1, 2)
    if rank == 4:
        c, h, w = g.num(1, 16), g.num(1, 9), g.num(1, 9)
        return (b, c, h, w)
    if rank == 3:
        return (b, g.num(1, 16), g.num(1, 24))
    if rank == 2:
        return (g.num(1, 4), g.num(1, 32))
    return (g.num(1, 64),)


def _lookup(name: str) -> Step:
    if name.startswith("mut_"):
        return MUTATIONS[name[4:]]
    return STEPS[name] if name in STEPS else NEAR_MISSES[name]


@st.composite
def case(draw: Callable[[st.SearchStrategy[Any]], Any], family: str) -> tuple[onnx.ModelProto, str]:
    """One graph of ``family`` (then up to two chained steps of any family), and its description."""
    seed = draw(st.integers(0, 2**32 - 1))
    dtype = draw(st.sampled_from([F32, F32, F32, F16]))
    g = G(draw, seed, dtype)
    first = g.pick(FAMILIES[family])
    rank = g.pick(_lookup(first).ranks)
    x = _lookup(first).fn(g, g.input(_start_shape(g, rank)) if rank else None)
    for _ in range(draw(st.integers(0, 2))):
        rank = len(g.shape[x])
        fits = [n for n, s in STEPS.items() if rank in s.ranks and s.chain]
        if not fits or _size(g.shape[x]) > MAX_ELEMS:
            break
        x = STEPS[g.pick(fits)].fn(g, x)
    if g.num(0, 7) == 0:  # exporters name outputs through an Identity
        x = g.op("Identity", [x], g.shape[x])
    g.output(x)
    if g.num(0, 15) == 0:  # a graph input returned as it is, too
        g.output(g.inputs[0])
        g.desc.append(f"also output input {g.inputs[0]}")
    if g.num(0, 5) == 0:  # an intermediate that is also a graph output
        candidates = [v for v in g.activations if v != x and g.types[v] == dtype]
        if candidates:
            v = g.pick(candidates)
            g.output(v)
            g.desc.append(f"also output {v}")
    desc = f"[{'fp16' if dtype == F16 else 'fp32'}] " + " -> ".join(g.desc)
    return g.model(), desc
