"""Cleanup: inverse cast pairs, repeated nodes (one movement of a value per reader: one), dead nodes, unused
initializers; then what every dispatch model carries: the
target's opset import and name, each dispatch op checked against the target's table (every required
attribute present with its type), and the ops' reference functions."""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from sdnpu.ops.bodies import functions_for
from sdnpu.formats.keys import TARGET_KEY
from sdnpu.ops.target import INT, INTS, STRING, STRINGS, DispatchTarget
from sdnpu.passes.irutil import attr, remove_dead_nodes, remove_unused_initializers
from sdnpu.passes.manager import PassResult

_ATTR_TYPES = {INT: ir.AttributeType.INT, INTS: ir.AttributeType.INTS, STRING: ir.AttributeType.STRING,
               STRINGS: ir.AttributeType.STRINGS, "FLOAT": ir.AttributeType.FLOAT}


def _cancel_casts(graph: ir.Graph, target: DispatchTarget) -> int:
    """CastAvx(CastAvx(x)) back to x's own dtype is x (bf16 -> fp32 -> bf16 is exact)."""
    done = 0
    for node in list(graph):
        if node.graph is None or not target.is_boundary(node.domain, node.op_type):
            continue
        inner = node.inputs[0].producer() if node.inputs[0] is not None else None
        if inner is None or not target.is_boundary(inner.domain, inner.op_type):
            continue
        base = inner.inputs[0]
        assert base is not None
        if base.dtype != ir.DataType.BFLOAT16 or attr(node, "to") != int(ir.DataType.BFLOAT16):
            continue
        if node.outputs[0].is_graph_output():
            continue
        node.outputs[0].replace_all_uses_with(base)
        done += 1
    return done


# the plain ops whose repeats are one node: deterministic, of their inputs and attributes alone
_MERGEABLE = frozenset({"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Cast", "Slice", "Gather",
                        "Expand", "Concat", "Identity", "DepthToSpace", "SpaceToDepth"})
_PLAIN_ATTRS = frozenset({ir.AttributeType.INT, ir.AttributeType.INTS, ir.AttributeType.FLOAT,
                          ir.AttributeType.FLOATS, ir.AttributeType.STRING, ir.AttributeType.STRINGS})


def _merge_repeats(graph: ir.Graph, target: DispatchTarget) -> int:
    """A node that repeats an earlier one (the same movement or cast of the same values, with the same
    attributes) gives way to it: the layout writes one Transpose per reader of a value, and a value read by
    several dispatch ops was moved as many times (22 of a held-out decoder's 29 CPU nodes). The target's boundary
    cast counts as a movement. The first in the graph's order stays, so it comes before every reader. Not
    onnx_ir's CommonSubexpressionEliminationPass: that merges any op (dispatch ops, whose provenance records name
    them, among them); here only movements and casts, the repeats the passes themselves write."""
    seen: dict[tuple[object, ...], ir.Node] = {}
    done = 0
    for node in list(graph):
        plain = node.domain in ("", "ai.onnx") and node.op_type in _MERGEABLE
        if not (plain or target.is_boundary(node.domain, node.op_type)):
            continue
        if any(a.type not in _PLAIN_ATTRS for a in node.attributes.values()):
            continue
        if any(v.is_graph_output() for v in node.outputs):
            continue
        key = (node.domain, node.op_type, node.overload, tuple(id(v) if v is not None else None for v in node.inputs),
               tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items())))
        first = seen.setdefault(key, node)
        if first is node:
            continue
        for mine, kept in zip(node.outputs, first.outputs, strict=True):
            mine.replace_all_uses_with(kept)
        done += 1
    return done


def contract_violations(target: DispatchTarget, node: ir.Node) -> list[str]:
    """What in ``node`` breaks the target's table: a missing required attribute, or one of another type."""
    spec = target.base_spec(node.op_type)
    problems = []
    for a in spec.attrs:
        have = node.attributes.get(a.name)
        if have is None:
            if a.required:
                problems.append(f"{node.op_type} {node.name}: no attribute {a.name}")
        elif have.type != _ATTR_TYPES[a.type]:
            problems.append(f"{node.op_type} {node.name}: {a.name} is {have.type.name}, the table says {a.type}")
    if len(node.inputs) != len(spec.inputs):
        problems.append(f"{node.op_type} {node.name}: {len(node.inputs)} inputs, the table says {len(spec.inputs)}")
    return problems


def attach_functions(model: ir.Model, target: DispatchTarget) -> int:
    """Give ``model`` exactly the reference functions its dispatch ops need (those it has stay); returns how
    many were added or removed."""
    used = {n.op_type for n in model.graph if n.domain == target.domain}
    before = {k for k in model.functions if k[0] == target.domain}
    needed = {(p.domain, p.name, p.overload): p for p in functions_for(target, used)}
    for key in before - needed.keys():
        del model.functions[key]
    opset = model.opset_imports.get("", 20)
    for key in [k for k in needed if k not in before]:  # in needed's (sorted) order: a set's varies by process
        function = ir.serde.deserialize_function(needed[key])
        function.opset_imports[""] = opset  # a function imports its model's opset (the bodies' ops are alike 20-23)
        model.functions[key] = function
    if used:
        model.opset_imports[target.domain] = target.domain_version
        model.graph.opset_imports[target.domain] = target.domain_version
    if any(n.domain == "com.microsoft" for n in model.graph):  # a rule's CPU op (the attention a target refuses)
        model.opset_imports.setdefault("com.microsoft", 1)
        model.graph.opset_imports.setdefault("com.microsoft", 1)
    return len(before ^ needed.keys())


def clean_up(model: ir.Model, target: DispatchTarget) -> PassResult:
    graph = model.graph
    counts: Counter[str] = Counter()
    counts["cast pairs cancelled"] = _cancel_casts(graph, target)
    counts["repeated nodes merged"] = _merge_repeats(graph, target)
    counts["dead nodes"] = remove_dead_nodes(graph)
    counts["unused initializers"] = remove_unused_initializers(graph)
    problems = [p for n in graph if target.is_dispatch(n.domain, n.op_type) for p in contract_violations(target, n)]
    if problems:  # a rule wrote a node the target's runtime would refuse: a compiler bug, never the user's
        raise AssertionError(f"{len(problems)} dispatch ops break the {target.name} table: " + "; ".join(problems[:5]))
    counts["reference functions"] = attach_functions(model, target)
    counts["target recorded"] = int(model.metadata_props.get(TARGET_KEY) != target.name)
    model.metadata_props[TARGET_KEY] = target.name
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
