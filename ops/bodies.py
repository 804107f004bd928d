"""Reference bodies: every dispatch op of a target is also a model-local ONNX function, so stock onnxruntime
runs a dispatch model on any CPU, and an NPU runtime that registers the op claims it by name instead.

A body casts its inputs to fp32, reshapes each activation to the view its attributes name (``input_shape``,
``a_shape``: that is how a Reshape in front of the op is absorbed), computes, and casts the result back to
the type of its first input (``CastLike``). Fed fp32 (before the precision pass) an op computes in fp32
exactly like the subgraph it replaced; fed bf16 it rounds its output to bf16 once, as a kernel does at its
output. A ``_bfp`` variant first rounds its activations to BFP16 (``sdnpu.ops.bfp``), as the NPU's
bfp16ebs8 kernels see them. Dummy inputs (AMD's kernels take a buffer they do not read) are ignored.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import AttributeProto as A
from onnx import TensorProto as T
from onnx import helper

from sdnpu.ops import bfp
from sdnpu.ops.target import FLOAT, INT, INTS, STRING, STRINGS, Input, OpSpec, DispatchTarget

ONNX_OPSET = 20  # what the bodies are written against
_ATTR_TYPES = {INT: A.INT, INTS: A.INTS, FLOAT: A.FLOAT, STRING: A.STRING, STRINGS: A.STRINGS}


class Body:
    """A tiny builder for function bodies: ``b.op("Add", x, y)`` returns the output name."""

    def __init__(self, prefix: str = "_t") -> None:
        self.nodes: list[onnx.NodeProto] = []
        self._n = 0
        self._prefix = prefix

    def op(self, op_type: str, *inputs: str, n_out: int = 1, refs: dict[str, tuple[str, int]] | None = None,
           **attrs: object) -> str:
        outs = self.op_n(op_type, *inputs, n_out=n_out, refs=refs, **attrs)
        return outs[0]

    def op_n(self, op_type: str, *inputs: str, n_out: int = 1, refs: dict[str, tuple[str, int]] | None = None,
             **attrs: object) -> list[str]:
        outs = [f"{self._prefix}{self._n}_{i}" for i in range(n_out)]
        self._n += 1
        node = helper.make_node(op_type, list(inputs), outs, **attrs)
        for attr_name, (ref_name, attr_type) in (refs or {}).items():
            a = onnx.AttributeProto()
            a.name, a.ref_attr_name, a.type = attr_name, ref_name, attr_type
            node.attribute.append(a)
        self.nodes.append(node)
        return outs

    def ints(self, values: list[int]) -> str:
        return self.op("Constant", value_ints=values)

    def ref_ints(self, attr: str) -> str:
        return self.op("Constant", refs={"value_ints": (attr, A.INTS)})

    def ref_int(self, attr: str) -> str:
        """An INT attribute as a 1-element int64 tensor."""
        return self.op("Reshape", self.op("Constant", refs={"value_int": (attr, A.INT)}), self.ints([1]))

    def f32(self, x: str) -> str:
        return self.op("Cast", x, to=T.FLOAT)

    def when(self, attr: str, value: str, then: Callable[[Body], str], otherwise: str) -> str:
        """``then(body)`` when the STRING attribute ``attr`` equals ``value``, else ``otherwise``. An ``If``:
        only the taken branch runs."""
        cond = self.op("Equal", self.op("Constant", refs={"value_string": (attr, A.STRING)}),
                       self.op("Constant", value=helper.make_tensor("v", T.STRING, [], [value.encode()])))
        n = self._n
        sub = Body(prefix=f"{self._prefix}{n}_{attr}_")
        y = then(sub)
        out_on, out_off = f"{self._prefix}{n}_{attr}_on", f"{self._prefix}{n}_{attr}_off"
        sub.nodes.append(helper.make_node("Identity", [y], [out_on]))
        on = helper.make_graph(sub.nodes, f"{attr}_on", [], [helper.make_tensor_value_info(out_on, T.FLOAT, None)])
        off = helper.make_graph([helper.make_node("Identity", [otherwise], [out_off])], f"{attr}_off", [],
                                [helper.make_tensor_value_info(out_off, T.FLOAT, None)])
        return self.op("If", cond, then_branch=on, else_branch=off)

    def view(self, x: str, attr: str) -> str:
        return self.op("Reshape", x, self.ref_ints(attr))


def _silu(b: Body, y: str) -> str:
    return b.op("Mul", y, b.op("Sigmoid", y))


def _conv(b: Body, x: list[str]) -> str:
    xn = b.op("Transpose", x[0], perm=[0, 3, 1, 2])
    wn = b.op("Transpose", x[1], perm=[0, 3, 1, 2])  # OHWI -> OIHW
    y = b.op("Conv", xn, wn, x[2], refs={"strides": ("strides", A.INTS), "pads": ("pads", A.INTS),
                                         "dilations": ("dilations", A.INTS), "group": ("group", A.INT)})
    return b.op("Transpose", y, perm=[0, 2, 3, 1])


def _gemm(b: Body, x: list[str]) -> str:
    y = b.op("Add", b.op("MatMul", x[0], x[1]), x[2])
    return b.when("nonlinear", "Gelu", lambda s: s.op("Gelu", y), y)


def _matmul(b: Body, x: list[str]) -> str:
    return b.op("MatMul", x[0], x[1])


def _mha(b: Body, x: list[str]) -> str:
    """Q [B, M, K], K and V [B, N, K] (their views, made in ``function``), mask [L]."""
    s = b.ref_ints("input_shape")
    heads = b.ref_int("num_heads")

    def split(t: str, lead: list[int], perm: list[int]) -> str:
        shape = b.op("Concat", b.op("Gather", s, b.ints(lead)), heads, b.ints([-1]), axis=0)
        return b.op("Transpose", b.op("Reshape", t, shape), perm=perm)

    qh, kh, vh = split(x[0], [0, 1], [0, 2, 1, 3]), split(x[1], [0, 3], [0, 2, 3, 1]), split(x[2], [0, 3], [0, 2, 1, 3])
    head_dim = b.op("Cast", b.op("Div", b.op("Gather", s, b.ints([2])), heads), to=T.FLOAT)
    scale = b.op("Reciprocal", b.op("Sqrt", head_dim))
    mask = b.op("Slice", x[3], b.ints([0]), b.op("Gather", s, b.ints([3])))  # the first N entries
    scores = b.op("Add", b.op("Mul", b.op("MatMul", qh, kh), scale), mask)
    o = b.op("MatMul", b.op("Softmax", scores, axis=-1), vh)
    return b.op("Reshape", b.op("Transpose", o, perm=[0, 2, 1, 3]), b.op("Gather", s, b.ints([0, 1, 2])))


def _layer_norm(b: Body, x: list[str]) -> str:
    return b.op("LayerNormalization", x[0], x[1], x[2], axis=-1, refs={"epsilon": ("epsilon", A.FLOAT)})


def _rms_norm(b: Body, x: list[str]) -> str:
    """X / sqrt(mean(X^2, last axis) + epsilon) * scale, as the exporters spell torch's RMSNorm."""
    mean = b.op("ReduceMean", b.op("Mul", x[0], x[0]), b.ints([-1]), keepdims=1)
    eps = b.op("Constant", refs={"value_float": ("epsilon", A.FLOAT)})
    return b.op("Mul", b.op("Mul", x[0], b.op("Reciprocal", b.op("Sqrt", b.op("Add", mean, eps)))), x[1])


