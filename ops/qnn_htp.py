"""Target ``qnn-htp``: Qualcomm's Hexagon NPU (HTP) through onnxruntime's QNN execution provider
(``onnxruntime-qnn``), the NPU of Snapdragon X laptops.

Its contract is not custom ops: QNN takes standard ONNX ops within the limits its op builders check, computes
float32 graphs in fp16 (``enable_htp_fp16_precision``, HTP v73 and later), and compiles a graph into a context
binary (an EPContext model). This table is what those op builders check, read from their sources; the
compiler itself (QNN's ``libHtpPrepare.so``, shipped in the wheel) has the last word on every node, and its own
count (the EP's op trace) is written beside this one in the report.

Sources (facts only; the code is ours):

- ``QNN-EP``: onnxruntime's QNN execution provider, ``onnxruntime/core/providers/qnn/builder/`` in
  github.com/onnxruntime/onnxruntime-qnn @ cee6c0d (2026-03-13, v2.0.0: line numbers), checked against the
  strings and symbols of the 2.7.0 wheel's ``libonnxruntime_providers_qnn.so`` (what 2.7.0 added: Range,
  Softplus, Xor, variadic Max/Min/Sum, CastLike; IsInf refused on the HTP). Most limits are not the EP's: it
  builds the QNN op and asks QNN's validator, so the compiler's op trace is the final word.
- ``QNN-DOC``: the QNN execution provider's documentation (``docs/execution-providers/QNN-ExecutionProvider.md``):
  provider options, EPContext, the HTP architectures.
- ``HERE``: measured on this machine with onnxruntime-qnn 2.7.0 (QNN 2.51, the HTP emulator on x86-64):
  ``tests/test_qnn_table.py`` builds one small node of every op in the table and checks that QNN takes it with
  CPU fallback disabled, and that a node the table refuses is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sdnpu.errors import SdnpuError
from sdnpu.ops.target import NodeInfo, NodeLimit, OpSupport, StandardTarget, register

NAME = "qnn-htp"

SOURCES = {
    "QNN-EP": "onnxruntime QNN execution provider (onnxruntime-qnn 2.7.0): onnxruntime/core/providers/qnn/builder/"
              "op_builder_factory.cc, opbuilder/*_op_builder.cc, qnn_utils.cc",
    "QNN-DOC": "QNN execution provider documentation: docs/execution-providers/QNN-ExecutionProvider.md",
    "HERE": "measured here: onnxruntime 1.32 + onnxruntime-qnn 2.7.0 (QNN 2.51), HTP emulator, tests/test_qnn_table.py",
}


@dataclass(frozen=True)
class Arch:
    """One HTP generation: the ``htp_arch`` and ``soc_model`` provider options that select it (the emulator needs
    both), and the chips that carry it; with how hard QNN's compiler optimizes the graphs it builds for it
    (``optimization``: QNN's graph finalization mode, see ``OPTIMIZATIONS``; None: QNN's own default)."""

    arch: int
    soc_model: int
    chips: str
    optimization: int | None = None


# htp_arch -> soc_model: the pairs that compile and run in the emulator here (FACTS.md, 2026-12-05); v68 fails
# on a text encoder (QNN_COMMON_ERROR_MEM_ALLOC), so it is not offered.
ARCHS = {
    69: Arch(69, 36, "Snapdragon 8 Gen 1 class"),
    73: Arch(73, 60, "Snapdragon X Elite / X Plus (the Windows laptops), Snapdragon 8 Gen 2"),
    75: Arch(75, 57, "Snapdragon 8 Gen 3"),
    79: Arch(79, 69, "Snapdragon 8 Elite"),
    81: Arch(81, 87, "Snapdragon X2 Elite"),
}
DEFAULT_ARCH = 73

# QNN's graph finalization modes (the EP's ``htp_graph_finalization_optimization_mode``; QNN's HTP docs): the
# compile's time against the graph it builds. Measured here (bench/results.md, "QNN's optimization modes"): one
# attention [2, 6, 4096, 64] compiled in 5-10 s in mode 1, 44-54 s by QNN's default, 74-78 s in mode 3; but SD 3.5's
# block 13, which QNN's default compiles, ran out of the HTP's memory in mode 1. So the default stays QNN's own.
OPTIMIZATIONS = {1: "fastest compile, a less optimized graph", 2: "a longer compile, a more optimized graph",
                 3: "the longest compile, the most optimized graph (most likely)"}


def arch(value: int | str | None, optimization: int | str | None = None) -> Arch:
    """``--htp-arch``: 73, "v73" or None (the default, Snapdragon X Elite); ``--htp-optimization``: 1, 2, 3 or None
    (QNN's own default)."""
    if value is None:
        chosen = ARCHS[DEFAULT_ARCH]
    else:
        text = str(value).lower().removeprefix("v")
        if not text.isdigit() or int(text) not in ARCHS:
            raise SdnpuError(f"unknown HTP architecture {value!r}",
                             hint=f"choose one of {', '.join(f'v{a}' for a in ARCHS)} (default v{DEFAULT_ARCH}: "
                             f"{ARCHS[DEFAULT_ARCH].chips})")
        chosen = ARCHS[int(text)]
    if optimization is None:
        return chosen
    if str(optimization).strip() not in {str(k) for k in OPTIMIZATIONS}:
        raise SdnpuError(f"unknown QNN optimization mode {optimization!r}",
                         hint="choose " + "; ".join(f"{k}: {v}" for k, v in OPTIMIZATIONS.items()) +
                         " (or leave it out: QNN's own default)")
    return replace(chosen, optimization=int(str(optimization).strip()))


# --- limits: each returns why QNN's op builder refuses the node, or None --------------------------------------

def _constant(*indices: int, what: str = "") -> NodeLimit:
    def rule(info: NodeInfo) -> str | None:
        for i in indices:
            if i < len(info.inputs) and info.inputs[i] is not None and i not in info.constant:
                return f"its {what or f'input {i}'} is computed; QNN's builder takes it only as a constant"
        return None
    return rule


def _ranks(lo: int, hi: int, what: str = "input") -> NodeLimit:
    def rule(info: NodeInfo) -> str | None:
        r = info.rank(0)
        if r is not None and not lo <= r <= hi:
            return f"{what} of rank {r} (QNN takes rank {lo} to {hi})"
        return None
    return rule


def _no_rank6(info: NodeInfo) -> str | None:
    """QNN has no rank-6 Reshape or Transpose (QNN-EP qnn_node_group/reshape_transpose_rank5.h:13-22); the
    pixel shuffles that rank 6 spells are written with DepthToSpace first (``sdnpu.passes.htp``)."""
    ranks = [len(v[1]) for v in (*info.inputs[:1], *info.outputs) if v is not None and v[1] is not None]
    return f"rank {max(ranks)} (QNN has no rank-6 Reshape or Transpose)" if ranks and max(ranks) > 5 else None


def _attr_is(name: str, allowed: tuple[object, ...], default: object, why: str) -> NodeLimit:
    def rule(info: NodeInfo) -> str | None:
        value = info.attrs.get(name, default)
        if isinstance(value, bytes):
            value = value.decode()
        return None if value in allowed else f"{name}={value!r}: {why}"
    return rule


def _ones(name: str, why: str) -> NodeLimit:
    def rule(info: NodeInfo) -> str | None:
        value = info.attrs.get(name)
        return None if value is None or all(int(v) == 1 for v in value) else f"{name} {list(value)}: {why}"
    return rule


def _resize(info: NodeInfo) -> str | None:
    mode = info.attrs.get("mode", "nearest")
    if isinstance(mode, bytes):
        mode = mode.decode()
    if mode not in ("nearest", "linear"):
        return f"mode {mode!r} (QNN takes nearest and linear on the HTP; cubic is refused: measured here)"
    ctm = info.attrs.get("coordinate_transformation_mode", "half_pixel")
    if ctm not in ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "tf_half_pixel_for_nn"):
        return f"coordinate_transformation_mode {ctm!r}"
    if info.attrs.get("antialias", 0):
        return "antialias (refused)"
    x, y = info.inputs[0], info.outputs[0]
    if x is not None and x[1] is not None and y[1] is not None:
        if not 3 <= len(x[1]) <= 5:
            return f"input of rank {len(x[1])} (QNN takes rank 3 to 5)"
        if list(x[1][:2]) != list(y[1][:2]):
            return "it changes a dimension other than the spatial ones (QNN's Resize may only change those)"
    return None


