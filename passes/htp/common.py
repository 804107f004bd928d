"""What HTP's forms share: new names, nodes and constants, each node stamped with the rule."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import RULE_TAG

RULE = "HtpForms"
F32 = ir.DataType.FLOAT


def constant(graph: ir.Graph, value: np.ndarray, hint: str) -> ir.Value:
    """A new initializer holding ``value``, under a name made from ``hint`` that the graph does not use yet."""
    name = unique_name(graph, hint)
    v = ir.Value(name=name, const_value=ir.tensor(value, name=name))
    v.shape, v.dtype = ir.Shape(list(value.shape)), ir.DataType.from_numpy(value.dtype)
    graph.register_initializer(v)
    return v


def reduce_mean(graph: ir.Graph, anchor: ir.Node, x: ir.Value, axes: list[int], opset: int, name: str
                ) -> ir.Value:
    if opset >= 18:
        ax = constant(graph, np.asarray(axes, np.int64), f"{name}_axes")
        node = ir.node("ReduceMean", [x, ax], attributes={"keepdims": 1}, name=name)
    else:
        node = ir.node("ReduceMean", [x], attributes={"axes": axes, "keepdims": 1}, name=name)
    graph.insert_before(anchor, node)
    node.outputs[0].name = name
    node.outputs[0].dtype = x.dtype
    return node.outputs[0]


def new_op(graph: ir.Graph, anchor: ir.Node, op: str, inputs: list[ir.Value], name: str,
           like: ir.Value | None = None) -> ir.Value:
    node = ir.node(op, inputs, name=name)
    node.metadata_props[RULE_TAG] = RULE
    graph.insert_before(anchor, node)
    out = node.outputs[0]
    out.name = name
    if like is not None:
        out.dtype, out.shape = like.dtype, like.shape
    return out


def scalar_const(graph: ir.Graph, value: float, dtype: ir.DataType, name: str) -> ir.Value:
    return constant(graph, np.asarray(value, dtype=np.float16 if dtype == ir.DataType.FLOAT16 else np.float32), name)


def node_name(graph: ir.Graph, hint: str) -> str:
    """A node name the graph does not use yet (onnxruntime refuses two nodes of one name)."""
    taken = {n.name for n in graph}
    name, i = hint, 1
    while name in taken:
        name, i = f"{hint}_{i}", i + 1
    return name


def unique_name(graph: ir.Graph, hint: str) -> str:
    taken = set(graph.initializers) | {o.name for n in graph for o in n.outputs} | {v.name for v in graph.inputs}
    name, i = hint, 1
    while name in taken:
        name, i = f"{hint}_{i}", i + 1
    return name


def take_place(graph: ir.Graph, node: ir.Node, new_nodes: list[ir.Node], value: ir.Value) -> None:
    """``new_nodes`` put before ``node``, whose one output ``value`` replaces everywhere and under its name (the
    fp16 headroom list and the graph's outputs read values by name); ``node`` removed."""
    graph.insert_before(node, new_nodes)
    out = node.outputs[0]
    name = out.name
    out.replace_all_uses_with(value, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    value.name = name