def _group_norm(b: Body, x: list[str]) -> str:
    """GroupNorm as the exporters spell it: InstanceNormalization over [B, G, C/G * H * W] (channels first)
    is onnxruntime's fast kernel; gamma and beta are the two halves of wts."""
    xn = b.op("Transpose", x[0], perm=[0, 3, 1, 2])  # [B, C, H, W]
    gamma, beta = b.op_n("Split", x[1], axis=0, num_outputs=2, n_out=2)
    groups = b.ref_int("groups")
    grouped = b.op("Reshape", xn, b.op("Concat", b.ints([0]), groups, b.ints([-1]), axis=0))
    ones = b.op("ConstantOfShape", groups, value=helper.make_tensor("one", T.FLOAT, [1], [1.0]))
    zeros = b.op("ConstantOfShape", groups, value=helper.make_tensor("zero", T.FLOAT, [1], [0.0]))
    norm = b.op("InstanceNormalization", grouped, ones, zeros, refs={"epsilon": ("epsilon", A.FLOAT)})
    per_channel = b.ints([-1, 1, 1])
    y = b.op("Add", b.op("Mul", b.op("Reshape", norm, b.op("Shape", xn)), b.op("Reshape", gamma, per_channel)),
             b.op("Reshape", beta, per_channel))
    y = b.when("nonlinear", "Silu", lambda sb: _silu(sb, y), y)
    return b.op("Transpose", y, perm=[0, 2, 3, 1])


def _resize(b: Body, x: list[str]) -> str:
    return b.op("Resize", x[0], "", "", b.ref_ints("c_shape"), mode="nearest",
                coordinate_transformation_mode="asymmetric", nearest_mode="floor")


def _slice(b: Body, x: list[str]) -> str:
    """The leading ``output_shape`` elements of each axis (the kernel has no offsets; see the table)."""
    out = b.ref_ints("output_shape")
    return b.op("Slice", x[0], b.op("Mul", out, b.ints([0])), out)


