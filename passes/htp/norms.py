"""The norms as QNN's HTP computes them right: a broadcast into a LayerNormalization, and the RMS norm's
product with a reciprocal. See ``sdnpu.passes.htp``."""

from __future__ import annotations

import onnx_ir as ir

from sdnpu.formats.keys import RULE_TAG
from sdnpu.passes.htp.common import F32, RULE, constant, new_op, reduce_mean, scalar_const, take_place, unique_name
from sdnpu.passes.manager import PassResult


def _broadcast_operand(node: ir.Node) -> int | None:
    """The input index of ``node``'s operand that varies along one axis other than the last and is broadcast
    along another (its shape, aligned to the output's, has a 1 where the output does not): SD3's ``pos[1, N, D]``
    over ``[B, N, D]``. A row over the last axis (a bias ``[D]``, ``[1, 1, D]``) or a full-shape operand is not
    (measured exact: such an Add keeps QNN's fused bias). None where shapes are unknown."""
    out = node.outputs[0].shape
    if out is None or not out.is_static() or len(out) < 2:
        return None
    dims = [int(d) for d in out]
    for i, v in enumerate(node.inputs[:2]):
        if v is None or v.shape is None or not v.shape.is_static():
            continue
        shape = [1] * (len(dims) - len(v.shape)) + [int(d) for d in v.shape]
        lead = list(zip(shape[:-1], dims[:-1], strict=True))
        if any(a == 1 and b != 1 for a, b in lead) and any(a != 1 for a, _ in lead):
            return i
    return None


def _add_to_sub(graph: ir.Graph, add: ir.Node, k: int) -> None:
    """``Add(x, k)`` -> ``Sub(x, -k)``: the same numbers, a form the HTP compiles right before a norm."""
    operand = add.inputs[k]
    other = add.inputs[1 - k]
    assert operand is not None and other is not None
    if operand.const_value is not None:
        neg = constant(graph, -operand.const_value.numpy(), f"{operand.name}_negated")
    else:
        neg = new_op(graph, add, "Neg", [operand], unique_name(graph, f"{operand.name}_negated"), like=operand)
    sub = ir.node("Sub", [other, neg], name=unique_name(graph, f"{add.name}_as_sub"))
    sub.metadata_props[RULE_TAG] = RULE
    graph.insert_before(add, sub)
    out = add.outputs[0]
    sub.outputs[0].dtype, sub.outputs[0].shape = out.dtype, out.shape
    name = out.name
    out.replace_all_uses_with(sub.outputs[0], replace_graph_outputs=True)
    graph.remove(add, safe=True)
    sub.outputs[0].name = name


def _written_out_norm(graph: ir.Graph, norm: ir.Node, opset: int) -> None:
    """``LayerNormalization`` as ReduceMean, Sub, Mul, ReduceMean, Add(eps), Sqrt, Div, then Mul(scale) and
    Add(bias): the same function, in ops the HTP computes right after a broadcast Mul."""
    x = norm.inputs[0]
    assert x is not None and x.shape is not None
    rank = len(x.shape)
    axis = int(norm.attributes["axis"].value) if "axis" in norm.attributes else -1
    axes = list(range(axis % rank, rank))
    eps = float(norm.attributes["epsilon"].value) if "epsilon" in norm.attributes else 1e-5
    base = norm.name or "layer_norm"
    mu = reduce_mean(graph, norm, x, axes, opset, unique_name(graph, f"{base}_mean"))
    xc = new_op(graph, norm, "Sub", [x, mu], unique_name(graph, f"{base}_centered"), like=x)
    sq = new_op(graph, norm, "Mul", [xc, xc], unique_name(graph, f"{base}_squared"), like=x)
    var = reduce_mean(graph, norm, sq, axes, opset, unique_name(graph, f"{base}_variance"))
    e = scalar_const(graph, eps, x.dtype or F32, unique_name(graph, f"{base}_epsilon"))
    sd = new_op(graph, norm, "Sqrt", [new_op(graph, norm, "Add", [var, e], unique_name(graph, f"{base}_var_eps"))],
             unique_name(graph, f"{base}_std"))
    y = new_op(graph, norm, "Div", [xc, sd], unique_name(graph, f"{base}_normalized"), like=x)
    scale = norm.inputs[1] if len(norm.inputs) > 1 else None
    bias = norm.inputs[2] if len(norm.inputs) > 2 else None
    if scale is not None:
        y = new_op(graph, norm, "Mul", [y, scale], unique_name(graph, f"{base}_scaled"), like=x)
    if bias is not None:
        y = new_op(graph, norm, "Add", [y, bias], unique_name(graph, f"{base}_biased"), like=x)
    out = norm.outputs[0]
    name = out.name
    out.replace_all_uses_with(y, replace_graph_outputs=True)
    graph.remove(norm, safe=True)
    y.name = name