def _layer_norm(info: NodeInfo) -> str | None:
    r = info.rank(0)
    axis = info.attrs.get("axis", -1)
    if r is not None and axis % r != r - 1:
        return f"axis {axis} of rank {r}: on the HTP only the last axis"
    if len(info.outputs) > 1:
        return "its mean / inverse-deviation outputs (QNN gives only the normalized one)"
    return None


_NARROW_INTS = frozenset({"INT8", "INT16", "UINT8", "UINT16", "UINT32", "UINT64"})


def _wide_ints(info: NodeInfo) -> str | None:
    """Integer arithmetic and comparisons: QNN's HTP refuses 8- and 16-bit and unsigned integer operands (measured
    here: ONNX's node tests test_add_int8, _uint8, _uint32, ... refused; _int32 and _int64 taken)."""
    for v in info.inputs:
        if v is not None and v[0] in _NARROW_INTS:
            return f"{v[0].lower()} operands (the HTP takes float, int32 and int64 ones)"
    return None


def _not_bool_data(info: NodeInfo) -> str | None:
    v = info.inputs[0] if info.inputs else None
    return "bool data (the HTP's GatherND takes int32 and float data: measured here)" if v and v[0] == "BOOL" else None


def _float_operands(info: NodeInfo) -> str | None:
    for v in info.inputs:
        if v is not None and v[0] not in ("FLOAT", "FLOAT16"):
            return f"a {v[0].lower()} operand (the HTP's Pow takes float ones: measured here)"
    return None


