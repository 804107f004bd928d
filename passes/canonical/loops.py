"""Loops written out: a module's per-item Python loops (Lumina 2's ``for i, (cap_len, seq_len) in
enumerate(...)`` over the batch) that an exporter unrolls into per-item Gathers, Slices, ScatterNDs and a
Concat, rewritten as the batched data movement they are. Each is found by running the data movement on index
tensors (every source element its own label) and kept only where the batched form gives the same elements:

- *assembled*: a value that only data movement builds (Gather, Slice, Reshape, Transpose, Squeeze, Unsqueeze,
  Flatten, Expand, Concat, ScatterND, with constant parameters) from a few sources, writing over constants
  that it overwrites whole, which is the Concat of those sources along one axis, is that Concat (Lumina 2's
  joint sequence: the caption's and the image's tokens written row by row into zeros);
- *stacked chains*: a Concat along axis 0 of one movement chain run on each item of a tensor (``Gather(x, i,
  axis=0)`` for i = 0 .. B-1, in order) is that chain run once on the whole batch (Lumina 2's unpatchify, one
  image at a time).

The data movement that results (a Concat; a Slice, Reshapes and a Transpose) is what the other passes know:
the streams pass reads a Concat's parts apart, a dispatch op reads a Reshape as a view, the layout pass
cancels Transposes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir

from sdnpu.passes.canonical.driver import graph_of, node_rewrite
from sdnpu.passes.irutil import Builder, attr, const, reroute, static_shape

RULE = "Loops"
MOVES = frozenset({"Gather", "Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Expand",
                   "Concat", "ScatterND", "Identity"})
_DATA = {"Gather": (0,), "Slice": (0,), "Reshape": (0,), "Transpose": (0,), "Squeeze": (0,), "Unsqueeze": (0,),
         "Flatten": (0,), "Expand": (0,), "Identity": (0,), "ScatterND": (0, 2)}  # Concat: every input
_MAX_NODES = 256
_MAX_ELEMENTS = 1 << 22


def _onnx(node: ir.Node | None, *ops: str) -> bool:
    return node is not None and node.domain in ("", "ai.onnx") and node.op_type in ops


def _is_data(node: ir.Node, i: int) -> bool:
    return node.op_type == "Concat" or i in _DATA.get(node.op_type, ())


def _evaluate(node: ir.Node, xs: Sequence[np.ndarray | None]) -> np.ndarray | None:
    """One movement node on numpy arrays (its parameters constant, its shapes static); None where it cannot."""
    op, out = node.op_type, static_shape(node.outputs[0])
    x = xs[0]
    if x is None or out is None:
        return None
    if op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"):
        return x.reshape(out)
    if op == "Transpose":
        perm = attr(node, "perm")
        return np.transpose(x, perm if perm is not None else None)
    if op == "Expand":
        return np.broadcast_to(x, out).copy()
    if op == "Gather":
        return np.take(x, xs[1], axis=int(attr(node, "axis", 0)))  # type: ignore[arg-type]
    if op == "Concat":
        if any(v is None for v in xs):
            return None
        return np.concatenate(xs, axis=int(attr(node, "axis", 0)))  # type: ignore[arg-type]
    if op == "Slice":
        starts, ends = xs[1], xs[2]
        axes = xs[3] if len(xs) > 3 and xs[3] is not None else np.arange(len(starts))  # type: ignore[arg-type]
        steps = xs[4] if len(xs) > 4 and xs[4] is not None else np.ones(len(starts), np.int64)  # type: ignore[arg-type]
        index = [slice(None)] * x.ndim
        for s, e, a, k in zip(starts, ends, axes, steps, strict=True):  # type: ignore[arg-type]
            index[int(a) % x.ndim] = slice(int(s), int(e), int(k))
        return x[tuple(index)]
    if op == "ScatterND":
        if attr(node, "reduction", "none") not in ("none", b"none") or xs[1] is None or xs[2] is None:
            return None
        y = x.copy()
        y[tuple(np.moveaxis(xs[1], -1, 0))] = xs[2]
        return y
    return None


def _subgraph(y: ir.Value) -> tuple[list[ir.Node], list[ir.Value]] | None:
    """The movement nodes that build ``y`` (in graph order) and its sources: the values they read that are not
    constant and not built by movement. None where a parameter is not constant or it is too large."""
    nodes: dict[ir.Node, None] = {}
    sources: dict[ir.Value, None] = {}
    todo = [y]
    while todo:
        v = todo.pop()
        p = v.producer()
        if p is None or not _onnx(p, *MOVES) or len(p.outputs) != 1 or static_shape(v) is None:
            sources[v] = None
            continue
        if p in nodes:
            continue
        nodes[p] = None
        if len(nodes) > _MAX_NODES:
            return None
        for i, w in enumerate(p.inputs):
            if w is None or const(w) is not None:
                continue
            if not _is_data(p, i):
                return None  # a computed index or shape
            todo.append(w)
    order = {n: k for k, n in enumerate(y.graph or [])} if y.graph is not None else {}
    return sorted(nodes, key=lambda n: order.get(n, 0)), list(sources)


def _run(nodes: list[ir.Node], labels: dict[ir.Value, np.ndarray]) -> dict[ir.Value, np.ndarray] | None:
    """The nodes run on ``labels`` (the sources'); every constant in a data position reads -1, so a result
    holding -1 shows a constant that is not overwritten."""
    values = dict(labels)
    for node in nodes:
        xs: list[np.ndarray | None] = []
        for i, w in enumerate(node.inputs):
            if w is None:
                xs.append(None)
            elif w in values:
                xs.append(values[w])
            elif (c := const(w)) is not None:
                xs.append(np.full(c.shape, -1, np.int64) if _is_data(node, i) else c)
            else:
                return None
        try:
            out = _evaluate(node, xs)
        except (IndexError, ValueError):
            return None
        if out is None or list(out.shape) != list(static_shape(node.outputs[0]) or ()):
            return None
        values[node.outputs[0]] = out
    return values


def _labels(sources: Sequence[ir.Value]) -> dict[ir.Value, np.ndarray] | None:
    labels, start = {}, 1
    for s in sources:
        shape = static_shape(s)
        if shape is None:
            return None
        n = int(np.prod(shape, dtype=np.int64))
        labels[s] = np.arange(start, start + n, dtype=np.int64).reshape(shape)
        start += n
    return labels


@node_rewrite("assembled by movement -> Concat", "ScatterND")
def concat_assembled_values(node: ir.Node) -> bool:
    """A value that data movement alone builds from a few sources (writing over constants it overwrites whole),
    which is the Concat of those sources along one axis, is that Concat (Lumina 2's joint sequence). Anchored
    at the last ScatterND of the chain."""
    graph = graph_of(node)
    y = node.outputs[0]
    if not y.uses() or all(_onnx(u.node, "ScatterND") for u in y.uses()) or y.is_graph_output():
        return False  # not the end of its chain
    shape = static_shape(y)
    found = _subgraph(y)
    if shape is None or found is None or int(np.prod(shape)) > _MAX_ELEMENTS:
        return False
    nodes, sources = found
    if not sources or len(sources) > 4 or any(len(static_shape(s) or ()) != len(shape) for s in sources):
        return False
    labels = _labels(sources)
    values = _run(nodes, labels) if labels is not None else None
    if values is None:
        return False
    got = values[y]
    match = None
    for axis in range(len(shape)):
        for order in itertools.permutations(sources):
            parts = [labels[s] for s in order]  # type: ignore[index]
            if all(p.shape[:axis] + p.shape[axis + 1:] == got.shape[:axis] + got.shape[axis + 1:] for p in parts) \
                    and np.array_equal(np.concatenate(parts, axis=axis), got):
                match = (axis, order)
                break
        if match:
            break
    if match is None:
        return False
    axis, order = match
    b = Builder(graph, RULE)
    cat = b.op("Concat", list(order), {"axis": axis}, dtype=y.dtype, shape=list(shape))
    graph.insert_before(node, b.nodes)
    reroute(graph, y, cat.outputs[0])
    return True


def _item_chain(v: ir.Value) -> tuple[ir.Value, int, list[ir.Node]] | None:
    """``v`` as a movement chain from ``Gather(x, i, axis=0)`` (a scalar ``i``): (x, i, the chain's nodes from
    the Gather on, in order); None otherwise."""
    chain: list[ir.Node] = []
    while True:
        p = v.producer()
        if p is None or len(p.outputs) != 1:
            return None
        if _onnx(p, "Gather"):
            i = const(p.inputs[1])
            if i is None or i.ndim != 0 or int(attr(p, "axis", 0)) != 0 or p.inputs[0] is None:
                return None
            chain.append(p)
            chain.reverse()
            return p.inputs[0], int(i), chain
        if not _onnx(p, "Slice", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten") or p.inputs[0] is None:
            return None
        if any(w is not None and const(w) is None for w in p.inputs[1:]) or len(v.uses()) != 1:
            return None
        chain.append(p)
        v = p.inputs[0]


def _lift(b: Builder, x: ir.Value, chain: list[ir.Node], out: tuple[int, ...]) -> ir.Value | None:
    """``chain`` (run on one item of ``x``) run on all of ``x``'s items at once: a leading batch axis kept
    through every node; the last node's leading 1 (the item stacked) becomes the batch. None where a node
    cannot say so."""
    batch = static_shape(x)[0]  # type: ignore[index]
    cur = x
    for k, node in enumerate(chain[1:]):
        item = static_shape(node.outputs[0])
        if item is None:
            return None
        last = k == len(chain) - 2
        shape = [batch, *item[1:]] if last and item[:1] == (1,) else [batch, *item]
        op = node.op_type
        if op == "Transpose":
            perm = attr(node, "perm")
            if perm is None:
                return None
            new = b.op("Transpose", [cur], {"perm": [0, *(int(p) + 1 for p in perm)]}, dtype=cur.dtype, shape=shape)
        elif op == "Slice":
            starts, ends = const(node.inputs[1]), const(node.inputs[2])
            if starts is None or ends is None:
                return None
            rank = len(static_shape(node.inputs[0]) or ())
            given = const(node.inputs[3]) if len(node.inputs) > 3 else None
            axes = given if given is not None else np.arange(len(starts))
            params = [node.inputs[1], node.inputs[2], b.const(np.asarray([int(a) % rank + 1 for a in axes], np.int64), "axes")]
            if len(node.inputs) > 4 and node.inputs[4] is not None:
                params.append(node.inputs[4])
            new = b.op("Slice", [cur, *params], dtype=cur.dtype, shape=shape)
        elif not last and chain[k + 2].op_type not in ("Transpose", "Slice"):
            continue  # a view followed by a view: the later one says the shape
        else:  # the views: a Reshape to the batched shape
            new = b.op("Reshape", [cur, b.const(np.asarray(shape, np.int64), "shape")], dtype=cur.dtype, shape=shape)
        cur = new.outputs[0]
    if tuple(static_shape(cur) or ()) != out:
        cur = b.op("Reshape", [cur, b.const(np.asarray(out, np.int64), "shape")], dtype=cur.dtype,
                   shape=list(out)).outputs[0]
    return cur


@node_rewrite("stacked per-item chains -> batched", "Concat")
def batch_stacked_chains(node: ir.Node) -> bool:
    """A Concat along axis 0 of one movement chain run on each item of a tensor, in order, is that chain run once
    on the whole batch (Lumina 2's unpatchify, one image at a time)."""
    if int(attr(node, "axis", 0)) != 0:
        return False
    graph = graph_of(node)
    y = node.outputs[0]
    out = static_shape(y)
    chains = [_item_chain(v) if v is not None else None for v in node.inputs]
    if out is None or not chains or any(c is None for c in chains) or int(np.prod(out)) > _MAX_ELEMENTS:
        return False
    x = chains[0][0]  # type: ignore[index]
    shape = static_shape(x)
    if shape is None or not shape or any(c[0] is not x for c in chains) or \
            [c[1] for c in chains] != list(range(shape[0])) or shape[0] != out[0]:  # type: ignore[index]
        return False
    ops = [[(n.op_type, [tuple(const(w).reshape(-1)) if const(w) is not None else None for w in n.inputs[1:]],
             {k: str(a.value) for k, a in n.attributes.items()}) for n in c[2][1:]] for c in chains]  # type: ignore[index]
    if any(o != ops[0] for o in ops[1:]):
        return False  # not one chain on every item
    b = Builder(graph, RULE)
    lifted = _lift(b, x, chains[0][2], tuple(out))  # type: ignore[index]
    if lifted is None:
        for v in b.initializers:
            graph.initializers.pop(v.name, None)  # type: ignore[arg-type]
        return False
    labels = _labels([x])
    want = _run([n for c in chains for n in c[2]] + [node], labels) if labels is not None else None  # type: ignore[index]
    got = _run(b.nodes, labels) if labels is not None else None
    if want is None or got is None or not np.array_equal(want[y], got[lifted]):
        for v in b.initializers:  # not the batched chain: its nodes were never inserted, its constants go
            graph.initializers.pop(v.name, None)  # type: ignore[arg-type]
        return False
    graph.insert_before(node, b.nodes)
    reroute(graph, y, lifted)
    return True