BODIES: dict[str, Callable[[Body, list[str]], str]] = {
    "SDConv": _conv, "SDGemm": _gemm, "SDMatMul": _matmul, "SDMHA": _mha, "SDFlatMHA": _mha, "SDMHA_VAE": _mha,
    "SDLayerNorm": _layer_norm, "SDRMSNorm": _rms_norm, "SDGroupNorm": _group_norm,
    "SDSilu": lambda b, x: _silu(b, x[0]),
    "SDGelu": lambda b, x: b.op("Gelu", x[0], refs={"approximate": ("approximate", A.STRING)}),
    "SDResize": _resize,
    "SDAdd": lambda b, x: b.op("Add", x[0], x[1]),
    "SDMul": lambda b, x: b.op("Mul", x[0], x[1]),
    "SDConcat": lambda b, x: b.op("Concat", x[0], x[1], refs={"axis": ("axis", A.INT)}),
    "SDSlice": _slice,
}
_MHA_OPS = frozenset({"SDMHA", "SDFlatMHA", "SDMHA_VAE"})
# String attributes with a default: nodes carry them only where they apply (AMD writes `nonlinear` only
# on fused nodes); the function's default makes the body's reference valid without it.
_DEFAULTS = {"nonlinear": ""}


def _bfp_round(b: Body, x: str, axis_last: bool = True) -> str:
    if axis_last:
        return bfp.body(b, x)
    t = b.op("Transpose", x, perm=[0, 2, 1])  # [B, N, K] -> [B, K, N]: blocks along N (P·V reduces over N)
    return b.op("Transpose", bfp.body(b, t), perm=[0, 2, 1])


def function(target: DispatchTarget, spec: OpSpec, bfp: bool = False) -> onnx.FunctionProto:
    """The reference function of ``spec`` (its ``_bfp`` variant with ``bfp``)."""
    b = Body()
    xs: list[str] = []
    views = dict((i, a) for a, i in spec.views)
    for i, inp in enumerate(spec.inputs):
        x = b.f32(inp.name) if inp.role != "dummy" else inp.name
        if i in views:
            x = b.view(x, views[i])
        xs.append(x)
    if spec.op_type in _MHA_OPS:  # views from input_shape [B, M, K, N]: Q [B, M, K], K and V [B, N, K]
        s = b.ref_ints("input_shape")
        q_shape, kv_shape = b.op("Gather", s, b.ints([0, 1, 2])), b.op("Gather", s, b.ints([0, 3, 2]))
        xs[:3] = [b.op("Reshape", xs[0], q_shape), b.op("Reshape", xs[1], kv_shape),
                  b.op("Reshape", xs[2], kv_shape)]
        if bfp:  # Q·Kᵀ reduces over K, P·V over N
            xs[:3] = [_bfp_round(b, xs[0]), _bfp_round(b, xs[1]), _bfp_round(b, xs[2], axis_last=False)]
    elif bfp:
        xs[0] = _bfp_round(b, xs[0])  # SDConv X [B, H, W, C] along C; SDGemm X [B, M, K] along K
    y = BODIES[spec.op_type](b, xs)
    b.nodes.append(helper.make_node("CastLike", [y, spec.inputs[0].name], ["Y"]))
    name = spec.bfp if bfp and spec.bfp else spec.op_type
    required = [a.name for a in spec.attrs if a.name not in _DEFAULTS]
    fn = helper.make_function(target.domain, name, [i.name for i in spec.inputs], ["Y"], b.nodes,
                              [helper.make_opsetid("", ONNX_OPSET)], attributes=required,
                              doc_string=spec.doc + (" BFP16 variant: activations rounded to bfp16ebs8 first." if bfp
                                                     else ""))
    for a in spec.attrs:
        if a.name in _DEFAULTS:
            fn.attribute_proto.append(helper.make_attribute(a.name, _DEFAULTS[a.name]))
    return fn


def boundary_function(target: DispatchTarget) -> onnx.FunctionProto:
    """CastAvx: Cast to ``to``. Runs on the CPU (AVX on AMD's platform)."""
    b = Body()
    b.op("Cast", "X", refs={"to": ("to", A.INT)})
    b.nodes[-1].output[0] = "Y"
    return helper.make_function(target.domain, target.boundary.op_type, ["X"], ["Y"], b.nodes,
                                [helper.make_opsetid("", ONNX_OPSET)], attributes=["to"],
                                doc_string=target.boundary.doc)


def functions_for(target: DispatchTarget, op_types: set[str]) -> list[onnx.FunctionProto]:
    """The reference functions a model using ``op_types`` (of the target's domain) must carry."""
    bfp_of = {spec.bfp: spec for spec in target.ops.values() if spec.bfp}
    out = []
    for name in sorted(op_types):
        if name == target.boundary.op_type:
            out.append(boundary_function(target))
        elif name in target.ops:
            out.append(function(target, target.ops[name]))
        elif name in bfp_of:
            out.append(function(target, bfp_of[name], bfp=True))
        else:
            raise KeyError(f"no reference body for {target.domain} op {name!r}")
    return out


def dummy(spec_input: object) -> np.ndarray:
    """The zero buffer for a dummy input (AMD's test models use zeros)."""
    assert isinstance(spec_input, Input)
    dtypes = {"float": np.float32, "uint8": np.uint8, "uint16": np.uint16}
    return np.zeros(spec_input.dummy_shape, dtype=dtypes[spec_input.dtype])
