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
from sdnpu.formats.keys import BF16_ONLY_TAG, RULE_TAG
from sdnpu.ops.target import OpSpec, DispatchTarget
from sdnpu.passes.irutil import Builder, static_shape
from sdnpu.passes.manager import PassResult
from sdnpu.passes.provenance import step

RULE = "PrecisionPass"
BF16 = ir.DataType.BFLOAT16
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)
PRECISIONS = ("bf16", "bfp16")


def _cast_avx(b: Builder, target: DispatchTarget, x: ir.Value, to: ir.DataType) -> ir.Value:
    return b.op(target.boundary.op_type, [x], {"to": int(to)}, domain=target.domain, dtype=to,
                shape=static_shape(x)).outputs[0]


def bfp_variant_fits(spec: OpSpec, node: ir.Node) -> bool:
    """AMD's is_bfp_supported_shape for every activation: rank >= 2, last two axes multiples of 8."""
    attrs = {k: a.value for k, a in node.attributes.items()}
    views = spec.input_views(attrs)
    return bool(views) and all(len(s) >= 2 and s[-1] % 8 == 0 and s[-2] % 8 == 0 for s in views.values())


# CPU ops onnxruntime runs on bf16 tensors, exactly (they only move bits): between dispatch ops they need no
# cast. (Its CPU provider has no bf16 Relu, Clip with a bound, Max or Where: a ReLU between two dispatch ops
# costs a cast each way.)
_BF16_CPU = frozenset({"Slice", "Split", "Reshape", "Transpose", "Gather", "Concat", "Identity"})
_SHAREABLE = frozenset({"Slice", "Reshape", "Transpose"})  # moved onto a cast value only where the cast is shared


def _data_inputs(p: ir.Node) -> list[ir.Value | None]:
    if p.op_type == "Concat":
        return list(p.inputs)
    return [p.inputs[0]]


def _movable(p: ir.Node | None) -> bool:
    """A CPU op of ``_BF16_CPU`` with constant parameters (what to slice, the shape, the indices)."""
    if p is None or p.op_type not in _BF16_CPU or p.domain not in ("", "ai.onnx"):
        return False
    data = _data_inputs(p)
    params = [w for w in p.inputs if w is not None and w not in data]
    return all(w is not None for w in data) and all(w.const_value is not None for w in params)  # type: ignore[union-attr]


def _npu_bound(v: ir.Value, target: DispatchTarget) -> bool:
    """Every reader of ``v`` is a dispatch op, or a move whose outputs are (Chroma's modulation rows: a Slice, a
    Reshape and a Split between two dispatch ops); ``v`` is no graph output."""
    if v.is_graph_output():
        return False
    for use in v.uses():
        n = use.node
        if target.is_dispatch(n.domain, n.op_type):
            continue
        if not _movable(n) or v not in _data_inputs(n) or not all(_npu_bound(o, target) for o in n.outputs):
            return False
    return True


def _runs_on_bf16(p: ir.Node | None, v: ir.Value, target: DispatchTarget, entries: dict[int, ir.Value]) -> bool:
    """Whether ``v`` (and every output of its producer ``p``) can be made by ``p`` on bf16 values: ``p`` moves bits
    (``_movable``), what it makes goes to the NPU (``_npu_bound``), and its data are bf16 already (dispatch
    outputs), or bf16 through moves themselves, or for a plain move, a float value whose one cast another
    reader shares."""
    if not _movable(p) or not all(_npu_bound(o, target) for o in p.outputs):  # type: ignore[union-attr]
        return False
    data = _data_inputs(p)  # type: ignore[arg-type]
    if all(w.dtype == BF16 or _runs_on_bf16(w.producer(), w, target, entries) for w in data):  # type: ignore[union-attr]
        return True
    if p.op_type == "Split" and len(p.outputs) > 1 and data[0].dtype == v.dtype:  # type: ignore[union-attr]
        return True  # one cast in front of the Split serves all its parts (Z-Image's joined tanh gates)
    return p.op_type in _SHAREABLE and data[0].dtype == v.dtype and (  # type: ignore[union-attr]
        id(data[0]) in entries or len(data[0].uses()) > 1)  # type: ignore[union-attr]


def _on_bf16(node: ir.Node) -> bool:
    """A CPU op ``_entry`` made to run on bf16 values (it reads the dispatch ops' bf16 outputs as they are)."""
    return node.op_type in _BF16_CPU and node.metadata_props.get(RULE_TAG) == RULE and all(
        o.dtype == BF16 for o in node.outputs)


def _entry(graph: ir.Graph, target: DispatchTarget, v: ir.Value, entries: dict[int, ir.Value], counts: Counter[str]
           ) -> ir.Value:
    """``v`` in bf16 for the dispatch ops that read it: one CastAvx, shared by all of them. Where ``v`` is made on
    the CPU by an op that only moves bits (a Slice, Reshape, Transpose, Gather, Concat) from bf16 values, that op
    runs on the bf16 values themselves, with no cast either way; and where ``v`` is such a move of a float value read by the NPU in other forms too
    (Flux's rotary tables, whole and cut into the streams' rows), the one cast serves every form."""
    if id(v) in entries:
        return entries[id(v)]
    p = v.producer()
    b = Builder(graph, RULE, target)
    if _runs_on_bf16(p, v, target, entries):
        assert p is not None
        data = _data_inputs(p)
        srcs = [w if w.dtype == BF16 else _entry(graph, target, w, entries, counts) for w in data]  # type: ignore[union-attr]
        rest = [w for w in p.inputs if w not in data]
        inputs: list[ir.Value | None] = [*srcs, *rest] if p.op_type != "Concat" else srcs
        made = b.op(p.op_type, inputs, {k: a.value for k, a in p.attributes.items()}, domain="",
                    n_out=len(p.outputs))
        for new, old in zip(made.outputs, p.outputs, strict=True):
            new.dtype, new.shape = BF16, old.shape
            entries[id(old)] = new
        made.metadata_props.update({k: val for k, val in p.metadata_props.items() if k != RULE_TAG})
        graph.insert_before(p, b.nodes)  # after its inputs (made before p), before v's readers
        counts["CPU ops run on the bf16 values"] += 1
    else:
        entries[id(v)] = _cast_avx(b, target, v, BF16)
        if p is not None and p.graph is graph:
            graph.insert_after(p, b.nodes)
        else:  # a graph input: cast where the graph starts
            graph.insert_before(next(iter(graph)), b.nodes)
        counts["CastAvx in"] += 1
    return entries[id(v)]


def set_precision(model: ir.Model, target: DispatchTarget, mode: str = "bf16") -> PassResult:
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
            if BF16_ONLY_TAG in node.metadata_props:
                counts["kept bf16 (" + node.metadata_props[BF16_ONLY_TAG] + ")"] += 1
            elif bfp_variant_fits(spec, node):
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
                node.replace_input_with(i, _entry(graph, target, v, entries, counts))
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
                        and not target.is_boundary(u.node.domain, u.node.op_type)
                        and not _on_bf16(u.node)]
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
