"""Precision: dispatch ops take and give bf16; weights are stored bf16; CastAvx at every CPU<->NPU edge.

- every float initializer read by a dispatch op is converted to bf16 offline (lazily, once per tensor, even
  when several ops share it);
- an fp32 activation entering a dispatch op gets one ``CastAvx(to=bf16)``, shared by all its NPU readers;
- a bf16 value read by the CPU or leaving the graph gets one ``CastAvx`` back to the type it had (fp32, or
  fp16 in an fp16 export: the CPU ops reading it and the graph's outputs keep their declared types);
- a CastAvx next to an SDTranspose at the boundary absorbs it (``perm``): NCHW<->NHWC happens in the cast;
- the sinusoidal embeddings' arguments and their Sin/Cos stay fp32 (an fp32 island on the NPU); an SDCast
  hands their results to the bf16 ops, and a bf16 result of a dispatch op outside the island (an argument
  too large to be part of it) back to the island.

bf16 -> fp32 -> bf16 is exact, so dispatch ops feeding dispatch ops need no casts at all.
"""

from __future__ import annotations

from collections import Counter

import ml_dtypes
import numpy as np
import onnx_ir as ir

from sdnpu.ops.opset import BOUNDARY_OP, DISPATCH_OPS, DOMAIN
from sdnpu.passes.irutil import Builder, attr, static_shape
from sdnpu.passes.manager import PassResult

RULE = "PrecisionPass"
BF16 = ir.DataType.BFLOAT16
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16)


def is_dispatch(node: ir.Node) -> bool:
    return node.domain == DOMAIN and node.op_type in DISPATCH_OPS


def to_bf16(a: np.ndarray) -> np.ndarray:
    return a.astype(ml_dtypes.bfloat16)


def _cast_avx(b: Builder, x: ir.Value, to: ir.DataType, perm: list[int] | None = None) -> ir.Value:
    shape = static_shape(x) or ()
    perm = perm if perm is not None else list(range(len(shape)))
    out_shape = [shape[i] for i in perm] if shape else None
    return b.op(BOUNDARY_OP, [x], {"to": int(to), "perm": ir.AttrInt64s("perm", perm)}, dtype=to,
                shape=out_shape).outputs[0]


FP32_OPS = frozenset({"SDSin", "SDCos"})
_SMALL = 1 << 16  # elements: an fp32 island holds only embedding-sized tensors


def fp32_islands(graph: ir.Graph) -> set[ir.Node]:
    """Dispatch nodes that compute in fp32: the trig functions and the small chain computing their
    arguments (timestep x frequency reaches ~1000 rad, where bf16's step is 4 rad)."""
    keep: set[ir.Node] = set()
    todo = [n for n in graph if is_dispatch(n) and n.op_type in FP32_OPS]
    while todo:
        node = todo.pop()
        if node in keep:
            continue
        keep.add(node)
        for v in node.inputs:
            p = v.producer() if v is not None else None
            shape = static_shape(v)
            if p is not None and is_dispatch(p) and shape is not None and int(np.prod(shape)) <= _SMALL:
                todo.append(p)
    return keep


PRECISIONS = ("bf16", "bfp16")


def _bfp_plan(node: ir.Node) -> tuple[int | None, int | None] | None:
    """For an op with a ``_bfp`` variant whose blocked axes hold whole 8-value blocks: (weight input, its
    block axis). None when the op stays bf16."""
    from sdnpu.ops.bfp import BFP_OPS, BLOCK

    if node.op_type not in BFP_OPS:
        return None
    acts, w_idx, w_axis = BFP_OPS[node.op_type]
    for i in acts:
        shape = static_shape(node.inputs[i])
        if not shape or shape[-1] % BLOCK:
            return None
    if w_idx is not None:
        w_shape = static_shape(node.inputs[w_idx])
        if not w_shape or w_shape[w_axis] % BLOCK:  # type: ignore[index]
            return None
    return w_idx, w_axis


