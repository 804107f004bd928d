"""Precision: dispatch ops take and give bf16; constants are stored as the target's table says; a CastAvx
at every CPU<->NPU edge.

- every constant a dispatch op reads is stored in its table dtype (``Input.dtype``): bf16 for weights,
  masks and constant operands, fp32 where the kernel takes fp32 (SDConv's bias); dummy buffers keep theirs.
  Converted offline and lazily, once per tensor even when several ops share it;
- an fp32 (or fp16) activation entering a dispatch op gets one ``CastAvx(to=bf16)``, shared by all its NPU
  readers; a bf16 value read by the CPU or leaving the graph gets one ``CastAvx`` back to the type it had
  (fp32, or fp16 in an fp16 export);
- ``mode="bfp16"``: AMD's numerics. SDConv and SDGemm weights are rounded as AMD's packer writes them
  (bfp16ebs8 blocks of 8 along the input channels / K, zero-padded to whole blocks, truncated), and an op
  with a ``_bfp`` variant becomes it where every activation's view has its last two axes in multiples of 8
  (AMD's ``is_bfp_supported_shape``): its body rounds the activations too.

bf16 -> fp32 -> bf16 is exact, so dispatch ops feeding dispatch ops need no casts at all.
"""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from sdnpu.errors import SdnpuError
from sdnpu.ops.target import OpSpec, Target
from sdnpu.passes.irutil import Builder, static_shape
from sdnpu.passes.provenance import step
from sdnpu.passes.manager import PassResult

RULE = "PrecisionPass"
BF16 = ir.DataType.BFLOAT16
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
PRECISIONS = ("bf16", "bfp16")


def _cast_avx(b: Builder, target: Target, x: ir.Value, to: ir.DataType) -> ir.Value:
    return b.op(target.boundary.op_type, [x], {"to": int(to)}, domain=target.domain, dtype=to,
                shape=static_shape(x)).outputs[0]


def bfp_variant_fits(spec: OpSpec, node: ir.Node) -> bool:
    """AMD's is_bfp_supported_shape for every activation: rank >= 2, last two axes multiples of 8."""
    attrs = {k: a.value for k, a in node.attributes.items()}
    views = spec.input_views(attrs)
    return bool(views) and all(len(s) >= 2 and s[-1] % 8 == 0 and s[-2] % 8 == 0 for s in views.values())


def precision(model: ir.Model, target: Target, mode: str = "bf16") -> PassResult:
    if mode not in PRECISIONS:
        raise SdnpuError(f"unknown precision {mode!r}", hint=f"choose one of: {', '.join(PRECISIONS)}")
    graph = model.graph
    counts: Counter[str] = Counter()
    constants: dict[tuple[int, str, int | None], ir.Value] = {}
    entries: dict[int, ir.Value] = {}
    own_type: dict[int, ir.DataType] = {}  # each dispatch output's type before it became bf16
    for node in list(graph):
        if not target.is_dispatch(node.domain, node.op_type):
            continue
        spec = target.spec(node.op_type)
        if mode == "bfp16" and spec.bfp:
            if bfp_variant_fits(spec, node):
                node.op_type = spec.bfp
                node.attributes["in_dtypes"] = ir.AttrStrings("in_dtypes", list(spec.bfp_in_dtypes))
                counts["ops -> _bfp"] += 1
            else:
                counts["kept bf16 (activations not in blocks of 8)"] += 1
        b = Builder(graph, RULE, target)
        for i, v in enumerate(node.inputs):
            if v is None or i >= len(spec.inputs):
                continue
            role = spec.inputs[i]
            if v.const_value is not None:
                if role.role == "dummy" or v.dtype not in _FLOATS:
                    continue
                axis = role.block_axis if mode == "bfp16" else None  # the table: SDConv OHWI along I, SDGemm along K
                key = (id(v), role.dtype, axis)
                if key not in constants:
                    shape = list(static_shape(v) or [])
                    if role.dtype == "float":
                        if v.dtype == ir.DataType.FLOAT:
                            constants[key] = v
                        else:
                            constants[key] = b.derived(v, [step("astype", dtype="float32")], shape, f"{v.name}_f32",
                                                       dtype=ir.DataType.FLOAT)
                    elif axis is None:
                        constants[key] = b.derived(v, [step("bf16")], shape, f"{v.name}_bf16", dtype=BF16)
                        counts["constants -> bf16"] += 1
                    else:
                        constants[key] = b.derived(v, [step("bfp16", axis=axis)], shape,
                                                   f"{v.name}_bfp16", dtype=BF16)
                        counts["weights -> bfp16 (stored bf16)"] += 1
                node.replace_input_with(i, constants[key])
            elif v.dtype in _FLOATS:
                if id(v) not in entries:
                    entries[id(v)] = _cast_avx(b, target, v, BF16)
                    graph.insert_before(node, b.nodes[-1:])
                    counts["CastAvx in"] += 1
                node.replace_input_with(i, entries[id(v)])
        for out in node.outputs:
            if out.dtype in _FLOATS:
                own_type[id(out)] = out.dtype
            out.dtype = BF16
    # Exits: bf16 values read by the CPU or leaving the graph.
    for node in list(graph):
        if not target.is_dispatch(node.domain, node.op_type):
            continue
        for out in node.outputs:
            cpu_uses = [u for u in out.uses() if not target.is_dispatch(u.node.domain, u.node.op_type)
                        and not target.is_boundary(u.node.domain, u.node.op_type)]
            if not cpu_uses and not out.is_graph_output():
                continue
            b = Builder(graph, RULE, target)
            back = _cast_avx(b, target, out, own_type.get(id(out), ir.DataType.FLOAT))
            graph.insert_after(node, b.nodes)
            for use in cpu_uses:
                use.node.replace_input_with(use.idx, back)
            if out.is_graph_output():
                name = out.name
                graph.outputs[graph.outputs.index(out)] = back
                out.name = f"{name}_bf16"
                back.name = name
            counts["CastAvx out"] += 1
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
