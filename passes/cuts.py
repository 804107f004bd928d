"""Cuts: the Slices and Splits left on the CPU, gathered into one Split per value and axis. No dispatch op can
say which part of a tensor it takes (DD's SDSlice is keyed on shapes alone), so a cut that the streams pass
(``passes/streams.py``) could not compute as its parts stays on the CPU; what this pass decides is how many
CPU nodes it costs.

Chroma computes all its modulation vectors at once, a table [B, 344, D] from one MLP, and each block reads its
rows: ``Slice(rows r..r+6) -> Reshape([B, 6 D]) -> Split(6)``, three CPU nodes a block for the image stream and
three for the text, so a deeper model has more of them. Computed as parts, the MLP would read its weights once
a block, which the streams pass refuses (its ``MIN_ROWS``). Flux's rotary tables, cut at the edge into the text
and image rows, are cut twice (cos and sin, each into two Slices). Two rewrites make each table one node:

1. *Cuts followed to where they start.* A part of a cut is a part of the cut's input (the offsets add up), and
   a part of a Reshape that merges the cut axis with the axes after it, whose bounds fall on whole rows of the
   axis before the merge, is a part of the Reshape's input read through a Reshape of its own:

       Split_i(Reshape([B, 6 D])(Slice(T, rows r..r+6))) == Reshape([B, D])(T[:, r + i])

2. *One Split per value and axis.* The parts of one value along one axis that are disjoint (or equal) become
   the outputs of one Split at all their bounds (a stretch no cut reads is made and not read). A part read as
   another shape keeps a Reshape, which the dispatch op that reads it absorbs as a view (``passes/views.py``).

Only parts that dispatch ops read are moved (that is where they stay bf16 bits, after the precision pass), and
only where at least two cut nodes become one. The parts are the same bits: the rewrite is exact.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.irutil import Builder, remove_dead_nodes, reroute, static_shape
from sdnpu.passes.manager import PassResult
from sdnpu.passes.streams import cut_axis, cut_bounds, slice_span
from sdnpu.passes.views import absorb_views

RULE = "Cuts"


@dataclass(frozen=True)
class _Part:
    value: ir.Value  # what a cut node writes
    root: ir.Value  # the value it is a part of, followed back through cuts and merging Reshapes
    axis: int
    lo: int
    hi: int
    path: frozenset[int]  # the nodes on the way (ids): the cut node and what it was followed through


def _onnx(node: ir.Node | None, *ops: str) -> bool:
    return node is not None and node.domain in ("", "ai.onnx") and node.op_type in ops


def _cut_parts(node: ir.Node) -> list[tuple[ir.Value, int, int, int]] | None:
    """(output, axis, lo, hi) for every output of a Slice or Split with constant bounds along one axis (step
    1), or None: the streams pass's reading of a cut."""
    shape = static_shape(node.inputs[0]) if node.inputs else None
    if not shape:
        return None
    axis = cut_axis(node, len(shape))
    bounds = cut_bounds(node, axis, shape[axis]) if axis is not None else None
    if bounds is None:
        return None
    if node.op_type == "Split":
        if len(bounds) != len(node.outputs):
            return None
        return [(o, axis, lo, hi) for o, (lo, hi) in zip(node.outputs, bounds, strict=True)]  # type: ignore[misc]
    return [(node.outputs[0], axis, *slice_span(node, shape[axis]))]  # type: ignore[list-item]


def _merged_axis(src: tuple[int, ...], dst: tuple[int, ...], axis: int) -> tuple[int, int] | None:
    """Where ``dst``'s ``axis`` comes from when a Reshape ``src -> dst`` merges ``src``'s axes ``a..b`` into it
    (everything before and after unchanged): (a, the size of the axes a+1..b), or None."""
    if axis >= len(dst) or len(src) < len(dst):
        return None
    a = axis
    if tuple(src[:a]) != tuple(dst[:a]):
        return None
    k = len(src) - len(dst)  # axes merged into one
    if tuple(src[a + k + 1:]) != tuple(dst[a + 1:]):
        return None
    inner = int(np.prod(src[a + 1:a + k + 1], dtype=np.int64)) if k else 1
    return (a, inner) if src[a] * inner == dst[a] else None


def _follow(v: ir.Value, axis: int, lo: int, hi: int) -> tuple[ir.Value, int, int, int, set[int]]:
    """The value ``v[axis: lo..hi]`` is a part of, through the cuts and merging Reshapes that made ``v``, and
    the nodes passed on the way."""
    path: set[int] = set()
    for _ in range(16):
        p = v.producer()
        if p is not None and _onnx(p, "Slice", "Split", "Reshape"):
            path.add(id(p))
        if _onnx(p, "Slice", "Split"):
            parts = _cut_parts(p)  # type: ignore[arg-type]
            hit = next((q for q in parts or () if q[0] is v), None)
            if hit is None or hit[1] != axis:
                break
            v, lo, hi = p.inputs[0], hit[2] + lo, hit[2] + hi  # type: ignore[union-attr, assignment]
            continue
        if _onnx(p, "Reshape"):
            src, dst = static_shape(p.inputs[0]), static_shape(v)  # type: ignore[union-attr]
            merged = _merged_axis(src, dst, axis) if src is not None and dst is not None else None
            if merged is None or lo % merged[1] or hi % merged[1]:
                break
            v, axis, lo, hi = p.inputs[0], merged[0], lo // merged[1], hi // merged[1]  # type: ignore[union-attr, assignment]
            continue
        path.discard(id(p))
        break
    return v, axis, lo, hi, path