def _two_or_more(info: NodeInfo) -> str | None:
    return None if len([i for i in info.inputs if i is not None]) >= 2 else "one operand (QNN folds two or more)"


def _static_output(info: NodeInfo) -> str | None:
    """QNN lowers Reshape, Squeeze and Unsqueeze to its Reshape by the static output shape (reshape_op_builder.cc):
    the shape or axes input may be computed where the output's shape is known."""
    out = info.outputs[0] if info.outputs else None
    return None if out is not None and out[1] is not None else "its output shape is not static"


def _attention(info: NodeInfo) -> str | None:
    """ONNX's Attention (opset 23): decomposed on the HTP (onnxruntime-qnn 2.7.0, PR 651)."""
    r = info.rank(0)
    if r not in (3, 4):
        return f"Q of rank {r} (QNN takes rank 3 or 4)"
    if len(info.inputs) > 3 and info.inputs[3] is not None and info.inputs[3][0] == "BOOL":
        return "a boolean mask (QNN takes an additive float one)"
    if info.attrs.get("softmax_precision") or (len(info.inputs) > 6 and info.inputs[6] is not None):
        return "softmax_precision or nonpad_kv_seqlen (refused by QNN)"
    return None


def _einsum(info: NodeInfo) -> str | None:
    if len([i for i in info.inputs if i is not None]) < 2:
        return "one operand (QNN's Einsum takes the matrix-product forms, two operands)"
    eq = str(info.attrs.get("equation", "")).replace(" ", "")
    lhs, _, out = eq.partition("->")
    if out and "." not in eq and set(lhs.replace(",", "")) <= set(out):
        return (f"equation {eq}: no index summed (an outer or element-wise product; QNN takes the matrix-product "
                "forms: 'i,j->ij' refused, \"Einsum unsupported equation\", measured on Flux.1's TorchScript rotary)")
    return None


_EW = "QNN-EP builder/opbuilder/simple_op_builder.cc (the element-wise map: base_op_builder.h:132-237)"
_HERE = "; integer limits measured here (bench/bench_qnn_table.py)"

