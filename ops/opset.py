"""The dispatch op set: domain ``sdnpu``, version 1.

Every op is a model-local ONNX function whose body is the op's *reference semantics*: it casts its inputs
to fp32, computes, and casts the result back to the type of its first input (``CastLike``). So an op fed
fp32 computes in fp32 exactly like the subgraph it replaced (the fuse and layout passes are checked at fp32
tolerance), and an op fed bf16 (after the precision pass) rounds each output to bf16 as the NPU does. Stock
onnxruntime runs a dispatch model through these bodies; an NPU runtime claims the ops by name.

Op names follow AMD's DynamicDispatch vocabulary. 4-D activations are NHWC; conv weights are
``[OC, KH, KW, IC/group]``. Attributes that vary per instance (strides, heads, eps, ...) are function
attributes referenced from the body. Every op also carries AMD-style metadata attributes (``in_dtypes``,
``out_dtypes``, ``input_shape``, ``output_shape``) that the body does not read.

Beyond DESIGN.md's list, the SDXL graphs need a few more ops an NPU runs natively; each says why below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import AttributeProto as A
from onnx import TensorProto as T
from onnx import helper

DOMAIN = "sdnpu"
VERSION = 1
ONNX_OPSET = 20  # what the bodies are written against
METADATA_ATTRS = ("in_dtypes", "out_dtypes", "input_shape", "output_shape")
BOUNDARY_OP = "CastAvx"
# Node metadata keys: the contract between the passes that write them and the report that reads them.
RULE_TAG = "sdnpu.rule"  # the rule that created a node
REGION_TAG = "sdnpu.region"  # the NPU region of a dispatch op (partition)
REASON_TAG = "sdnpu.cpu_reason"  # why a node stays on the CPU (partition)


class _Body:
    """A tiny builder for function bodies: ``b.op("Add", x, y)`` returns the output name."""

    def __init__(self, prefix: str = "_t") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._n = 0
        self._prefix = prefix

    def op(self, op_type: str, *inputs: str, n_out: int = 1, refs: dict[str, tuple[str, int]] | None = None,
           **attrs: object) -> str | list[str]:
        outs = [f"{self._prefix}{self._n}_{i}" for i in range(n_out)]
        self._n += 1
        node = helper.make_node(op_type, list(inputs), outs, **attrs)
        for attr_name, (ref_name, attr_type) in (refs or {}).items():
            a = onnx.AttributeProto()
            a.name, a.ref_attr_name, a.type = attr_name, ref_name, attr_type
            node.attribute.append(a)
        self.nodes.append(node)
        return outs[0] if n_out == 1 else outs

    def const_ints(self, values: list[int]) -> str:
        return self.op("Constant", value_ints=values)  # type: ignore[return-value]

    def ref_ints(self, attr: str) -> str:
        return self.op("Constant", refs={"value_ints": (attr, A.INTS)})  # type: ignore[return-value]

    def ref_float(self, attr: str) -> str:
        return self.op("Constant", refs={"value_float": (attr, A.FLOAT)})  # type: ignore[return-value]

    def f32(self, x: str) -> str:
        return self.op("Cast", x, to=T.FLOAT)  # type: ignore[return-value]

    def if_attr(self, attr: str, then: Callable[[_Body], str], otherwise: str) -> str:
        """``then(body)`` when the int attribute ``attr`` is 1, else ``otherwise``. An ``If`` on the attribute:
        only the taken branch runs (an arithmetic blend would pay for both on every call)."""
        cond = self.op("Cast", self.op("Constant", refs={"value_int": (attr, A.INT)}), to=T.BOOL)
        n = self._n
        sub = _Body(prefix=f"{self._prefix}{n}_{attr}_")
        y = then(sub)
        out_on, out_off = f"{self._prefix}{n}_{attr}_on", f"{self._prefix}{n}_{attr}_off"
        sub.nodes.append(helper.make_node("Identity", [y], [out_on]))
        on = helper.make_graph(sub.nodes, f"{attr}_on", [], [helper.make_tensor_value_info(out_on, T.FLOAT, None)])
        off = helper.make_graph([helper.make_node("Identity", [otherwise], [out_off])], f"{attr}_off", [],
                                [helper.make_tensor_value_info(out_off, T.FLOAT, None)])
        return self.op("If", cond, then_branch=on, else_branch=off)  # type: ignore[return-value]

    def silu_if(self, y: str, attr: str = "silu") -> str:
        """``y * sigmoid(y)`` when the int attribute is 1, ``y`` when 0."""
        return self.if_attr(attr, lambda b: b.op("Mul", y, b.op("Sigmoid", y)), y)  # type: ignore[arg-type,return-value]


@dataclass(frozen=True)
class OpDef:
    """One dispatch op: its inputs, attributes (those the body reads) and reference body."""

    name: str
    inputs: tuple[str, ...]
    attrs: tuple[str, ...]
    build: Callable[[_Body, list[str]], str]  # body builder: fp32 inputs -> fp32 output name
    doc: str
    cast_inputs: tuple[bool, ...] | None = None  # which inputs the body casts to fp32 (default: all)
    outputs: tuple[str, ...] = ("Y",)
    cast_output: bool = True  # the result takes the first input's type (CastLike); SDCast sets its own

    def function(self, bfp: tuple[int, ...] = ()) -> onnx.FunctionProto:
        """The reference body; ``bfp``: inputs first rounded to BFP16 (the op's ``_bfp`` variant)."""
        from sdnpu.ops import bfp as bfp16

        b = _Body()
        cast = self.cast_inputs or (True,) * len(self.inputs)
        xs = [b.f32(name) if c else name for name, c in zip(self.inputs, cast, strict=True)]
        xs = [bfp16.body(b, x) if i in bfp else x for i, x in enumerate(xs)]
        y = self.build(b, xs)
        if self.cast_output:
            b.nodes.append(helper.make_node("CastLike", [y, self.inputs[0]], list(self.outputs)))
        else:
            b.nodes.append(helper.make_node("Identity", [y], list(self.outputs)))
        name = f"{self.name}_bfp" if bfp else self.name
        doc = self.doc + (" BFP16 variant: the activations are rounded to bfp16ebs8 first, the weights are "
                          "stored BFP16-rounded." if bfp else "")
        return helper.make_function(
            DOMAIN, name, list(self.inputs), list(self.outputs), b.nodes,
            [helper.make_opsetid("", ONNX_OPSET)], attributes=list(self.attrs + METADATA_ATTRS), doc_string=doc)


def _conv(b: _Body, x: list[str]) -> str:
    xn = b.op("Transpose", x[0], perm=[0, 3, 1, 2])
    wn = b.op("Transpose", x[1], perm=[0, 3, 1, 2])
    y = b.op("Conv", xn, wn, x[2], refs={"strides": ("strides", A.INTS), "pads": ("pads", A.INTS),
                                          "dilations": ("dilations", A.INTS), "group": ("group", A.INT)})
    return b.op("Transpose", b.silu_if(y), perm=[0, 2, 3, 1])  # type: ignore[return-value]


def _mha(b: _Body, x: list[str]) -> str:
    heads = b.op("Constant", refs={"value_ints": ("num_heads", A.INTS)})
    split = b.op("Concat", b.const_ints([0, 0]), heads, b.const_ints([-1]), axis=0)
    q = b.op("Transpose", b.op("Reshape", x[0], split), perm=[0, 2, 1, 3])  # [B, H, M, D]
    k = b.op("Transpose", b.op("Reshape", x[1], split), perm=[0, 2, 3, 1])  # [B, H, D, N]
    v = b.op("Transpose", b.op("Reshape", x[2], split), perm=[0, 2, 1, 3])  # [B, H, N, D]
    scores = b.op("Mul", b.op("MatMul", q, k), b.ref_float("scale"))
    # causal=1 (CLIP's text encoders): -max above the diagonal, as CLIP adds finfo(float32).min there.

    def masked(sb: _Body) -> str:
        ones = sb.op("ConstantOfShape", sb.op("Shape", scores, start=2),
                     value=helper.make_tensor("one", T.FLOAT, [1], [1.0]))
        upper = sb.op("Trilu", ones, sb.op("Constant", value_int=1), upper=1)
        mask = sb.op("Mul", upper, sb.op("Constant", value_float=float(np.finfo(np.float32).min)))
        return sb.op("Add", scores, mask)  # type: ignore[return-value]

    scores = b.if_attr("causal", masked, scores)  # type: ignore[assignment]
    o = b.op("MatMul", b.op("Softmax", scores, axis=-1), v)
    return b.op("Reshape", b.op("Transpose", o, perm=[0, 2, 1, 3]), b.const_ints([0, 0, -1]))  # type: ignore


def _group_norm(b: _Body, x: list[str]) -> str:
    """Channels-first InstanceNormalization over [B, G, C/G * H * W], as the exporters spell GroupNorm: the
    same arithmetic as the fp32 graph, and onnxruntime's fast kernel (a broadcast mean/variance over the
    NHWC view took 4x longer)."""
    xn = b.op("Transpose", x[0], perm=[0, 3, 1, 2])  # [B, C, H, W]
    groups = b.ref_ints("groups")
    grouped = b.op("Reshape", xn, b.op("Concat", b.const_ints([0]), groups, b.const_ints([-1]), axis=0))
    ones = b.op("ConstantOfShape", groups, value=helper.make_tensor("one", T.FLOAT, [1], [1.0]))
    zeros = b.op("ConstantOfShape", groups, value=helper.make_tensor("zero", T.FLOAT, [1], [0.0]))
    norm = b.op("InstanceNormalization", grouped, ones, zeros, refs={"epsilon": ("epsilon", A.FLOAT)})
    per_channel = b.const_ints([-1, 1, 1])
    y = b.op("Add", b.op("Mul", b.op("Reshape", norm, b.op("Shape", xn)), b.op("Reshape", x[1], per_channel)),
             b.op("Reshape", x[2], per_channel))
    return b.op("Transpose", b.silu_if(y), perm=[0, 2, 3, 1])  # type: ignore[return-value]


def _binary(onnx_op: str) -> Callable[[_Body, list[str]], str]:
    return lambda b, x: b.op(onnx_op, x[0], x[1])  # type: ignore[return-value]


def _unary(onnx_op: str, **attrs: object) -> Callable[[_Body, list[str]], str]:
    return lambda b, x: b.op(onnx_op, x[0], **attrs)  # type: ignore[return-value]


_OPS: list[OpDef] = [
    OpDef("SDConv", ("X", "W", "B"), ("strides", "pads", "dilations", "group", "silu"), _conv,
          "Conv2d (+ bias, + SiLU when silu=1). X: [B, H, W, C], W: [OC, KH, KW, C/group], B: [OC] -> "
          "[B, OH, OW, OC]."),
    OpDef("SDGemm", ("X", "W", "B"), (), lambda b, x: b.op("Add", b.op("MatMul", x[0], x[1]), x[2]),
          "Linear layer. X: [B, M, K] or [B, K], W: [K, N], B: [N] (zeros when the layer has no bias) -> "
          "[B, M, N]."),
    OpDef("SDMatMul", ("A", "B"), (), _binary("MatMul"),
          "Activation x activation MatMul outside attention. A: [..., M, K], B: [..., K, N]."),
    OpDef("SDMHA", ("Q", "K", "V"), ("num_heads", "scale", "causal"), _mha,
          "Multi-head attention softmax(Q Kᵀ · scale [+ causal mask]) V with the head split and merge. "
          "Q: [B, M, C], K, V: [B, N, C], num_heads: [H] -> [B, M, C]; causal=1 masks keys after the query."),
    OpDef("SDMHA_VAE", ("Q", "K", "V"), ("num_heads", "scale", "causal"), _mha,
          "The VAE's single-head attention over all pixels (AMD's name for it); same contract as SDMHA."),
    OpDef("SDLayerNorm", ("X", "G", "B"), ("epsilon",),
          lambda b, x: b.op("LayerNormalization", x[0], x[1], x[2], axis=-1,
                            refs={"epsilon": ("epsilon", A.FLOAT)}),  # type: ignore[arg-type,return-value]
          "LayerNorm over the last axis. X: [B, M, C], G, B: [C]."),
    OpDef("SDGroupNorm", ("X", "G", "B"), ("groups", "epsilon", "silu"), _group_norm,
          "GroupNorm in NHWC (+ SiLU when silu=1). X: [B, H, W, C], G, B: [C], groups: [G]."),
    OpDef("SDSilu", ("X",), (), lambda b, x: b.op("Mul", x[0], b.op("Sigmoid", x[0])), "x · sigmoid(x)."),
    OpDef("SDGelu", ("X",), ("approximate",),
          lambda b, x: b.op("Gelu", x[0], refs={"approximate": ("approximate", A.STRING)}),  # type: ignore
          "GELU, erf ('none') or tanh form."),
    OpDef("SDQuickGelu", ("X",), (),
          lambda b, x: b.op("Mul", x[0], b.op("Sigmoid", b.op("Mul", x[0], b.op("Constant", value_float=1.702)))),
          "CLIP's quick_gelu x · sigmoid(1.702 x): one vector pass, like SDSilu."),
    OpDef("SDGeGLU", ("X",), ("approximate",),
          lambda b, x: (lambda h: b.op("Mul", h[0], b.op("Gelu", h[1], refs={
              "approximate": ("approximate", A.STRING)})))(b.op("Split", x[0], axis=-1, num_outputs=2, n_out=2)),
          "The GEGLU gate: split the last axis in halves (h, g) -> h · gelu(g)."),
    OpDef("SDResize", ("X",), ("scales", "mode", "coordinate_transformation_mode", "nearest_mode"),
          lambda b, x: b.op("Resize", x[0], "", b.op("Constant", refs={"value_floats": ("scales", A.FLOATS)}),
                            refs={"mode": ("mode", A.STRING),
                                  "coordinate_transformation_mode": ("coordinate_transformation_mode", A.STRING),
                                  "nearest_mode": ("nearest_mode", A.STRING)}),  # type: ignore
          "Nearest-neighbour upsampling in NHWC; scales in NHWC order ([1, 2, 2, 1])."),
    OpDef("SDAdd", ("A", "B"), (), _binary("Add"), "Element-wise A + B with broadcasting."),
    OpDef("SDSub", ("A", "B"), (), _binary("Sub"), "Element-wise A - B (the vector unit's other ALU op)."),
    OpDef("SDMul", ("A", "B"), (), _binary("Mul"), "Element-wise A · B with broadcasting."),
    OpDef("SDDiv", ("A", "B"), (), _binary("Div"), "Element-wise A / B (scales by a constant, mostly)."),
    OpDef("SDConcat", ("A", "B"), ("axis",),
          lambda b, x: b.op("Concat", x[0], x[1], refs={"axis": ("axis", A.INT)}),  # type: ignore
          "Concatenation of two tensors (UNet skip connections, sinusoid halves)."),
    OpDef("SDSlice", ("X",), ("starts", "ends", "axes", "steps"),
          lambda b, x: b.op("Slice", x[0], b.ref_ints("starts"), b.ref_ints("ends"), b.ref_ints("axes"),
                            b.ref_ints("steps")),  # type: ignore
          "Static slice (also each output of a Split)."),
    OpDef("SDReshape", ("X",), ("shape",), lambda b, x: b.op("Reshape", x[0], b.ref_ints("shape")),  # type: ignore
          "Reshape to a static shape: no data moves, so an NPU only rewrites the tensor's descriptor. "
          "Needed because attention and projections change rank between ops."),
    OpDef("SDTranspose", ("X",), ("perm",),
          lambda b, x: b.op("Transpose", x[0], refs={"perm": ("perm", A.INTS)}),  # type: ignore
          "A data-movement transpose left inside an NPU region (the layout pass cancels most); NPUs run it "
          "as a strided DMA."),
    OpDef("SDExpand", ("X",), ("shape",), lambda b, x: b.op("Expand", x[0], b.ref_ints("shape")),  # type: ignore
          "Broadcast to a static shape (the UNet's timestep to the batch): a DMA with stride 0."),
    OpDef("SDSin", ("X",), (), _unary("Sin"),
          "Element-wise sine: the sinusoidal timestep and micro-conditioning embeddings (vector unit, LUT)."),
    OpDef("SDCos", ("X",), (), _unary("Cos"), "Element-wise cosine; see SDSin."),
    OpDef("SDSigmoid", ("X",), (), _unary("Sigmoid"), "Element-wise sigmoid where it is not part of a SiLU."),
    OpDef("SDEmbedding", ("W", "I"), (), lambda b, x: b.op("Gather", x[0], x[1], axis=0),  # type: ignore
          "Token embedding lookup: rows of the table W [V, C] at the integer ids I [B, S] -> [B, S, C]. The "
          "NPU's DMA gathers rows; the ids are the one integer input a dispatch op takes.",
          cast_inputs=(True, False)),
    OpDef("SDTokenPool", ("X", "I"), (), lambda b, x: b.op("Reshape", b.op(
        "GatherElements", x[0], b.op("Expand", b.op("Unsqueeze", b.op("ArgMax", x[1], axis=-1, keepdims=1),
                                                     b.const_ints([2])),
                                     b.op("Concat", b.op("Shape", x[0], end=1), b.const_ints([1]),
                                          b.op("Shape", x[0], start=2), axis=0)), axis=1),
        b.const_ints([0, -1])),  # type: ignore
          "CLIP's pooling: the hidden state at each sequence's highest token id (its end-of-text token). "
          "X: [B, S, C], I: [B, S] integer ids -> [B, C]. An argmax over 77 ids and a row copy.",
          cast_inputs=(True, False)),
    OpDef("SDCast", ("X",), ("to",),
          lambda b, x: b.op("Cast", x[0], refs={"to": ("to", A.INT)}),  # type: ignore
          "fp32 -> bf16 conversion inside an NPU region, where a small fp32 computation (the sinusoidal "
          "embeddings' arguments: timestep x frequency reaches 1000 rad, far beyond bf16's precision) "
          "hands over to bf16 ops. The vector unit converts; no CPU round trip.", cast_output=False),
    OpDef("SDSoftmax", ("X",), ("axis",),
          lambda b, x: b.op("Softmax", x[0], refs={"axis": ("axis", A.INT)}),  # type: ignore
          "Softmax outside attention."),
]

OPS: dict[str, OpDef] = {op.name: op for op in _OPS}
BFP_SUFFIX = "_bfp"


def _bfp_names() -> frozenset[str]:
    from sdnpu.ops.bfp import BFP_OPS

    return frozenset(f"{name}{BFP_SUFFIX}" for name in BFP_OPS)


DISPATCH_OPS: frozenset[str] = frozenset(OPS) | _bfp_names()


def cast_avx_function() -> onnx.FunctionProto:
    """CastAvx: the CPU<->NPU boundary. Transposes by ``perm`` (identity when no layout changes) and
    casts to ``to`` (fp32 <-> bf16). Runs on the CPU (AVX-512 on AMD's platform), so it is not a
    dispatch op and counts as a CPU node."""
    b = _Body()
    t = b.op("Transpose", "X", refs={"perm": ("perm", A.INTS)})
    b.nodes.append(helper.make_node("Cast", [t], ["Y"]))
    ref = onnx.AttributeProto()
    ref.name, ref.ref_attr_name, ref.type = "to", "to", A.INT
    b.nodes[-1].attribute.append(ref)
    return helper.make_function(DOMAIN, BOUNDARY_OP, ["X"], ["Y"], b.nodes, [helper.make_opsetid("", ONNX_OPSET)],
                                attributes=["to", "perm", *METADATA_ATTRS], doc_string=cast_avx_function.__doc__)


def functions_for(op_types: set[str]) -> list[onnx.FunctionProto]:
    """The reference functions a model using ``op_types`` (of domain sdnpu) must carry."""
    out = []
    for name in sorted(op_types):
        if name == BOUNDARY_OP:
            out.append(cast_avx_function())
        elif name in OPS:
            out.append(OPS[name].function())
        elif name.endswith(BFP_SUFFIX) and name[: -len(BFP_SUFFIX)] in OPS:
            from sdnpu.ops.bfp import BFP_OPS

            base = name[: -len(BFP_SUFFIX)]
            out.append(OPS[base].function(bfp=BFP_OPS[base][0]))
        else:
            raise KeyError(f"no reference body for sdnpu op {name!r}")
    return out
