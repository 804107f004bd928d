"""Partition: propose NPU regions (maximal cycle-free connected sets of dispatch ops) and give every CPU
node its reason. The proposal is written into the model as node metadata (``sdnpu.region`` on dispatch ops,
``sdnpu.cpu_reason`` on the rest) and returned, so the report reads one source of truth.

Connected dispatch ops are grouped (networkx); a group is split where merging it would make a cycle through
the CPU (an NPU region must be callable as one unit: nothing it needs may come from a CPU node that itself
needs the region).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import onnx_ir as ir

from sdnpu.ops.opset import BOUNDARY_OP, DOMAIN, REASON_TAG, REGION_TAG
from sdnpu.passes.manager import PassResult
from sdnpu.passes.precision import is_dispatch



@dataclass
class Region:
    index: int
    nodes: list[str]
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def _node_graph(graph: ir.Graph) -> nx.DiGraph:
    g = nx.DiGraph()
    for node in graph:
        g.add_node(node)
        for v in node.inputs:
            if v is not None and v.producer() is not None:
                g.add_edge(v.producer(), node)
    return g


def _regions(graph: ir.Graph) -> list[list[ir.Node]]:
    g = _node_graph(graph)
    order = {n: i for i, n in enumerate(graph)}
    npu = [n for n in graph if is_dispatch(n)]
    sub = g.subgraph(npu).to_undirected(as_view=True)
    groups = [sorted(c, key=order.__getitem__) for c in nx.connected_components(sub)]
    # Cycle check on the contracted graph. A group on a cycle is split in two in topological order; that
    # ends, since single nodes cannot form a cycle (the graph is a DAG).
    while True:
        owner = {n: i for i, grp in enumerate(groups) for n in grp}
        contracted = nx.DiGraph()
        for u, v in g.edges:
            cu, cv = owner.get(u, u), owner.get(v, v)
            if cu != cv:
                contracted.add_edge(cu, cv)
        try:
            cycle = nx.find_cycle(contracted)
        except nx.NetworkXNoCycle:
            return groups
        bad = next(c for edge in cycle for c in edge if isinstance(c, int))
        grp = groups.pop(bad)
        half = len(grp) // 2
        groups += [grp[:half], grp[half:]]


def _cpu_reason(node: ir.Node, declined: dict[str, tuple[str, str]]) -> str:
    if node.op_type == BOUNDARY_OP and node.domain == DOMAIN:
        return "CPU<->NPU boundary cast (CastAvx runs on the CPU)"
    key = node.name or node.op_type
    if key in declined:
        rule, reason = declined[key]
        return f"{rule}: {reason}"
    return f"no rule offloads {node.op_type}"


def partition(model: ir.Model, declined: dict[str, tuple[str, str]] | None = None) -> PassResult:
    graph = model.graph
    declined = declined or {}
    regions = _regions(graph)
    order = {n: i for i, n in enumerate(graph)}
    regions.sort(key=lambda grp: order[grp[0]])
    out: list[Region] = []
    for i, grp in enumerate(regions):
        members = set(grp)
        region = Region(i, [n.name or n.op_type for n in grp])
        for n in grp:
            n.metadata_props[REGION_TAG] = str(i)
            for v in n.inputs:
                outside = v is not None and v.const_value is None and v.producer() not in members
                if outside and v.name not in region.inputs:
                    region.inputs.append(v.name or "")
            for v in n.outputs:
                if v.is_graph_output() or any(u.node not in members for u in v.uses()):
                    region.outputs.append(v.name or "")
        out.append(region)
    cpu = 0
    for node in graph:
        if not is_dispatch(node):
            node.metadata_props[REASON_TAG] = _cpu_reason(node, declined)
            node.metadata_props.pop(REGION_TAG, None)
            cpu += 1
    transitions = sum(len(r.inputs) + len(r.outputs) for r in out)
    return PassResult(modified=True, counts={"NPU regions": len(out), "CPU nodes": cpu, "transitions": transitions},
                      details={"regions": out})
