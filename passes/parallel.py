"""Parallel projections through one CPU op: linear layers of one input, each followed by the same op the
registry lacks, become one layer, one op and one Split.

Z-Image and Lumina 2 gate every block's residuals by ``tanh`` of a projection of the timestep embedding:

    gate_i = Tanh(SDGemm(t_emb, W_i) + b_i)            two a block, each a CPU island (CastAvx, Tanh, CastAvx)

Tanh is not in AMD's registry, so each gate costs three CPU nodes, and a deeper model more of them. The
layers read the same input, so they are one layer over their weights side by side, and an element-wise op
works column by column:

    Split(Tanh(SDGemm(t_emb, [W_1 | ... | W_n]) + [b_1 | ... | b_n])) == gate_1, ..., gate_n

The same MACs, one CPU island for all of them: CastAvx, Tanh, CastAvx and the Split (which runs on the bf16
values, as the precision pass moves a Split onto the cast that feeds it). The weights are concatenated
offline, lazily, with their provenance (a LoRA on any of them reaches the joined weight).

What is joined: SDGemms with the same activation input and view, no fused nonlinearity, each output read by
one element-wise CPU op alone (``UNARY``, the same op with the same attributes for the group), at least two of
them. A layer whose output is read by anything else stays as it is.
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import onnx_ir as ir

from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.irutil import Builder, remove_dead_nodes, reroute, static_shape
from sdnpu.passes.manager import PassResult
from sdnpu.passes.provenance import step

RULE = "ParallelProjections"
# element-wise ops the registry lacks that a gate or an activation of a projection is spelled with
UNARY = frozenset({"Tanh", "Relu", "Sigmoid", "Exp", "Erf", "Softplus", "Abs", "Neg", "LeakyRelu", "Elu",
                   "HardSigmoid", "HardSwish"})


def _member(node: ir.Node, target: DispatchTarget) -> tuple[object, ...] | None:
    """The group key of a layer that may join others, or None."""
    if node.op_type != target.op("gemm").op_type or node.domain != target.domain or "nonlinear" in node.attributes:
        return None
    out = node.outputs[0]
    uses = out.uses()
    if out.is_graph_output() or len(uses) != 1:
        return None
    act = uses[0].node
    if act.op_type not in UNARY or act.domain not in ("", "ai.onnx") or len(act.outputs) != 1:
        return None
    x, w, bias = (*node.inputs, None, None, None)[:3]
    if x is None or w is None or bias is None or w.const_value is None or bias.const_value is None:
        return None
    shape_w, shape_b = static_shape(w), static_shape(bias)
    if shape_w is None or len(shape_w) != 2 or shape_b != (shape_w[1],):
        return None
    attrs = tuple(sorted((k, repr(a.value)) for k, a in act.attributes.items()))
    return (id(x), tuple(node.attributes["input_shape"].value), act.op_type, attrs, w.dtype, bias.dtype)


def _join(graph: ir.Graph, target: DispatchTarget, layers: list[ir.Node]) -> None:
    first = layers[0]
    x = first.inputs[0]
    assert x is not None
    k = static_shape(first.inputs[1])[0]  # type: ignore[index]
    widths = [static_shape(n.inputs[1])[1] for n in layers]  # type: ignore[index]
    total = sum(widths)
    b = Builder(graph, RULE, target)
    transposed = b.concatenated([(n.inputs[1], [step("transpose", perm=[1, 0])]) for n in layers],  # type: ignore[misc]
                                [total, k], f"{first.inputs[1].name}_joined_nk", first.inputs[1].dtype)  # type: ignore[union-attr, arg-type]
    w = b.derived(transposed, [step("transpose", perm=[1, 0])], [k, total], f"{first.inputs[1].name}_joined")  # type: ignore[union-attr]
    bias = b.concatenated([(n.inputs[2], []) for n in layers], [total],  # type: ignore[misc]
                          f"{first.inputs[2].name}_joined", first.inputs[2].dtype)  # type: ignore[union-attr, arg-type]
    view = list(first.attributes["input_shape"].value)
    out_shape = [*view[:-1], total]
    attrs = {"input_shape": view, "output_shape": out_shape, "weight_shape": [k, total], "bias_enable": 1}
    gemm = b.dispatch(target.op("gemm").op_type, [x, w, bias], attrs, dtype=first.outputs[0].dtype,
                      shape=out_shape)
    acts = [n.outputs[0].uses()[0].node for n in layers]  # each layer's one reader (``_member``)
    act = b.op(acts[0].op_type, [gemm.outputs[0]], {k_: a.value for k_, a in acts[0].attributes.items()},
               dtype=acts[0].outputs[0].dtype, shape=out_shape)
    sizes = b.const(np.asarray(widths, np.int64), f"{first.name}_joined_widths")
    split = b.op("Split", [act.outputs[0], sizes], {"axis": len(out_shape) - 1}, n_out=len(layers))
    graph.insert_before(first, b.nodes)  # after x (every layer reads it); the sort places the rest
    for out, old, width in zip(split.outputs, acts, widths, strict=True):
        # an element-wise op keeps its layer's [*view[:-1], width]: the Split's part is its output as it is
        out.dtype, out.shape = old.outputs[0].dtype, ir.Shape([*view[:-1], width])
        reroute(graph, old.outputs[0], out)


def join_parallel(model: ir.Model, target: DispatchTarget) -> PassResult:
    graph = model.graph
    groups: dict[tuple[object, ...], list[ir.Node]] = defaultdict(list)
    for node in graph:
        key = _member(node, target)
        if key is not None:
            groups[key].append(node)
    counts: Counter[str] = Counter()
    for layers in groups.values():
        if len(layers) < 2:
            continue
        _join(graph, target, layers)
        counts["projections joined"] += len(layers)
        counts["joined layers"] += 1
    if counts:
        counts["nodes left dead"] = remove_dead_nodes(graph)
        graph.sort()
    return PassResult(modified=bool(counts), counts=dict(counts))
