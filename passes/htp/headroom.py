"""fp16's range: attention masks' minus infinity raised to -1e4, and values near 65504 scaled into the norms
that read them. See ``sdnpu.passes.htp``."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import FP16_GUARDS_KEY
from sdnpu.passes.manager import PassResult

F32 = ir.DataType.FLOAT


MASK_FLOOR = -1e4  # what an additive mask's "minus infinity" becomes (Qualcomm's SD recipe uses the same)
_MASK_PATH = frozenset({"Add", "Sub", "Mul", "Where", "Reshape", "Expand", "Unsqueeze", "Squeeze", "Cast",
                        "Transpose", "Tile", "Slice", "Concat", "Min", "Max"})


def _mask_sources(softmax: ir.Node) -> tuple[set[ir.Value], set[ir.Node]] | None:
    """The float constants below fp16's range that reach ``softmax``'s input through element-wise mask arithmetic
    and data movement, and the nodes on the way; None where there are none."""
    consts: set[ir.Value] = set()
    nodes: set[ir.Node] = set()
    stack = [softmax.inputs[0]]
    while stack:
        v = stack.pop()
        if v is None:
            continue
        if v.const_value is not None:
            if v.dtype in (F32, ir.DataType.FLOAT16) and v.const_value.size <= 1 << 24:
                c = v.const_value.numpy()
                if np.any(c < -65504):
                    consts.add(v)
            continue
        node = v.producer()
        if node is None or node in nodes or node.domain not in ("", "ai.onnx") or node.op_type not in _MASK_PATH:
            continue
        nodes.add(node)
        stack.extend(node.inputs)
    return (consts, nodes) if consts else None


def clamp_masks(model: ir.Model) -> PassResult:
    """Additive attention masks whose "minus infinity" is float32's lowest value (or -inf, or -1e9): fp16 rounds
    it to -inf, and ``0 * -inf`` (a mask made by multiplying) is NaN. Each such constant that only reaches a
    Softmax, through mask arithmetic and data movement, has its values below -65504 raised to -1e4: the
    softmax weights do not change where the scores stay within about 9900 of each other (exp(-9900) is 0 in
    float32 too), and a row masked everywhere gets uniform weights instead of NaN. The values on the way are
    recorded as guarded (``FP16_GUARDS_KEY``)."""
    graph = model.graph
    guards: dict[str, str] = {}
    done = 0
    paths: dict[ir.Value, set[ir.Node]] = {}  # each constant -> the mask nodes between it and every Softmax it reaches
    for node in graph:
        if node.op_type != "Softmax" or node.domain not in ("", "ai.onnx"):
            continue
        found = _mask_sources(node)
        if found is not None:
            for c in found[0]:
                paths.setdefault(c, set()).update(found[1])
    for c, nodes in paths.items():  # one mask is often shared by every layer: all of its readers count together
        if not all(u.node in nodes for u in c.uses()) or c.is_graph_output():
            continue  # read elsewhere too: not only a mask
        values = c.const_value.numpy()  # type: ignore[union-attr]
        low = float(values.min())
        c.const_value = ir.tensor(np.where(values < -65504, MASK_FLOOR, values).astype(values.dtype), name=c.name)
        done += 1
        text = f"a mask's {low:.3g} raised to {MASK_FLOOR:g} (htp_fp16: softmax weights unchanged)"
        for n in nodes:
            for o in n.outputs:
                if o.name:
                    guards.setdefault(o.name, text)
    _record_guards(model, guards)
    return PassResult(modified=bool(done), counts={"attention masks -> -1e4": done})


def _record_guards(model: ir.Model, guards: dict[str, str]) -> None:
    if not guards:
        return
    old = json.loads(model.metadata_props.get(FP16_GUARDS_KEY, "{}"))
    model.metadata_props[FP16_GUARDS_KEY] = json.dumps({**old, **guards}, sort_keys=True)


def guards_of(metadata: dict[str, str]) -> dict[str, str]:
    """The guarded values a compile recorded (value name -> the rewrite)."""
    return json.loads(metadata.get(FP16_GUARDS_KEY, "{}"))


_NORMS = frozenset({"LayerNormalization", "InstanceNormalization", "GroupNormalization"})


def _norm_readers(v: ir.Value) -> list[ir.Node] | None:
    """The normalizations that read ``v`` (through Reshapes: the exporters' GroupNorm form), or None where
    anything else does (or ``v`` is a graph output): a norm over ``v`` is the same for ``v / s``."""
    if v.is_graph_output():
        return None
    norms: list[ir.Node] = []
    for use in v.uses():
        n = use.node
        if n.domain not in ("", "ai.onnx"):
            return None
        if n.op_type in _NORMS and use.idx == 0:
            norms.append(n)
        elif n.op_type == "Reshape" and use.idx == 0:
            inner = _norm_readers(n.outputs[0])
            if inner is None:
                return None
            norms.extend(inner)
        else:
            return None
    return norms or None


def _linear_source(v: ir.Value) -> tuple[list[ir.Value], ir.Node] | None:
    """The constants to divide by ``s`` for ``v / s``: a Conv / Gemm / MatMul with a constant weight, and its
    bias (the Conv's or Gemm's input, or a constant added after it)."""
    node = v.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Add":
        a, b = node.inputs[0], node.inputs[1]
        bias, inner = (b, a) if b is not None and b.const_value is not None else (a, b)
        if bias is None or bias.const_value is None or inner is None or len(inner.uses()) != 1:
            return None
        found = _linear_source(inner)
        return (found[0] + [bias], node) if found is not None else None
    if node.op_type in ("Conv", "Gemm", "MatMul"):
        w = node.inputs[1] if len(node.inputs) > 1 else None
        if w is None or w.const_value is None:
            return None
        if node.op_type == "Gemm" and node.inputs[0] is not None and node.inputs[0].const_value is not None:
            return None
        consts = [w] + [b for b in node.inputs[2:3] if b is not None and b.const_value is not None]
        if len(node.inputs) > 2 and node.inputs[2] is not None and node.inputs[2].const_value is None:
            return None
        return consts, node
    return None


def scale_into_norms(model: ir.Model, risky: dict[str, float]) -> PassResult:
    """A value near fp16's limit (``risky``: name -> largest magnitude, the values the fp32 check run found within
    4x of 65504) that a
    linear op with constant weights writes and only normalizations read is computed divided by a power of two
    ``s`` (its weights and bias divided, exactly in binary floating point), and each norm's epsilon divided by
    ``s**2``: ``norm(v / s)`` with ``eps / s**2`` is ``norm(v)`` with ``eps``, to float32's rounding."""
    graph = model.graph
    guards: dict[str, str] = {}
    done = 0
    if not risky:
        return PassResult(modified=False, counts={"linear -> norm scaled into fp16": 0})
    for value in [o for n in graph for o in n.outputs if o.name in risky]:
        if not np.isfinite(risky[value.name]):
            continue  # already infinite in float32: no scale brings it back
        # a power of two (exact), taking the value to at most 1/16 of fp16's largest
        s = 2.0 ** max(1, int(np.ceil(np.log2(max(risky[value.name], 1.0) * 16 / 65504))))
        norms = _norm_readers(value)
        found = _linear_source(value) if norms else None
        if norms is None or found is None:
            continue
        consts, _ = found
        if any(len(c.uses()) != 1 or c.is_graph_output() for c in consts):
            continue  # a weight shared with another op: dividing it would change that op
        for c in consts:
            arr = c.const_value.numpy()  # type: ignore[union-attr]
            c.const_value = ir.tensor((arr / s).astype(arr.dtype), name=c.name)
        for norm in norms:
            eps = norm.attributes.get("epsilon")
            default = 1e-5
            e = eps.value if eps is not None else default
            norm.attributes["epsilon"] = ir.AttrFloat32("epsilon", float(e) / (s * s))
        guards[value.name] = (f"computed / {s:g} into the norm that reads it (its weights and bias divided, "
                              f"epsilon / {s * s:g}; htp_fp16)")
        done += 1
    _record_guards(model, guards)
    return PassResult(modified=bool(done), counts={"linear -> norm scaled into fp16": done})


def guard_fp16_range(model: ir.Model, risky: dict[str, float]) -> PassResult:
    """The guards against fp16 overflow: attention masks clamped (always), and the values the fp32 check run
    found near fp16's limit scaled into the norms that read them (``risky``; empty without a check run)."""
    a, b = clamp_masks(model), scale_into_norms(model, risky)
    return PassResult(modified=a.modified or b.modified, counts={**a.counts, **b.counts})
