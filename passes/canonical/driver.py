"""The node-rewrite driver: the loop every canonical rewrite would otherwise write by hand.

A ``NodeRewrite`` says what it looks at and what it writes: its ``anchors`` (the default-domain op types it
starts from) and ``rewrite(node) -> bool`` (True where it changed the graph at ``node``). The driver owns the
rest, as ``apply_rules`` does for the fusion rules (``sdnpu.passes.rules.base``): it walks a snapshot of the
graph in order (``for node in list(graph)``: nodes a rewrite inserts are not visited in the same walk), skips
nodes an earlier firing removed, counts the firings, and sweeps the nodes left dead. A ``NodeRewrite`` is
itself a pass (``model -> PassResult``, its count under ``count``), so the pipeline lists it as a row.

A rewrite that needs the whole graph at once (folding with its evaluators, raising the opset, binding input
shapes, an analysis computed once for many rewrites, such as the tables' edge region) is a function of the
model instead; ``docs/design.md`` says when a rewrite is a fusion ``Rule`` and when a canonical step.

    @node_rewrite("x*1, x/1, x+0 removed", "Mul", "Div", "Add")
    def drop_neutral(node: ir.Node) -> bool: ...

    drop_neutral(model)            # PassResult(modified, {"x*1, x/1, x+0 removed": n})
    apply(model.graph, drop_neutral)  # n
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir

from sdnpu.passes.irutil import remove_dead_nodes
from sdnpu.passes.manager import PassResult

ONNX_DOMAINS = ("", "ai.onnx")
RULE = "Canonicalize"  # the rule name stamped on every node a canonical rewrite makes (the report reads it)


@dataclass(frozen=True)
class NodeRewrite:
    """One canonical rewrite of a node. ``sweep_before``: dead nodes go before the walk (the rewrite counts a
    value's readers, and a dead reader would hide a match); ``sweep_after``: they go after it where it fired."""

    count: str
    anchors: frozenset[str]
    rewrite: Callable[[ir.Node], bool]
    sweep_before: bool = False
    sweep_after: bool = False

    def __call__(self, model: ir.Model) -> PassResult:
        done = apply(model.graph, self)
        return PassResult(modified=bool(done), counts={self.count: done})


def node_rewrite(count: str, *anchors: str, sweep_before: bool = False,
                 sweep_after: bool = False) -> Callable[[Callable[[ir.Node], bool]], NodeRewrite]:
    """Make a function ``rewrite(node) -> bool`` a ``NodeRewrite`` anchored at ``anchors``, counted as
    ``count``."""

    def make(fn: Callable[[ir.Node], bool]) -> NodeRewrite:
        return NodeRewrite(count, frozenset(anchors), fn, sweep_before, sweep_after)

    return make


def apply(graph: ir.Graph, rw: NodeRewrite) -> int:
    """Run ``rw`` at every node of ``graph`` it anchors at, in graph order; returns how many times it fired."""
    if rw.sweep_before:
        remove_dead_nodes(graph)
    done = 0
    for node in list(graph):
        if node.graph is None or node.op_type not in rw.anchors or node.domain not in ONNX_DOMAINS:
            continue
        if rw.rewrite(node):
            done += 1
    if done and rw.sweep_after:
        remove_dead_nodes(graph)
    return done


def graph_of(node: ir.Node) -> ir.Graph:
    """The graph a node the driver hands to a rewrite is in (it skips removed nodes, which have none)."""
    assert node.graph is not None, node
    return node.graph


def sweep(model: ir.Model) -> PassResult:
    """The nodes nobody reads any more, removed (a step of its own where the rewrites before it leave some)."""
    removed = remove_dead_nodes(model.graph)
    return PassResult(modified=bool(removed), counts={"dead nodes removed": removed})
