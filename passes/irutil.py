"""Small helpers over onnx_ir shared by the passes: constants, uses, node creation with provenance."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import ASSUMED_TAG, RULE_TAG, VIEWS_TAG
from sdnpu.ops.bodies import dummy
from sdnpu.ops.target import DispatchTarget
from sdnpu.passes import provenance
from sdnpu.passes.provenance import Step

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
    """Creates nodes (stamped with the rule's name) and initializers in one graph; ``dispatch`` creates the
    target's ops with the attributes its table requires."""

    def __init__(self, graph: ir.Graph, rule: str, target: DispatchTarget | None = None) -> None:
        self.graph = graph
        self.rule = rule
        self.target = target
        self.nodes: list[ir.Node] = []
        self.initializers: list[ir.Value] = []

    def dispatch(self, op_type: str, inputs: Sequence[ir.Value | None], attrs: dict[str, Any], *,
                 dtype: ir.DataType | None, shape: Sequence[int], assumed: Sequence[str] = ()) -> ir.Node:
        """A dispatch op of the target: ``attrs`` are the shape and op attributes; the dtype lists come from
        the table, and dummy inputs (buffers AMD's kernels take but do not read) are appended."""
        assert self.target is not None, "dispatch ops need the target"
        spec = self.target.spec(op_type)
        ins = list(inputs)
        for spec_in in spec.inputs[len(ins):]:
            assert spec_in.role == "dummy", (op_type, spec_in.name)
            ins.append(self.shared_const(dummy(spec_in), f"sdnpu_dummy_{spec_in.dtype}_{spec_in.dummy_shape[0]}"))
        full = {**attrs, "in_dtypes": list(spec.in_dtypes), "out_dtypes": list(spec.out_dtypes)}
        for name, i in spec.exact_inputs:  # weight shapes: the tensors' own
            full.setdefault(name, list(static_shape(ins[i]) or []))
        for name, _ in spec.exact_outputs:
            full.setdefault(name, list(shape))
        node = self.op(op_type, ins, full, domain=self.target.domain, dtype=dtype, shape=shape)
        if assumed:
            node.metadata_props[ASSUMED_TAG] = ",".join(assumed)
        record_views(node, self.target)
        return node

    def discard(self) -> None:
        """Forget the nodes made and not inserted (a rewrite given up part way): each stops reading its inputs,
        which would otherwise keep it among their uses, a reader no graph holds (a dead node's producer then
        looks read, and stays)."""
        for node in reversed(self.nodes):
            if node.graph is None:
                for i in range(len(node.inputs)):
                    node.replace_input_with(i, None)
        self.nodes.clear()

    def shared_const(self, array: np.ndarray, name: str) -> ir.Value:
        """One initializer of this name per graph, shared by every op that needs it (dummies, masks)."""
        existing = self.graph.initializers.get(name)
        if existing is not None:
            return existing
        value = ir.Value(name=name, shape=ir.Shape(list(array.shape)), type=ir.TensorType(
            ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array, name=name))
        provenance.set_origin(value, provenance.LITERAL)
        self.graph.register_initializer(value)
        self.initializers.append(value)
        return value

    def op(self, op_type: str, inputs: Sequence[ir.Value | None], attrs: dict[str, Any] | None = None, *,
           domain: str = "", n_out: int = 1, dtype: ir.DataType | None = None,
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

    def derived(self, src: ir.Value, steps: Sequence[Step], shape: Sequence[int], hint: str,
                dtype: ir.DataType | None = None) -> ir.Value:
        """A new initializer computed from ``src``'s weights by ``steps`` (passes/provenance.py: a transpose,
        a slice, a cast) *lazily*: the array is made when the model is saved, one tensor at a time, so weights
        are never held twice. Its provenance is ``src``'s with the steps after it."""
        source = src.const_value
        assert source is not None
        steps = list(steps)
        return self._lazy(lambda: provenance.apply(steps, source.numpy()), shape, hint, dtype or source.dtype,
                          provenance.chain(provenance.origin(src), steps))

    def concatenated(self, parts: Sequence[tuple[ir.Value, Sequence[Step]]], shape: Sequence[int], hint: str,
                     dtype: ir.DataType) -> ir.Value:
        """A new initializer: each part's weights after its steps, concatenated along axis 0 (lazily, as
        ``derived``); GroupNorm's ``wts`` = gamma ++ beta."""
        tensors = [(v.const_value, list(steps)) for v, steps in parts]
        assert all(t is not None for t, _ in tensors)
        xs = [provenance.chain(provenance.origin(v), steps) for v, steps in parts]
        expr = provenance.LITERAL if all(x.get("literal") for x in xs) else {"op": "concat", "axis": 0, "xs": xs}
        return self._lazy(lambda: np.concatenate([provenance.apply(s, t.numpy()) for t, s in tensors]),  # type: ignore[union-attr]
                          shape, hint, dtype, expr)

    def summed(self, parts: Sequence[tuple[ir.Value, Sequence[Step]]], shape: Sequence[int], hint: str,
               dtype: ir.DataType) -> ir.Value:
        """A new initializer: each part's weights after its steps, added up (lazily, as ``derived``); a linear
        layer's bias with the constants added to its output folded in."""
        if len(parts) == 1:
            v, steps = parts[0]
            return self.derived(v, steps, shape, hint, dtype)
        tensors = [(v.const_value, list(steps)) for v, steps in parts]
        assert all(t is not None for t, _ in tensors)
        xs = [provenance.chain(provenance.origin(v), steps) for v, steps in parts]
        if all(x.get("literal") for x in xs):
            expr = provenance.LITERAL
        else:  # a literal part (a folded constant) is held in the record, so the sum replays
            xs = [provenance.inline(provenance.apply(s, t.numpy())) if x.get("literal") else x  # type: ignore[union-attr]
                  for x, (t, s) in zip(xs, tensors, strict=True)]
            expr = {"op": "sum", "xs": xs}
        return self._lazy(lambda: provenance.add_up([provenance.apply(s, t.numpy()) for t, s in tensors]),  # type: ignore[union-attr]
                          shape, hint, dtype, expr)

    def _lazy(self, make: Any, shape: Sequence[int], hint: str, dtype: ir.DataType, expr: provenance.Expr
              ) -> ir.Value:
        name = _unique_name(self.graph, hint)
        lazy = ir.LazyTensor(lambda: ir.tensor(make(), name=name), dtype=dtype, shape=ir.Shape(list(shape)),
                             name=name)
        value = ir.Value(name=name, shape=ir.Shape(list(shape)), type=ir.TensorType(dtype), const_value=lazy)
        provenance.set_origin(value, expr)
        self.graph.register_initializer(value)
        self.initializers.append(value)
        return value

    def const(self, array: np.ndarray, hint: str) -> ir.Value:
        """A new initializer made from no weight (a zero bias, a shape, a mask); a constant computed from a
        weight is ``derived``, which records where it came from."""
        name = _unique_name(self.graph, hint)
        value = ir.Value(name=name, shape=ir.Shape(list(array.shape)), type=ir.TensorType(
            ir.DataType.from_numpy(array.dtype)), const_value=ir.tensor(array, name=name))
        provenance.set_origin(value, provenance.LITERAL)
        self.graph.register_initializer(value)
        self.initializers.append(value)
        return value


def _unique_name(graph: ir.Graph, hint: str) -> str:
    name, i = hint, 1
    while name in graph.initializers:
        name = f"{hint}_{i}"
        i += 1
    return name


def reroute(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """Every reader of ``old`` reads ``new``; where ``old`` is a graph output, ``new`` takes its place and its
    name (the graph keeps its signature). Where ``new`` cannot take a name (a graph input, an initializer,
    already a graph output under its own name), an Identity writes it under the old name."""
    if not old.is_graph_output():
        old.replace_all_uses_with(new)
        return
    name = old.name
    if new.is_graph_output() or new.is_graph_input() or new.is_initializer() or new.producer() is None:
        alias = ir.node("Identity", [new], num_outputs=1, name=f"{name}_alias")  # reports name every node
        alias.outputs[0].dtype, alias.outputs[0].shape = new.dtype, new.shape
        graph.append(alias)  # the output slot takes an Identity of it, the readers read it
        for i, out in enumerate(graph.outputs):
            if out is old:
                graph.outputs[i] = alias.outputs[0]
        old.replace_all_uses_with(new)
        old.name = f"{name}__rerouted"
        alias.outputs[0].name = name
        return
    old.replace_all_uses_with(new, replace_graph_outputs=True)
    old.name = f"{name}__rerouted"  # still named, should its producer live on (another of its outputs is read)
    new.name = name


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
        reroute(graph, old, new)
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


def bmk_view(shape: tuple[int, ...] | list[int]) -> list[int]:
    """The [B, M, K] view of an activation: [K] -> [1, 1, K], [M, K] -> [1, M, K], [B, M, K] as it is,
    [B, H, W, K] -> [B, H*W, K]; K is the last axis."""
    if len(shape) == 1:
        return [1, 1, int(shape[0])]
    if len(shape) == 2:
        return [int(shape[0]), 1, int(shape[1])]
    return [int(shape[0]), int(np.prod(shape[1:-1])), int(shape[-1])]


def unview(b: Builder, y: ir.Value, shape: tuple[int, ...] | None) -> ir.Value:
    """``y`` reshaped to ``shape`` where they differ: the view back to what the replaced node wrote (a
    dispatch op reading it absorbs the Reshape again)."""
    if shape is None or static_shape(y) == shape:
        return y
    return b.op("Reshape", [y, b.const(np.asarray(shape, np.int64), "shape")], dtype=y.dtype,
                shape=list(shape)).outputs[0]


def record_views(node: ir.Node, target: DispatchTarget) -> None:
    """Write on a dispatch op which inputs it reads through a view (node metadata ``sdnpu.views``:
    ``input:tensor shape>view;...``): its attribute names a shape other than the tensor's, same element
    count. The report lists them; the tests hold each against the tensor."""
    spec = target.base_spec(node.op_type)
    attrs = {k: a.value for k, a in node.attributes.items()}
    records = []
    for i, view in sorted(spec.input_views(attrs).items()):
        shape = static_shape(node.inputs[i]) if i < len(node.inputs) else None
        if shape is not None and list(shape) != list(view):
            records.append(f"{i}:{'x'.join(map(str, shape))}>{'x'.join(map(str, view))}")
    if records:
        node.metadata_props[VIEWS_TAG] = ";".join(records)
    else:
        node.metadata_props.pop(VIEWS_TAG, None)