def _through_noops(x: ir.Value | None) -> ir.Node | None:
    """The node that computes ``x``'s values, past the ops that only pass them on (an Identity, a Cast to the type
    it has: TorchScript writes one between SD3's position Add and its first norm), which QNN drops."""
    node = x.producer() if x is not None else None
    while node is not None and node.domain in ("", "ai.onnx") and (
            node.op_type == "Identity" or node.op_type == "Cast" and node.inputs[0] is not None
            and node.attributes.get("to") is not None and node.attributes["to"].value == node.inputs[0].dtype):
        node = node.inputs[0].producer() if node.inputs[0] is not None else None
    return node


def rewrite_broadcast_into_layernorm(model: ir.Model) -> PassResult:
    """The HTP's fault on a broadcast Add or Mul feeding a LayerNormalization avoided (see the module's
    docstring)."""
    graph = model.graph
    opset = model.opset_imports.get("", 17)
    counts = {"broadcast Add -> Sub before LayerNorm": 0, "LayerNorm after a broadcast Mul written out": 0}
    for norm in [n for n in graph if n.op_type == "LayerNormalization" and n.domain in ("", "ai.onnx")]:
        x = norm.inputs[0]
        src = _through_noops(x)
        if src is None or src.domain not in ("", "ai.onnx") or src.op_type not in ("Add", "Mul"):
            continue
        k = _broadcast_operand(src)
        if k is None:
            continue
        if src.op_type == "Add":
            _add_to_sub(graph, src, k)
            counts["broadcast Add -> Sub before LayerNorm"] += 1
        elif x is not None and x.shape is not None:
            _written_out_norm(graph, norm, opset)
            counts["LayerNorm after a broadcast Mul written out"] += 1
    return PassResult(modified=any(counts.values()), counts=counts)


def divide_reciprocal_products(model: ir.Model) -> PassResult:
    """``Mul(x, Reciprocal(d))`` -> ``Div(x, d)``. QNN 2.51 fuses the RMS norm as exported (Pow, ReduceMean, Add,
    Sqrt, Reciprocal, Mul, then a Mul by its weight) into its own RmsNorm, which fails to compile with the
    weight as the first operand (``QNN_COMMON_ERROR_MEM_ALLOC``: every T5 encoder) and computes some shapes
    wrong, differently from run to run, with it second (Flux.1's per-head q/k norms [B, S, H, d]: cosine 0.002
    to 0.7 on the emulator). Written as a division the chain is not fused, compiles, and computes right (tiny
    T5: cosine 0.999997; measured on the emulator, v73 to v81). ``x / d`` and ``x * (1 / d)`` differ by
    float32's last bit."""
    graph = model.graph
    done = 0
    for rec in [n for n in graph if n.op_type == "Reciprocal" and n.domain in ("", "ai.onnx")]:
        d = rec.inputs[0]
        r = rec.outputs[0]
        if d is None or r.is_graph_output():
            continue
        muls = {id(u.node): (u.node, u.idx) for u in r.uses()}  # a node reading it twice counts once
        for mul, idx in muls.values():
            if (mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or len(mul.inputs) != 2
                    or mul.graph is not graph):
                continue  # (a reader inside a Loop's or If's body is left alone)
            x = mul.inputs[1 - idx]
            if x is None or x is r:
                continue  # (1 / d) ** 2 is no product with a reciprocal
            div = ir.node("Div", [x, d], name=unique_name(graph, f"{mul.name}_as_div"))
            div.metadata_props[RULE_TAG] = RULE
            out = mul.outputs[0]
            div.outputs[0].dtype, div.outputs[0].shape = out.dtype, out.shape
            take_place(graph, mul, [div], div.outputs[0])
            done += 1
        if not r.uses():
            graph.remove(rec, safe=True)
    return PassResult(modified=bool(done), counts={"x * (1 / d) -> x / d": done})
