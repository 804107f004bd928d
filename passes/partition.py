"""Partition: propose NPU regions, then apply them (node metadata ``sdnpu.region`` on dispatch ops,
``sdnpu.cpu_reason`` on the rest), so the report reads one source of truth.

A region must be callable as one unit: nothing it needs may come from a CPU node that itself needs the
region. The proposal starts from the connected components of the dispatch ops (maximal); where one of them
would close a cycle through the CPU, its nodes are regrouped in topological order, each joining the region of
one of its dispatch producers unless that would close a cycle (checked on the graph of regions), and then the
regions that meet along an edge merged where that closes none, so regions stay as large as the cycles allow.

What the NPU takes is the target's to say: for a dispatch target (AMD's), its registry's ops; for a standard
target (Qualcomm's HTP), every node its table's limits accept (``sdnpu.passes.standard.refusals``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx
import onnx_ir as ir

from sdnpu.formats.keys import DECLINED_TAG, REASON_TAG, REGION_TAG
from sdnpu.ops.target import DispatchTarget, StandardTarget, Target
from sdnpu.passes.manager import PassResult
from sdnpu.passes.standard import refusals


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


def _contracted(g: nx.DiGraph, owner: dict[ir.Node, int]) -> nx.DiGraph:
    c = nx.DiGraph()
    for u, v in g.edges:
        cu, cv = owner.get(u, u), owner.get(v, v)
        if cu != cv:
            c.add_edge(cu, cv)
    return c


def _acyclic(g: nx.DiGraph, owner: dict[ir.Node, int]) -> bool:
    try:
        nx.find_cycle(_contracted(g, owner))
    except nx.NetworkXNoCycle:
        return True
    return False


def _joins(g: nx.DiGraph, owner: dict[ir.Node, int], regions: dict[int, list[ir.Node]], node: ir.Node,
           region: int) -> bool:
    """Whether ``node`` (a vertex of its own in the graph of regions) may join ``region`` (whose nodes all come
    before it in graph order) without closing a cycle through them: no path leads from the region to one of the
    node's other producers. (No path leads from the node back to the region: the region's nodes precede it.) A
    search from the region alone, where rebuilding the graph of regions for each node cost a component of 800
    nodes half a minute (Kandinsky 3)."""
    producers = {owner.get(q, q) for q in g.predecessors(node)} - {region}
    if not producers:
        return True
    seen: set[object] = {region}
    stack: list[object] = [region]
    while stack:
        x = stack.pop()
        for m in regions[x] if isinstance(x, int) else (x,):  # type: ignore[index]
            for s in g.successors(m):
                y = owner.get(s, s)
                if y in seen or y is node:
                    continue
                if y in producers:
                    return False
                seen.add(y)
                stack.append(y)
    return True


def _regroup(g: nx.DiGraph, members: list[ir.Node], owner: dict[ir.Node, int], next_id: int) -> int:
    """Regroup ``members`` (a component on a cycle) in topological order: each joins the region of one of
    its producers in the component where that closes no cycle through it, else starts one. Returns the next
    free id."""
    member_set = set(members)
    for node in members:
        del owner[node]
    regions: dict[int, list[ir.Node]] = {}
    for n, r in owner.items():
        regions.setdefault(r, []).append(n)
    for node in members:  # graph order is topological
        for p in g.predecessors(node):
            if p not in member_set or p not in owner:
                continue
            if _joins(g, owner, regions, node, owner[p]):
                owner[node] = owner[p]
                regions[owner[p]].append(node)
                break
        if node not in owner:
            owner[node] = next_id
            regions[next_id] = [node]
            next_id += 1
    _merge_neighbours(g, members, owner)
    return next_id


def _merge_neighbours(g: nx.DiGraph, members: list[ir.Node], owner: dict[ir.Node, int]) -> None:
    """Regions of the regrouped ``members`` that one dispatch op's output joins to another's input, merged where
    that closes no cycle: a node joins one producer's region, so a region that starts at its own root (a
    linear layer on a CPU value, Stable Cascade's timestep mappers) would otherwise stay apart from the region
    that reads it."""
    member_set = set(members)
    tried: set[tuple[int, int]] = set()
    merged = True
    while merged:
        merged = False
        for u in members:
            for v in g.successors(u):
                a, b = owner.get(u), owner.get(v)
                if v not in member_set or a is None or b is None or a == b or (a, b) in tried:
                    continue
                tried.add((a, b))
                moved = [n for n in members if owner.get(n) == b]
                for n in moved:
                    owner[n] = a
                if _acyclic(g, owner):
                    merged = True
                    break
                for n in moved:
                    owner[n] = b
            if merged:
                break


def refused(graph: ir.Graph, target: Target) -> dict[ir.Node, str]:
    """Every node the NPU does not take, with the reason."""
    if isinstance(target, StandardTarget):
        return refusals(graph, target)
    assert isinstance(target, DispatchTarget)
    return {n: _cpu_reason(n, target) for n in graph if not target.is_dispatch(n.domain, n.op_type)}


def propose_regions(graph: ir.Graph, target: Target, cpu: dict[ir.Node, str] | None = None) -> list[list[ir.Node]]:
    """The regions, each a list of NPU nodes in graph order (``cpu``: the nodes the NPU does not take, as
    ``refused`` gives them); the graph is not changed."""
    cpu = refused(graph, target) if cpu is None else cpu
    g = _node_graph(graph)
    order = {n: i for i, n in enumerate(graph)}
    npu = [n for n in graph if n not in cpu]
    sub = g.subgraph(npu).to_undirected(as_view=True)
    components = [sorted(c, key=order.__getitem__) for c in nx.connected_components(sub)]
    owner = {n: i for i, comp in enumerate(components) for n in comp}
    next_id = len(components)
    for _ in range(len(npu) + 1):
        try:
            cycle = nx.find_cycle(_contracted(g, owner))
        except nx.NetworkXNoCycle:
            break
        bad = next(c for edge in cycle for c in edge[:2] if isinstance(c, int))
        members = sorted((n for n, o in owner.items() if o == bad), key=order.__getitem__)
        if len(members) == 1:  # cannot happen in a DAG; guard against looping
            break
        next_id = _regroup(g, members, owner, next_id)
    groups: dict[int, list[ir.Node]] = {}
    for n in npu:
        groups.setdefault(owner[n], []).append(n)
    return sorted(groups.values(), key=lambda grp: order[grp[0]])


def _cpu_reason(node: ir.Node, target: DispatchTarget) -> str:
    if target.is_boundary(node.domain, node.op_type):
        return "CPU<->NPU boundary cast (CastAvx runs on the CPU)"
    declined = node.metadata_props.get(DECLINED_TAG)
    if declined:
        return declined
    if node.domain not in ("", "ai.onnx"):
        return f"{node.domain}::{node.op_type}: not in the {target.name} registry"
    return target.cpu_reason(node.op_type)


_CHOSEN = ("GlueLowering:", "Reshape: read by the CPU")  # CPU by the compiler's choice, not the registry's lack


def cpu_islands(graph: ir.Graph, target: Target, reasons: dict[ir.Node, str] | None = None) -> dict[str, int]:
    """The CPU nodes' connected groups (through CPU-to-CPU edges), each classed by why it is there: at the
    graph's edges (it reads a graph input or writes an output), around an op the registry lacks (a node whose
    reason is not a boundary cast, an element-wise op kept on CPU values, or a Reshape the CPU reads), or
    neither: an island the data flow does not call for, between dispatch ops."""
    reasons = refused(graph, target) if reasons is None else reasons
    cpu = [n for n in graph if n in reasons]
    g = nx.Graph()
    g.add_nodes_from(cpu)
    members = set(cpu)
    for n in cpu:
        for v in n.inputs:
            if v is not None and v.producer() in members:
                g.add_edge(v.producer(), n)
    counts = {"CPU islands": 0, "at the edges": 0, "around ops the registry lacks": 0, "avoidable": 0}
    for island in nx.connected_components(g):
        counts["CPU islands"] += 1
        edge = any(v is not None and v.is_graph_input() for n in island for v in n.inputs) or any(
            o.is_graph_output() for n in island for o in n.outputs)
        lacks = any(not target.is_boundary(n.domain, n.op_type) and not (
            n.metadata_props.get(REASON_TAG) or reasons[n]).startswith(_CHOSEN) for n in island)
        counts["at the edges" if edge else "around ops the registry lacks" if lacks else "avoidable"] += 1
    return counts


def partition(model: ir.Model, target: Target) -> PassResult:
    graph = model.graph
    before = [(n.metadata_props.get(REGION_TAG), n.metadata_props.get(REASON_TAG)) for n in graph]
    reasons = refused(graph, target)
    regions = propose_regions(graph, target, reasons)
    out: list[Region] = []
    for i, grp in enumerate(regions):
        members = set(grp)
        region = Region(i, [n.name or n.op_type for n in grp])
        for n in grp:
            n.metadata_props[REGION_TAG] = str(i)
            n.metadata_props.pop(REASON_TAG, None)
            for v in n.inputs:
                outside = v is not None and v.const_value is None and v.producer() not in members
                if outside and v.name not in region.inputs:  # type: ignore[union-attr]
                    region.inputs.append(v.name or "")  # type: ignore[union-attr]
            for v in n.outputs:
                if v.is_graph_output() or any(u.node not in members for u in v.uses()):
                    region.outputs.append(v.name or "")
        out.append(region)
    cpu = 0
    for node in graph:
        if node in reasons:
            node.metadata_props[REASON_TAG] = reasons[node]
            node.metadata_props.pop(REGION_TAG, None)
            cpu += 1
    transitions = sum(len(r.inputs) + len(r.outputs) for r in out)
    after = [(n.metadata_props.get(REGION_TAG), n.metadata_props.get(REASON_TAG)) for n in graph]
    islands = cpu_islands(graph, target, reasons)
    counts = {"NPU regions": len(out), "CPU nodes": cpu, "transitions": transitions, "CPU islands": islands.pop(
        "CPU islands"), **{f"CPU islands {k}": v for k, v in islands.items()}}
    return PassResult(modified=after != before, counts=counts, regions=out)
