"""Handoff pass: the graph inputs and outputs named in ``CompileOptions.handoff`` stay in the NPU's form.

After precision, a 4-D activation leaving the graph runs ``dispatch op -> CastAvx(fp32) -> Transpose(NCHW)``
on the CPU, and one entering it ``Transpose(NHWC) -> CastAvx(bf16) -> dispatch ops``. Where the value goes
from one dispatch model straight into another (``sdnpu.formats.handoff``), this pass removes that edge: the
output becomes the dispatch op's bf16 value, the input a bf16 input in the graph's layout, under the same
name, and the model records each one's form (metadata ``sdnpu.handoff``) so that the runtime can convert
fp32 values in the fp32 graph's layout where it has those.

A named value whose edge is not such a chain (read by the CPU too, or not produced by a dispatch op) keeps
its fp32 form, with a warning naming it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable

import onnx_ir as ir

from sdnpu.formats import handoff
from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.irutil import attr
from sdnpu.passes.manager import PassResult

log = logging.getLogger(__name__)

BF16 = ir.DataType.BFLOAT16


def _perm(node: ir.Node) -> list[int] | None:
    p = attr(node, "perm")
    return [int(i) for i in p] if p is not None else None


def _is(node: ir.Node | None, target: DispatchTarget, kind: str) -> bool:
    if node is None:
        return False
    if kind == "cast":
        return target.is_boundary(node.domain, node.op_type)
    return node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and _perm(node) is not None


def _output_edge(value: ir.Value, target: DispatchTarget) -> tuple[ir.Value, list[ir.Node], list[int]] | None:
    """The bf16 value behind a graph output's CastAvx (and Transpose), the edge's nodes, and the permutation
    that turns the bf16 value's layout into the output's; None where the edge is something else."""
    nodes: list[ir.Node] = []
    perm: list[int] | None = None
    v = value
    while True:
        node = v.producer()
        if _is(node, target, "transpose") and perm is None:
            perm = _perm(node)  # type: ignore[arg-type]
        elif _is(node, target, "cast") and not any(_is(n, target, "cast") for n in nodes):
            pass
        else:
            break
        assert node is not None
        if nodes and (len(list(v.uses())) != 1 or v.is_graph_output()):
            return None  # an inner value of the edge read elsewhere
        nodes.append(node)
        v = node.inputs[0]  # type: ignore[assignment]
    node = v.producer()
    if not nodes or v.dtype != BF16 or node is None or not target.is_dispatch(node.domain, node.op_type):
        return None
    if not any(_is(n, target, "cast") for n in nodes):
        return None
    rank = len(v.shape or ())
    return v, nodes, perm if perm is not None else list(range(rank))


def _input_edge(value: ir.Value, target: DispatchTarget) -> tuple[ir.Value, list[ir.Node], list[int]] | None:
    """The bf16 value a graph input's (Transpose and) CastAvx make, the edge's nodes, and the permutation
    that turns that value's layout back into the input's; None where the input is read otherwise."""
    nodes: list[ir.Node] = []
    perm: list[int] | None = None
    v = value
    while True:
        uses = list(v.uses())
        if len(uses) != 1 or (nodes and v.is_graph_output()):
            break
        node = uses[0].node
        if _is(node, target, "transpose") and perm is None:
            perm = _perm(node)
        elif not (_is(node, target, "cast") and not any(_is(n, target, "cast") for n in nodes)):
            break
        nodes.append(node)
        v = node.outputs[0]
    if not any(_is(n, target, "cast") for n in nodes) or v.dtype != BF16 or v.is_graph_output():
        return None
    if not all(target.is_dispatch(u.node.domain, u.node.op_type) for u in v.uses()):
        return None
    rank = len(v.shape or ())
    inverse = [0] * rank
    for i, p in enumerate(perm if perm is not None else range(rank)):
        inverse[p] = i
    return v, nodes, inverse


def _drop(graph: ir.Graph, nodes: Iterable[ir.Node]) -> None:
    for node in nodes:
        graph.remove(node, safe=True)


def drop_handoff_edges(model: ir.Model, target: DispatchTarget, names: frozenset[str]) -> PassResult:
    graph = model.graph
    counts: Counter[str] = Counter()
    forms = handoff.decode(model.metadata_props.get(handoff.KEY))
    for i, old in enumerate(list(graph.inputs)):
        if old.name not in names or old.dtype == BF16:
            continue
        edge = _input_edge(old, target)
        if edge is None:
            log.warning("handoff: the input %s is not read by dispatch ops through one CastAvx; it stays fp32",
                        old.name)
            continue
        inner, nodes, to_ref = edge
        name = old.name
        new = ir.Value(name=f"{name}__handoff", type=ir.TensorType(BF16), shape=ir.Shape(list(inner.shape)))
        inner.replace_all_uses_with(new)
        graph.inputs[i] = new
        _drop(graph, reversed(nodes))
        old.name = f"{name}__fp32"
        new.name = name
        forms[name] = tuple(to_ref)
        counts["inputs kept bf16"] += 1
        counts["CPU nodes removed"] += len(nodes)
    for i, old in enumerate(list(graph.outputs)):
        if old.name not in names or old.dtype == BF16:
            continue
        edge = _output_edge(old, target)
        if edge is None:
            log.warning("handoff: the output %s is not written by a dispatch op through one CastAvx; it stays fp32",
                        old.name)
            continue
        inner, nodes, to_ref = edge
        name = old.name
        graph.outputs[i] = inner
        _drop(graph, nodes)
        old.name = f"{name}__fp32"
        inner.name = name
        forms[name] = tuple(to_ref)
        counts["outputs kept bf16"] += 1
        counts["CPU nodes removed"] += len(nodes)
    if forms:
        model.metadata_props[handoff.KEY] = handoff.encode(forms)
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