TABLE: tuple[OpSupport, ...] = (
    # element-wise: no checks in the EP; QNN's own validation and broadcasting decide
    OpSupport("Sqrt", _EW + "; rank 5 refused (\"Failed to add node\"), rank 4 taken: measured here",
              (_ranks(0, 4),)),
    *(OpSupport(op, _EW) for op in (
        "Neg", "Abs", "Exp", "Log", "Sin", "Cos", "Tanh", "Sigmoid", "Relu", "Gelu", "Elu", "LeakyRelu",
        "HardSigmoid", "HardSwish", "PRelu", "Floor", "Ceil", "Round", "Sign", "Where", "And", "Or", "Xor", "Atan")),
    *(OpSupport(op, _EW + _HERE, (_wide_ints,)) for op in (
        "Add", "Sub", "Mul", "Div", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual")),
    *(OpSupport(op, _EW + " (2.7.0: two or more operands, folded)" + _HERE, (_wide_ints, _two_or_more))
      for op in ("Min", "Sum")),
    OpSupport("Max", _EW + " (2.7.0: two or more operands, folded)" + _HERE + "; rank 5 refused",
              (_wide_ints, _two_or_more, _ranks(0, 4))),
    OpSupport("Pow", _EW + _HERE, (_float_operands,)),
    OpSupport("Identity", "QNN-EP op_builder_factory.cc (Identity)"),
    OpSupport("Constant", "HERE (no computation): onnxruntime makes it an initializer before QNN sees the graph "
              "(sdnpu lifts them too, but for a graph output written by one)"),
    OpSupport("Shape", "QNN-EP 2.7.0 (Shape: input rank >= 1)"),
    OpSupport("Attention", "QNN-EP 2.7.0 (ONNX Attention, opset 23: decomposed on the HTP)", (_attention,)),
    OpSupport("RMSNormalization", "QNN-EP opbuilder/rmsnormalization_op_builder.cc:40-72", (_ranks(0, 4),)),
    OpSupport("GridSample", "QNN-EP simple_op_builder.cc (GridSample)"),
    *(OpSupport(op, "QNN-EP opbuilder/pool_op_builder.cc") for op in ("AveragePool", "GlobalAveragePool",
                                                                       "GlobalMaxPool")),
    OpSupport("MaxPool", "QNN-EP opbuilder/pool_op_builder.cc (no 3-D MaxPool on the HTP)", (_ranks(3, 4),)),
    OpSupport("Reciprocal", "QNN-EP opbuilder/reciprocal_op_builder.cc:35-41 (as Div(1, x))"),
    OpSupport("Softplus", "QNN-EP simple_op_builder.cc (2.7.0: 'QNN EP does not support Softplus with input rank "
              "> 4')", (_ranks(0, 4),)),
    OpSupport("Mod", "QNN-EP opbuilder/mod_op_builder.cc:33-51" + _HERE,
              (_attr_is("fmod", (0,), 0, "QNN takes fmod 0"), _wide_ints)),
    OpSupport("Clip", "QNN-EP opbuilder/clip_op_builder.cc:145-160" + _HERE, (_constant(1, 2, what="min/max"),
                                                                            _wide_ints)),
    OpSupport("IsNaN", "QNN-EP opbuilder/isnan_op_builder.cc:42-62"),
    OpSupport("Cast", "QNN-EP opbuilder/cast_op_builder.cc:36-58 (no bfloat16, no float64: the type map)"),
    OpSupport("CastLike", "QNN-EP opbuilder/cast_op_builder.cc (2.7.0)"),
    # linear algebra
    OpSupport("Conv", "QNN-EP opbuilder/conv_op_builder.cc:74-124", (_ranks(3, 5),)),
    OpSupport("ConvTranspose", "QNN-EP opbuilder/conv_op_builder.cc:102-124, :880-960",
              (_ranks(3, 5), _ones("dilations", "QNN's TransposeConv2d takes dilations 1"))),
    OpSupport("MatMul", "QNN-EP opbuilder/matmul_op_builder.cc:13-85 (FullyConnected for a rank-2 constant weight)"),
    OpSupport("Gemm", "QNN-EP opbuilder/gemm_op_builder.cc (alpha 1, beta 0 or 1)",
              (_attr_is("alpha", (1.0,), 1.0, "QNN takes alpha 1"), _attr_is("beta", (0.0, 1.0), 1.0,
                                                                                  "QNN takes beta 0 or 1"))),
    OpSupport("Einsum", "QNN-EP opbuilder/einsum_op_builder.cc (five matrix-product equation forms)", (_einsum,)),
    # normalizations, softmax, reductions
    OpSupport("LayerNormalization", "QNN-EP opbuilder/layernormalization_op_builder.cc:36-58, :86-100",
              (_layer_norm,)),
    OpSupport("GroupNormalization", "QNN-EP opbuilder/groupnormalization_op_builder.cc:36-95"),
    OpSupport("InstanceNormalization", "QNN-EP opbuilder/instancenormalization_op_builder.cc:52-74",
              (_ranks(3, 4),)),
    OpSupport("BatchNormalization", "QNN-EP opbuilder/batchnormalization_op_builder.cc:701-743",
              (_ranks(0, 4), _constant(1, 2, 3, 4, what="scale/bias/mean/var"))),
    OpSupport("LpNormalization", "QNN-EP simple_op_builder.cc:380-391", (_attr_is("p", (2,), 2, "QNN takes p=2"),)),
    OpSupport("Softmax", "QNN-EP opbuilder/softmax_op_builder.cc:62-140 (a non-last axis: Transposes around it)"),
    OpSupport("LogSoftmax", "QNN-EP opbuilder/softmax_op_builder.cc:62-140"),
    *(OpSupport(op, "QNN-EP opbuilder/reduce_op_builder.cc:77-160 (axes an attribute, or a constant input)",
                (_constant(1, what="axes input"),)) for op in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin")),
    OpSupport("ReduceL2", "QNN-EP opbuilder/reduce_op_builder.cc:77-160; rank 5 refused (\"CreateQnnNode failed\": "
              "a 3-D VAE's F.normalize over channels), ranks 3 and 4 taken: measured here",
              (_constant(1, what="axes input"), _ranks(0, 4))),
    # data movement
    *(OpSupport(op, "QNN-EP opbuilder/reshape_op_builder.cc:32-66", (_no_rank6, _static_output))
      for op in ("Reshape", "Squeeze", "Unsqueeze")),
    OpSupport("Flatten", "QNN-EP opbuilder/reshape_op_builder.cc:32-66", (_no_rank6,)),
    OpSupport("Transpose", "QNN-EP opbuilder/transpose_op_builder.cc:29-80", (_no_rank6,)),
    OpSupport("Concat", "QNN-EP opbuilder/concat_op_builder.cc:60-100"),
    OpSupport("Split", "QNN-EP opbuilder/split_op_builder.cc:74-110", (_constant(1, what="split input"),)),
    OpSupport("Slice", "QNN-EP opbuilder/slice_op_builder.cc:158-216",
              (_constant(1, 2, 3, 4, what="starts/ends/axes/steps"),)),
    OpSupport("Gather", "QNN-EP opbuilder/gather_op_builder.cc:128-215; rank 6 refused (\"Failed to add node\": "
              "HiDream's rotary), rank 5 taken: measured here", (_ranks(0, 5),)),
    OpSupport("GatherElements", "QNN-EP opbuilder/gather_op_builder.cc:53-66"),
    OpSupport("GatherND", "QNN-EP opbuilder/gather_op_builder.cc; batch_dims and bool data measured here (\"Failed "
              "to create GatherND node\": Qwen2's padding mask; int32 and float data taken)",
              (_attr_is("batch_dims", (0,), 0, "QNN takes batch_dims 0"), _not_bool_data)),
    OpSupport("Expand", "QNN-EP opbuilder/expand_op_builder.cc:54-140 (a Mul by ones)",
              (_constant(1, what="shape input"),)),
    OpSupport("Tile", "QNN-EP opbuilder/tile_op_builder.cc:47", (_constant(1, what="repeats input"),)),
    OpSupport("Pad", "QNN-EP opbuilder/pad_op_builder.cc:57-261",
              (_ranks(0, 5), _constant(1, 2, what="pads"),
               _attr_is("mode", ("constant", "reflect", "edge"), "constant", "QNN takes constant, reflect, edge"))),
    OpSupport("Resize", "QNN-EP opbuilder/resize_op_builder.cc:69-292", (_resize,)),
    OpSupport("DepthToSpace", "QNN-EP simple_op_builder.cc:158-193 (DCR or CRD)"),
    OpSupport("SpaceToDepth", "QNN-EP simple_op_builder.cc:158-193"),
    OpSupport("ScatterND", "QNN-EP simple_op_builder.cc:60-65, :119-125",
              (_attr_is("reduction", ("none", "add", "mul"), "none", "QNN takes none, add and mul"),)),
    OpSupport("CumSum", "QNN-EP opbuilder/cumsum_op_builder.cc:70-85",
              (_constant(1, what="axis input"), _attr_is("exclusive", (0,), 0, "QNN takes exclusive 0"),
               _attr_is("reverse", (0,), 0, "QNN takes reverse 0"))),
    OpSupport("TopK", "QNN-EP opbuilder/topk_op_builder.cc:50-100", (_constant(1, what="k input"),)),
    OpSupport("ArgMax", "QNN-EP opbuilder/argmax_argmin_op_builder.cc:33-60",
              (_attr_is("select_last_index", (0,), 0, "QNN takes select_last_index 0"),)),
    OpSupport("ArgMin", "QNN-EP opbuilder/argmax_argmin_op_builder.cc:33-60",
              (_attr_is("select_last_index", (0,), 0, "QNN takes select_last_index 0"),)),
    OpSupport("Range", "QNN-EP range_op_builder.cc (2.7.0: constant scalar inputs, computed offline)",
              (_constant(0, 1, 2, what="start/limit/delta"),)),
)

_CPU_REASONS = {
    "Not": "Not: refused on the HTP (measured here: ONNX's test_not_2d/3d/4d)",
    "Asin": "Asin: refused on the HTP (measured here: ONNX's test_asin)",
    "Erf": "Erf: no QNN op builder outside the GELU pattern (Div, Erf, Add, Mul, Mul 0.5), which QNN fuses",
    "ReduceProd": "ReduceProd: refused on the HTP backend (reduce_op_builder.cc:167-168)",
    "IsInf": "IsInf: refused on the HTP backend (graph finalize fails, QNN_COMMON_ERROR_MEM_ALLOC)",
    "Trilu": "Trilu: no QNN op builder",
    "Mish": "Mish: no QNN op builder",
}

# ONNX element types QNN maps (QNN-EP qnn_utils.cc:812-843, OnnxDataTypeToQnnDataType); float32 computes in fp16
# (enable_htp_fp16_precision); int64 is cast to int32 on the way in
DTYPES = frozenset({"FLOAT", "FLOAT16", "INT8", "UINT8", "INT16", "UINT16", "INT32", "UINT32", "INT64", "UINT64",
                    "BOOL"})


# One QNN context binary lives in the HTP's 32-bit address space: about 3.5 GB with its working memory (Qualcomm's
# docs and issues; FACTS.md). A compiled context measured 1.0x its fp16 weights here (sd-turbo's UNet: 1.74 GB, at
# 512 px), and the first half of the SDXL UNet at 1024 px and batch 2 (2.59 GB of fp16 weights, its attention
# scores 0.67 GB a layer) failed to compile for the HTP's memory (QNN_COMMON_ERROR_MEM_ALLOC): 2 GB of weights a
# context leaves room for the activations; a piece QNN still cannot fit is cut in two (sdnpu.convert.standard).
CONTEXT_GB = 2.0
CONTEXT_WHY = ("one QNN context lives in the HTP's 32-bit address space (about 3.5 GB with its weights and "
               "activations); a context measured 1.0x its fp16 weights here")


def build() -> StandardTarget:
    return StandardTarget(
        name=NAME, doc=__doc__ or "", precisions=("fp16",), out_dir="qnn", backend="sdnpu.backends.qnn_htp",
        counted_by="QNN's own op trace (the EP's enable_framework_op_trace), beside sdnpu's count by this table",
        sources=SOURCES, cpu_reasons=_CPU_REASONS, ops={s.op_type: s for s in TABLE}, dtypes=DTYPES,
        unit_gb=CONTEXT_GB, unit_why=CONTEXT_WHY,
        dtype_reason="QNN does not map it (bfloat16: \"Failed to map Onnx data type to Qnn data type\"; float64: "
                     "refused by some ops, e.g. Expand, and a float64 value between QNN partitions fails the graph, "
                     "error 7004, so sdnpu computes float64 in float32)")


register(NAME, build)