def precision(model: ir.Model, mode: str = "bf16") -> PassResult:
    """``mode``: "bf16", or "bfp16" (the MAC ops become their ``_bfp`` variants where their blocked axes
    hold whole 8-value blocks; the rest stays bf16)."""
    from sdnpu.ops.bfp import BFP_OPS, round_bfp16
    from sdnpu.ops.opset import BFP_SUFFIX

    if mode not in PRECISIONS:
        from sdnpu.errors import SdnpuError

        raise SdnpuError(f"unknown precision {mode!r}", hint=f"choose one of: {', '.join(PRECISIONS)}")
    graph = model.graph
    counts: Counter[str] = Counter()
    weights: dict[tuple[int, int | None], ir.Value] = {}
    entries: dict[int, ir.Value] = {}
    islands = fp32_islands(graph)
    counts["fp32 ops (sinusoid arguments)"] = len(islands)
    handovers: dict[int, ir.Value] = {}
    own_type: dict[int, ir.DataType] = {}  # each dispatch output's type before it became bf16
    widened: dict[int, ir.Value] = {}
    for node in list(graph):
        if not is_dispatch(node):
            continue
        if node in islands:  # fp32 in, fp32 out; inputs from the CPU need no cast, bf16 ones an SDCast back
            for i, v in enumerate(node.inputs):
                p = v.producer() if v is not None else None
                if v is None or p is None or not is_dispatch(p) or p in islands or v.dtype != BF16:
                    continue
                if id(v) not in widened:
                    b = Builder(graph, RULE)
                    to = own_type.get(id(v), ir.DataType.FLOAT)
                    widened[id(v)] = b.op("SDCast", [v], {"to": int(to)}, dtype=to, shape=static_shape(v)).outputs[0]
                    graph.insert_after(p, b.nodes)
                    counts["SDCast bf16 -> fp32"] += 1
                node.replace_input_with(i, widened[id(v)])
            continue
        plan = _bfp_plan(node) if mode == "bfp16" else None
        if plan is not None:
            node.op_type += BFP_SUFFIX
            counts["ops -> _bfp"] += 1
        elif mode == "bfp16" and node.op_type in BFP_OPS:
            counts["kept bf16 (axis not a multiple of 8)"] += 1
        for i, v in enumerate(node.inputs):
            p = v.producer() if v is not None else None
            if v is not None and p in islands:
                if id(v) not in handovers:
                    b = Builder(graph, RULE)
                    handovers[id(v)] = b.op("SDCast", [v], {"to": int(BF16)}, dtype=BF16,
                                            shape=static_shape(v)).outputs[0]
                    graph.insert_after(p, b.nodes)  # type: ignore[arg-type]
                    counts["SDCast fp32 -> bf16"] += 1
                node.replace_input_with(i, handovers[id(v)])
        for i, v in enumerate(node.inputs):
            if v is None or v.dtype not in _FLOATS:
                continue
            b = Builder(graph, RULE)
            if v.const_value is not None:
                axis = plan[1] if plan is not None and plan[0] == i else None
                if (id(v), axis) not in weights:
                    if axis is None:
                        weights[(id(v), axis)] = b.derived(v, to_bf16, static_shape(v) or [], f"{v.name}_bf16",
                                                           dtype=BF16)
                        counts["weights -> bf16"] += 1
                    else:
                        weights[(id(v), axis)] = b.derived(v, lambda a, ax=axis: to_bf16(round_bfp16(a, ax)),
                                                           static_shape(v) or [], f"{v.name}_bfp16", dtype=BF16)
                        counts["weights -> bfp16 (stored bf16)"] += 1
                node.replace_input_with(i, weights[(id(v), axis)])
            else:
                if id(v) not in entries:
                    entries[id(v)] = _cast_avx(b, v, BF16)
                    graph.insert_before(node, b.nodes)
                    counts["CastAvx in"] += 1
                node.replace_input_with(i, entries[id(v)])
        for out in node.outputs:
            if out.dtype in _FLOATS:
                own_type[id(out)] = out.dtype
            out.dtype = BF16
    # Exits: bf16 values read by the CPU or leaving the graph.
    for node in list(graph):
        if not is_dispatch(node) or node in islands:
            continue
        for out in node.outputs:
            cpu_uses = [u for u in out.uses() if not is_dispatch(u.node) and u.node.op_type != BOUNDARY_OP]
            if not cpu_uses and not out.is_graph_output():
                continue
            b = Builder(graph, RULE)
            back = _cast_avx(b, out, own_type.get(id(out), ir.DataType.FLOAT))
            graph.insert_after(node, b.nodes)
            for use in cpu_uses:
                use.node.replace_input_with(use.idx, back)
            if out.is_graph_output():
                name = out.name
                graph.outputs[graph.outputs.index(out)] = back
                out.name = f"{name}_bf16"
                back.name = name
            counts["CastAvx out"] += 1
    counts["transposes merged into CastAvx"] = _merge_boundary_transposes(graph)
    return PassResult(modified=True, counts=dict(counts))


def _merge_boundary_transposes(graph: ir.Graph) -> int:
    merged = 0
    for node in list(graph):
        if node.graph is None or node.op_type != BOUNDARY_OP or node.domain != DOMAIN:
            continue
        perm = list(attr(node, "perm"))
        x, y = node.inputs[0], node.outputs[0]
        assert x is not None
        # entry: CastAvx -> SDTranspose (its only reader)
        uses = list(y.uses())
        if len(uses) == 1 and uses[0].node.op_type == "SDTranspose" and not y.is_graph_output() \
                and perm == list(range(len(perm))):
            t = uses[0].node
            b = Builder(graph, RULE)
            new = _cast_avx(b, x, ir.DataType(attr(node, "to")), list(attr(t, "perm")))
            graph.insert_before(node, b.nodes)
            t.outputs[0].replace_all_uses_with(new)
            graph.remove([t, node], safe=True)
            merged += 1
            continue
        # exit: SDTranspose (read only here) -> CastAvx
        t = x.producer()
        if t is not None and t.op_type == "SDTranspose" and len(x.uses()) == 1 and not x.is_graph_output() \
                and perm == list(range(len(perm))):
            b = Builder(graph, RULE)
            new = _cast_avx(b, t.inputs[0], ir.DataType(attr(node, "to")), list(attr(t, "perm")))  # type: ignore
            graph.insert_before(node, b.nodes)
            name = y.name
            if y.is_graph_output():
                graph.outputs[graph.outputs.index(y)] = new
                y.name = f"{name}_unmerged"
                new.name = name
            y.replace_all_uses_with(new)  # its CPU readers, also when it is a graph output as well
            graph.remove([node, t], safe=True)
            merged += 1
    return merged
