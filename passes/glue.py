"""Glue: the element-wise and data-movement ops left between the fused families become dispatch ops,
so that an NPU region is not cut by an Add, a Reshape or a Concat.

Runs after the layout pass (which removes most Transposes and needs the plain ONNX forms to push them).
A node whose data is not a float tensor of static shape and rank <= 4 stays on the CPU, with the reason.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir

from sdnpu.ops.capability import check_tensor
from sdnpu.passes.irutil import Builder, attr, const, is_float, replace, static_shape
from sdnpu.passes.manager import PassResult

RULE = "GlueLowering"
_BINARY = {"Add": "SDAdd", "Sub": "SDSub", "Mul": "SDMul", "Div": "SDDiv"}
_UNARY = {"Sin": "SDSin", "Cos": "SDCos", "Sigmoid": "SDSigmoid"}
_RESHAPES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})
LOWERED = frozenset({*_BINARY, *_UNARY, *_RESHAPES, "Concat", "Slice", "Split", "Transpose", "Expand", "Softmax"})


def _data_inputs(node: ir.Node) -> list[ir.Value | None]:
    if node.op_type in _BINARY or node.op_type == "Concat":
        return list(node.inputs)
    return list(node.inputs[:1])  # the rest (shape, axes, starts) are constants that select data


def _reason(node: ir.Node) -> str | None:
    for v in [*_data_inputs(node), *node.outputs]:
        if v is None:
            continue
        shape = static_shape(v)
        reason = check_tensor(len(shape) if shape is not None else None, is_float(v))
        if reason:
            return reason
    return None


def _slice_attrs(node: ir.Node) -> dict[str, list[int]] | None:
    vals = [const(v) if v is not None else None for v in node.inputs[1:]]
    if any(v is None for v in vals[:2]) or any(v is None for v, inp in zip(vals[2:], node.inputs[3:]) if inp):
        return None
    rank = len(static_shape(node.inputs[0]) or ())
    starts, ends = (np.asarray(v).reshape(-1) for v in vals[:2])
    axes = np.asarray(vals[2]).reshape(-1) if len(vals) > 2 and vals[2] is not None else np.arange(len(starts))
    steps = np.asarray(vals[3]).reshape(-1) if len(vals) > 3 and vals[3] is not None else np.ones(len(starts))
    big = np.iinfo(np.int64).max
    shape = static_shape(node.inputs[0]) or ()
    ends = [min(int(e), shape[int(a) % rank]) if int(e) < big else shape[int(a) % rank] for e, a in zip(ends, axes)]
    return {"starts": [int(s) for s in starts], "ends": ends, "axes": [int(a) % rank for a in axes],
            "steps": [int(s) for s in steps]}


def _lower(b: Builder, node: ir.Node) -> list[ir.Value] | None:
    op = node.op_type
    out_shape = static_shape(node.outputs[0])
    if op in _BINARY:
        return [b.op(_BINARY[op], list(node.inputs)).outputs[0]]
    if op in _UNARY:
        return [b.op(_UNARY[op], [node.inputs[0]]).outputs[0]]
    if op == "Softmax":
        return [b.op("SDSoftmax", [node.inputs[0]], {"axis": int(attr(node, "axis", -1))}).outputs[0]]
    if op in _RESHAPES:
        return [b.op("SDReshape", [node.inputs[0]], {"shape": list(out_shape)}).outputs[0]]  # type: ignore
    if op == "Transpose":
        return [b.op("SDTranspose", [node.inputs[0]], {"perm": list(attr(node, "perm"))}).outputs[0]]
    if op == "Expand":
        return [b.op("SDExpand", [node.inputs[0]], {"shape": list(out_shape)}).outputs[0]]  # type: ignore
    if op == "Concat":  # a chain of pairs; each partial result typed and shaped (the precision pass reads them)
        axis = int(attr(node, "axis", 0))
        acc = node.inputs[0]
        for v in node.inputs[1:]:
            a_shape, v_shape = static_shape(acc), static_shape(v)
            shape = None
            if a_shape is not None and v_shape is not None:
                shape = list(a_shape)
                shape[axis % len(shape)] += v_shape[axis % len(shape)]
            acc = b.op("SDConcat", [acc, v], {"axis": axis}, dtype=node.outputs[0].dtype, shape=shape).outputs[0]
        return [acc]  # type: ignore[list-item]
    if op == "Slice":
        attrs = _slice_attrs(node)
        return None if attrs is None else [b.op("SDSlice", [node.inputs[0]], attrs).outputs[0]]
    if op == "Split":
        shape = static_shape(node.inputs[0]) or ()
        axis = int(attr(node, "axis", 0)) % len(shape)
        sizes = [static_shape(o)[axis] for o in node.outputs]  # type: ignore[index]
        outs, start = [], 0
        for size in sizes:
            attrs = {"starts": [start], "ends": [start + size], "axes": [axis], "steps": [1]}
            outs.append(b.op("SDSlice", [node.inputs[0]], attrs).outputs[0])
            start += size
        return outs
    return None


def lower_glue(model: ir.Model) -> PassResult:
    graph = model.graph
    counts: Counter[str] = Counter()
    declined: dict[str, tuple[str, str]] = {}
    for node in list(graph):
        if node.op_type not in LOWERED or node.domain not in ("", "ai.onnx"):
            continue
        reason = _reason(node)
        if reason:
            declined[node.name or node.op_type] = (RULE, reason)
            continue
        b = Builder(graph, RULE)
        news = _lower(b, node)
        if news is None:
            declined[node.name or node.op_type] = (RULE, "inputs that select data are not constant")
            continue
        for old, new in zip(node.outputs, news, strict=True):
            new.dtype = old.dtype
            new.shape = old.shape
        replace(graph, node, [node], b.nodes, list(node.outputs), news)
        counts[f"{node.op_type} -> {b.nodes[-1].op_type}"] += 1
    return PassResult(modified=bool(counts), counts=dict(counts), details={"declined": declined})
