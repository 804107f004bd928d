"""Small helpers over onnx_ir shared by the passes: constants, uses, node creation with provenance."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from sdnpu.ops.opset import DOMAIN, RULE_TAG
FLOAT_TYPES = frozenset({ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16})


def const(v: ir.Value | None) -> np.ndarray | None:
    """The constant value of ``v`` (an initializer or a folded constant), else None."""
    if v is None or v.const_value is None:
        return None
    return v.const_value.numpy()


def scalar(v: ir.Value | None) -> float | None:
    """``v``'s value if it is a constant holding a single number."""
    c = const(v)
    if c is None or c.size != 1:
        return None
    return float(c.reshape(()))


def producer(v: ir.Value | None, op_type: str | None = None) -> ir.Node | None:
    if v is None:
        return None
    node = v.producer()
    if node is None or (op_type is not None and (node.op_type != op_type or node.domain not in ("", "ai.onnx"))):
        return None
    return node


def only_used_by(v: ir.Value, nodes: Iterable[ir.Node]) -> bool:
    """True when every use of ``v`` is inside ``nodes`` and ``v`` is no graph output."""
    allowed = set(nodes)
    return not v.is_graph_output() and all(u.node in allowed for u in v.uses())


def static_shape(v: ir.Value | None) -> tuple[int, ...] | None:
    if v is None or v.shape is None or not v.shape.is_static():
        return None
    return tuple(int(d) for d in v.shape)


def is_float(v: ir.Value | None) -> bool:
    return v is not None and v.dtype in FLOAT_TYPES


def attr(node: ir.Node, name: str, default: Any = None) -> Any:
    a = node.attributes.get(name)
    return default if a is None else a.value


class Builder:
    """Creates nodes (stamped with the rule's name) and initializers in one graph."""

    def __init__(self, graph: ir.Graph, rule: str) -> None:
        self.graph = graph
        self.rule = rule
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], attrs: dict[str, Any] | None = None, *,
           domain: str = DOMAIN, n_out: int = 1, dtype: ir.DataType | None = None,
           shape: Sequence[int] | None = None) -> ir.Node:
        node = ir.Node(domain, op_type, list(inputs), attributes=ir.convenience.convert_attributes(attrs or {}),
                       num_outputs=n_out)
        node.metadata_props[RULE_TAG] = self.rule
        if n_out == 1 and (dtype is not None or shape is not None):
            out = node.outputs[0]
            out.dtype = dtype
            out.shape = ir.Shape(list(shape)) if shape is not None else None
        self.nodes.append(node)
        return node

    def derived(self, src: ir.Value, fn: Any, shape: Sequence[int], hint: str,
                dtype: ir.DataType | None = None) -> ir.Value:
        """A new initializer computed from ``src``'s weights by ``fn`` (a transpose, a cast) *lazily*: the
        array is made when the model is saved, one tensor at a time, so weights are never held twice."""
        source = src.const_value
        assert source is not None
        out_dtype = dtype or source.dtype
        name = _unique_name(self.graph, hint)
        lazy = ir.LazyTensor(lambda: ir.tensor(fn(source.numpy()), name=name), dtype=out_dtype,
                             shape=ir.Shape(list(shape)), name=name)
        value = ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(out_dtype), const_value=lazy)
        self.graph.register_initializer(value)
        self.initializers.append(value)
        return value

    def const(self, array: np.ndarray, hint: str) -> ir.Value:
        """A new initializer (weights transformed offline: transposed, cast, reshaped)."""
        name = _unique_name(self.graph, hint)
        value = ir.Value(name=name, shape=ir.Shape(list(array.shape)), type=ir.TensorType(
            ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array, name=name))
        self.graph.register_initializer(value)
        self.initializers.append(value)
        return value


def _unique_name(graph: ir.Graph, hint: str) -> str:
    name, i = hint, 1
    while name in graph.initializers:
        name = f"{hint}_{i}"
        i += 1
    return name


def replace(graph: ir.Graph, anchor: ir.Node, old_nodes: Sequence[ir.Node], new_nodes: Sequence[ir.Node],
            old_values: Sequence[ir.Value], new_values: Sequence[ir.Value]) -> None:
    """Put ``new_nodes`` before ``anchor`` (the last matched node), reroute ``old_values`` to
    ``new_values`` (keeping graph-output names), then remove ``old_nodes``."""
    graph.insert_before(anchor, list(new_nodes))
    for old, new in zip(old_values, new_values, strict=True):
        if new.shape is None and old.shape is not None:
            new.shape = old.shape
        if new.type is None and old.type is not None:
            new.type = old.type
        if old.is_graph_output():
            name = old.name
            old.replace_all_uses_with(new, replace_graph_outputs=True)
            old.name = None
            new.name = name
        else:
            old.replace_all_uses_with(new)
    graph.remove(list(old_nodes), safe=True)


def remove_dead_nodes(graph: ir.Graph) -> int:
    """Drop nodes whose outputs nobody reads; returns how many."""
    removed = 0
    for node in reversed(list(graph)):
        if all(not out.uses() and not out.is_graph_output() for out in node.outputs):
            graph.remove(node, safe=True)
            removed += 1
    return removed


def remove_unused_initializers(graph: ir.Graph) -> int:
    unused = [name for name, v in graph.initializers.items() if not v.uses() and not v.is_graph_output()
              and v not in graph.inputs]
    for name in unused:
        del graph.initializers[name]
    return len(unused)
