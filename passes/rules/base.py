"""The rule shape every fusion follows: ``match`` (pattern + check, returning a ``Match`` or the reason it
does not apply) and ``rewrite`` (new nodes for the matched ones). ``apply_rules`` drives them over a graph,
refuses matches whose intermediate values are used outside the match, stamps provenance and counts. A refusal
is written on the nodes it concerns (node metadata ``sdnpu.declined``), where the partition pass finds it for
each node that stays on the CPU.

Rules know their target (``self.target``): they emit its ops through ``Builder.dispatch`` and check its limits
(``OpSpec.check``), so a second target is a second table, not a second set of rules.
"""

from __future__ import annotations

import abc
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from sdnpu.formats.keys import DECLINED_TAG
from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.irutil import Builder, replace

log = logging.getLogger(__name__)


class Declined(str):
    """A rule's refusal of what it matched (the reason) that also names the nodes the refusal leaves on the CPU:
    each keeps the reason where nothing else took it, not the registry's default for its op type (an attention
    refused for its mask: its two MatMuls and its Softmax say so, not "MatMul of two activations")."""

    nodes: tuple[ir.Node, ...]

    def __new__(cls, reason: str, nodes: Sequence[ir.Node]) -> Declined:
        self = super().__new__(cls, reason)
        self.nodes = tuple(nodes)
        return self


@dataclass
class Match:
    """What a rule found: the nodes it replaces, the values whose users move to the new nodes, and the
    parameters the rewrite needs (a small dataclass of the rule's, shared from check to rewrite)."""

    nodes: list[ir.Node]
    outputs: list[ir.Value]
    params: Any = None


@dataclass
class RuleStats:
    fired: Counter[str] = field(default_factory=Counter)
    declined: Counter[str] = field(default_factory=Counter)  # rule -> matches refused


class Rule(abc.ABC):
    """One op family. ``anchors``: op types where a match ends (its last node)."""

    name: str = ""
    anchors: tuple[str, ...] = ()

    def __init__(self, target: DispatchTarget) -> None:
        self.target = target

    @abc.abstractmethod
    def match(self, node: ir.Node) -> Match | str | None:
        """A Match, a reason string (the pattern was there but the check failed), or None (no pattern)."""

    @abc.abstractmethod
    def rewrite(self, b: Builder, m: Match) -> Sequence[ir.Value]:
        """New nodes through ``b``; returns the values replacing ``m.outputs``, in order."""


def _escapes(m: Match) -> ir.Value | None:
    """An intermediate value of the match that something outside it still reads (a shared intermediate)."""
    inside = set(m.nodes)
    kept = set(map(id, m.outputs))
    for node in m.nodes:
        for out in node.outputs:
            if id(out) in kept:
                continue
            if out.is_graph_output() or any(u.node not in inside for u in out.uses()):
                return out
    return None


def _first_producer(graph: ir.Graph, values: Sequence[ir.Value]) -> ir.Node | None:
    """The earliest node (in graph order) that writes one of ``values``: every reader of every value comes
    after it, and so do the new nodes' inputs, which the matched nodes read before."""
    made = [v.producer() for v in values]
    if len(values) == 1 or len({id(n) for n in made}) == 1:
        return made[0]
    wanted = {id(n) for n in made if n is not None}
    return next((n for n in graph if id(n) in wanted), None)


def apply_rules(graph: ir.Graph, rules: Sequence[Rule], stats: RuleStats | None = None) -> RuleStats:
    """Run each rule over the whole graph in order (rule-major, so earlier rules take precedence)."""
    stats = stats or RuleStats()
    for rule in rules:
        for node in list(graph):
            if node.graph is None or node.op_type not in rule.anchors or node.domain not in ("", "ai.onnx"):
                continue
            found = rule.match(node)
            if found is None:
                continue
            if isinstance(found, str):
                node.metadata_props[DECLINED_TAG] = f"{rule.name}: {found}"
                for n in getattr(found, "nodes", ()):  # a Declined: the nodes it leaves, where no reason is yet
                    n.metadata_props.setdefault(DECLINED_TAG, f"{rule.name}: {found}")
                stats.declined[rule.name] += 1
                continue
            shared = _escapes(found)
            if shared is not None:
                why = f"{rule.name}: intermediate {shared.name!r} is also used outside the pattern"
                for n in found.nodes:  # each node of the refused match keeps this reason if it stays on the CPU
                    n.metadata_props[DECLINED_TAG] = why
                stats.declined[rule.name] += 1
                continue
            b = Builder(graph, rule.name, rule.target)
            new_values = rule.rewrite(b, found)
            last = _first_producer(graph, found.outputs) or node  # new nodes go before the first value replaced
            replace(graph, last, found.nodes, b.nodes, found.outputs, list(new_values))
            stats.fired[rule.name] += 1
    return stats
