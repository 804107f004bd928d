"""The node-rewrite driver (``sdnpu.passes.canonical.driver``): what a ``NodeRewrite`` is handed (its anchors in
the default domain, in graph order, a snapshot: not the nodes it inserts, not the nodes an earlier firing
removed), what it counts, when it sweeps, and the sweep step."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnx import helper

from sdnpu.passes.canonical.driver import NodeRewrite, apply, graph_of, node_rewrite, sweep
from sdnpu.passes.irutil import reroute

from .graphs import model, ops, to_ir


def chain(k: int = 3) -> ir.Model:
    """x -> Relu -> Relu -> ... (k) -> Sigmoid -> y."""
    nodes = [helper.make_node("Relu", [f"r{i}"], [f"r{i + 1}"]) for i in range(k)]
    nodes[0].input[0] = "x"
    return to_ir(model([*nodes, helper.make_node("Sigmoid", [f"r{k}"], ["y"])], {"x": [2]}, {"y": [2]}))


def test_a_rewrite_sees_its_anchors_in_order_and_is_counted():
    seen: list[str] = []

    @node_rewrite("relus seen", "Relu")
    def look(node: ir.Node) -> bool:
        seen.append(node.outputs[0].name)
        return node.outputs[0].name != "r2"  # fires on two of three

    m = chain()
    result = look(m)
    assert seen == ["r1", "r2", "r3"] and result.modified and result.counts == {"relus seen": 2}
    assert isinstance(look, NodeRewrite) and look.anchors == frozenset({"Relu"})


def test_a_node_of_another_domain_is_not_an_anchor():
    m = chain(1)
    m.opset_imports["my.domain"] = 1
    node = next(iter(m.graph))
    node.domain = "my.domain"
    fired = apply(m.graph, NodeRewrite("n", frozenset({"Relu"}), lambda node: True))
    assert fired == 0


def test_the_nodes_a_rewrite_inserts_are_not_visited_in_the_same_walk():
    """Each Relu gets another Relu in front of it: three firings, not an endless walk."""

    @node_rewrite("relus doubled", "Relu")
    def double(node: ir.Node) -> bool:
        graph = graph_of(node)
        x = node.inputs[0]
        extra = ir.node("Relu", [x], num_outputs=1)
        extra.outputs[0].dtype, extra.outputs[0].shape = x.dtype, x.shape
        graph.insert_before(node, extra)
        node.replace_input_with(0, extra.outputs[0])
        return True

    m = chain()
    assert double(m).counts == {"relus doubled": 3} and ops(m)["Relu"] == 6


def test_a_node_an_earlier_firing_removed_is_skipped():
    """Each firing removes its anchor and the Relu after it: the second Relu is never handed over."""
    seen: list[str] = []

    @node_rewrite("pairs removed", "Relu")
    def pair(node: ir.Node) -> bool:
        seen.append(node.outputs[0].name)
        after = node.outputs[0].uses()[0].node
        if after.op_type != "Relu":
            return False
        graph = graph_of(node)
        reroute(graph, after.outputs[0], node.inputs[0])
        graph.remove([node, after], safe=True)
        return True

    m = chain(4)
    assert pair(m).counts == {"pairs removed": 2} and seen == ["r1", "r3"] and dict(ops(m)) == {"Sigmoid": 1}


def _with_dead(m: ir.Model) -> ir.Model:
    """One more node nobody reads."""
    x = m.graph.inputs[0]
    dead = ir.node("Neg", [x], num_outputs=1)
    dead.outputs[0].dtype, dead.outputs[0].shape = x.dtype, x.shape
    m.graph.append(dead)
    return m


def test_the_sweeps():
    """``sweep_after``: the dead nodes go where the rewrite fired (here, the Relus it bypassed and the Neg
    nobody read), not where it did not; ``sweep_before``: always, before the walk."""

    def bypass(node: ir.Node) -> bool:
        reroute(graph_of(node), node.outputs[0], node.inputs[0])
        return True

    after = NodeRewrite("bypassed", frozenset({"Relu"}), bypass, sweep_after=True)
    m = _with_dead(chain())
    assert after(m).counts == {"bypassed": 3} and dict(ops(m)) == {"Sigmoid": 1}
    idle = NodeRewrite("none", frozenset({"Tanh"}), bypass, sweep_after=True)
    m = _with_dead(chain())
    assert idle(m).counts == {"none": 0} and ops(m)["Neg"] == 1
    before = NodeRewrite("none", frozenset({"Tanh"}), bypass, sweep_before=True)
    assert before(m).counts == {"none": 0} and ops(m)["Neg"] == 0


def test_the_sweep_step_counts_what_it_removes():
    m = _with_dead(chain())
    result = sweep(m)
    assert result.modified and result.counts == {"dead nodes removed": 1}
    again = sweep(m)
    assert not again.modified and again.counts == {"dead nodes removed": 0}
    assert np.array_equal([n.op_type for n in m.graph], ["Relu", "Relu", "Relu", "Sigmoid"])