def _read_as_view(v: ir.Value, target: DispatchTarget) -> bool:
    """Every reader of ``v`` is a dispatch op that reads it through a view attribute (so a Reshape in front
    of it is absorbed), and ``v`` is no graph output."""
    if v.is_graph_output() or not v.uses():
        return False
    for use in v.uses():
        n = use.node
        if not target.is_dispatch(n.domain, n.op_type):
            return False
        spec = target.base_spec(n.op_type)
        if use.idx not in spec.input_views({k: a.value for k, a in n.attributes.items()}):
            return False
    return True


def _gather(graph: ir.Graph, target: DispatchTarget, root: ir.Value, axis: int, parts: list[_Part]) -> bool:
    shape = static_shape(root)
    assert shape is not None
    spans = sorted({(p.lo, p.hi) for p in parts})
    if any(a[1] > b[0] for a, b in zip(spans, spans[1:], strict=False)):  # overlapping parts: leave them
        return False
    if len(frozenset().union(*(p.path for p in parts))) < 2:  # one cut node already
        return False
    bounds = sorted({0, shape[axis], *(x for s in spans for x in s)})
    segments = list(zip(bounds, bounds[1:], strict=False))
    b = Builder(graph, RULE, target)
    sizes = b.const(np.asarray([hi - lo for lo, hi in segments], np.int64), f"{root.name}_cuts")
    split = b.op("Split", [root, sizes], {"axis": axis}, n_out=len(segments))
    made: dict[tuple[int, int], ir.Value] = {}
    for out, (lo, hi) in zip(split.outputs, segments, strict=True):
        out.dtype = root.dtype
        out.shape = ir.Shape([*shape[:axis], hi - lo, *shape[axis + 1:]])
        made[(lo, hi)] = out
    reads: list[tuple[ir.Value, ir.Value]] = []
    for p in parts:
        seg = made[(p.lo, p.hi)]
        want = static_shape(p.value)
        if want is not None and want != static_shape(seg):
            r = b.op("Reshape", [seg, b.const(np.asarray(want, np.int64), f"{p.value.name}_view")],
                     dtype=root.dtype, shape=list(want))
            seg = r.outputs[0]
        reads.append((p.value, seg))
    graph.insert_before(parts[0].value.producer(), b.nodes)  # type: ignore[arg-type]  # placed by the sort after
    for old, new in reads:
        reroute(graph, old, new)
    return True


def gather_cuts(model: ir.Model, target: DispatchTarget) -> PassResult:
    """Every value's CPU cuts along one axis as one Split (module docstring)."""
    graph = model.graph
    counts: Counter[str] = Counter()
    groups: dict[tuple[int, int], list[_Part]] = defaultdict(list)
    roots: dict[int, ir.Value] = {}
    for node in graph:
        if not _onnx(node, "Slice", "Split"):
            continue
        for out, axis, lo, hi in _cut_parts(node) or ():
            if out.is_graph_output() or not out.uses() or not all(
                    target.is_dispatch(u.node.domain, u.node.op_type) for u in out.uses()):
                continue  # a part the CPU reads stays as it is
            root, r_axis, r_lo, r_hi, path = _follow(node.inputs[0], axis, lo, hi)  # type: ignore[arg-type]
            if root.const_value is not None or static_shape(root) is None:
                continue
            part = _Part(out, root, r_axis, r_lo, r_hi, frozenset({id(node), *path}))
            want = static_shape(out)
            seg_shape = list(static_shape(root))  # type: ignore[arg-type]
            seg_shape[r_axis] = r_hi - r_lo
            if want is not None and list(want) != seg_shape and not _read_as_view(out, target):
                continue  # it would need a Reshape on the CPU
            groups[(id(root), r_axis)].append(part)
            roots[id(root)] = root
    for (rid, axis), parts in groups.items():
        if _gather(graph, target, roots[rid], axis, parts):
            counts["values cut by one Split"] += 1
            counts["cut nodes gathered"] += len(frozenset().union(*(p.path for p in parts)))
    if counts:
        counts["nodes left dead"] = remove_dead_nodes(graph)
        graph.sort()
        absorbed = absorb_views(model, target)
        counts.update({k: v for k, v in absorbed.counts.items() if k.startswith("views")})
    return PassResult(modified=bool(counts), counts=dict(counts))
