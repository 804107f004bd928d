"""Prologue pass: the CPU work a dispatch model does on the graph inputs named in ``CompileOptions.prologue``
(a step's inputs that another dispatch model reads too) moves into a model of its own (``sdnpu.formats.prologue``).

After cleanup, the nodes that are not dispatch ops and compute only from those inputs and constants (the
latents' Transpose and CastAvx, the timestep's sinusoid and its cast, ...) are taken out of the graph in
their order. Every value they give that the rest of the graph reads becomes a graph input of the dispatch
model, named ``prologue.<input>`` after the inputs it comes from (``prologue.<a>+<b>`` for several,
``.1``, ``.2`` ... where one input gives several), and an output of the prologue, whose inputs are those graph
inputs, with symbolic shapes (one prologue serves every size). The prologue's internal values are named in
order and its digest is taken over the whole of it but its metadata, so two compiles that cut the same work
from the same inputs (a ControlNet and the UNet beside it) write the same prologue with the same digest.

The prologue model is handed back in the pass result (``PassResult.prologue``); the compile writes it beside
the dispatch model. A graph without such work is left as it is.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter

import onnx_ir as ir

from sdnpu.formats import prologue as spec
from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.cleanup import attach_functions
from sdnpu.passes.irutil import remove_unused_initializers
from sdnpu.passes.manager import PassResult
from sdnpu.passes.partition import partition

log = logging.getLogger(__name__)


def _cut(graph: ir.Graph, target: DispatchTarget, names: frozenset[str]) -> tuple[list[ir.Node], dict[ir.Value, list[str]]]:
    """The nodes to move, in graph order, and for every value they or the named inputs give, the named inputs
    it comes from."""
    sources: dict[ir.Value, list[str]] = {v: [v.name or ""] for v in graph.inputs if v.name in names}
    order = [v.name for v in graph.inputs]
    moved: list[ir.Node] = []
    for node in graph:
        if target.is_dispatch(node.domain, node.op_type) or any(
                a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            continue
        came: set[str] = set()
        ok = True
        for v in node.inputs:
            if v is None or v.const_value is not None:
                continue
            if v not in sources:
                ok = False
                break
            came.update(sources[v])
        if not ok or not came:
            continue
        moved.append(node)
        for out in node.outputs:
            sources[out] = sorted(came, key=order.index)
    return moved, sources


def _canonical_digest(model: ir.Model) -> str:
    proto = ir.serde.serialize_model(model)
    del proto.metadata_props[:]
    return hashlib.sha256(proto.SerializeToString(deterministic=True)).hexdigest()[:16]


def cut_prologue(model: ir.Model, target: DispatchTarget, names: frozenset[str]) -> PassResult:
    graph = model.graph
    moved, sources = _cut(graph, target, names)
    inside = set(moved)
    frontier = [out for node in moved for out in node.outputs
                if out.is_graph_output() or any(u.node not in inside for u in out.uses())]
    if not moved or any(v.is_graph_output() for v in frontier):
        if moved:
            log.warning("prologue: a graph output is computed from the step inputs alone; nothing is moved")
        return PassResult(modified=False, counts={})
    # the prologue's outputs, named after the inputs they come from
    keys = ["+".join(sources[v]) for v in frontier]
    seen: Counter[str] = Counter(keys)
    index: Counter[str] = Counter()
    out_names = []
    for key in keys:
        index[key] += 1
        out_names.append(spec.PREFIX + key + (f".{index[key]}" if seen[key] > 1 else ""))

    # the prologue graph: new values for the inputs it reads, the constants, and every moved node's outputs
    mapped: dict[ir.Value, ir.Value] = {}
    read = [v for v in graph.inputs if v.name in names and any(u.node in inside for u in v.uses())]
    for v in read:
        rank = len(v.shape) if v.shape is not None else 0
        mapped[v] = ir.Value(name=v.name, type=v.type,
                             shape=ir.Shape([f"{v.name}_{i}" for i in range(rank)]))
    initializers: list[ir.Value] = []
    nodes: list[ir.Node] = []
    for k, node in enumerate(moved):
        inputs: list[ir.Value | None] = []
        for v in node.inputs:
            if v is None:
                inputs.append(None)
                continue
            if v not in mapped:  # a constant
                assert v.const_value is not None
                name = f"c{len(initializers)}"  # the exporter's names differ between two graphs
                const = ir.Value(name=name, type=v.type, shape=v.shape,
                                 const_value=ir.tensor(v.const_value.numpy(), name=name))
                initializers.append(const)
                mapped[v] = const
            inputs.append(mapped[v])
        new = ir.Node(node.domain, node.op_type, inputs, attributes=list(node.attributes.values()),
                      overload=node.overload, num_outputs=len(node.outputs), name=f"prologue_{k}")
        for j, (old, out) in enumerate(zip(node.outputs, new.outputs, strict=True)):
            out.name, out.type = f"p{k}_{j}", old.type
            mapped[old] = out
        nodes.append(new)
    outputs = []
    for v, name in zip(frontier, out_names, strict=True):
        out = mapped[v]
        out.name = name
        out.shape = ir.Shape([f"{name}_{i}" for i in range(len(v.shape))]) if v.shape is not None else None
        outputs.append(out)
    pro = ir.Model(ir.Graph([mapped[v] for v in read], outputs, nodes=nodes, initializers=initializers,
                            opset_imports=dict(graph.opset_imports), name="prologue"),
                   ir_version=model.ir_version, producer_name="sdnpu")
    attach_functions(pro, target)
    partition(pro, target)  # every node's CPU reason, for the report

    # the dispatch model takes the prologue's values
    new_inputs: dict[str, list[ir.Value]] = {}
    for v, name in zip(frontier, out_names, strict=True):
        value = ir.Value(name=name, type=v.type, shape=v.shape)
        v.replace_all_uses_with(value)
        new_inputs.setdefault(sources[v][0], []).append(value)
    kept: list[ir.Value] = []
    for v in graph.inputs:
        kept.extend(new_inputs.pop(v.name or "", []))
        if v.name not in names or any(u.node not in inside for u in v.uses()):
            kept.append(v)
    graph.inputs.clear()
    graph.inputs.extend(kept)
    graph.remove(list(reversed(moved)), safe=True)
    remove_unused_initializers(graph)
    attach_functions(model, target)
    digest = _canonical_digest(pro)
    record = spec.Prologue(spec.FILE, digest, tuple(v.name or "" for v in read), tuple(out_names))
    model.metadata_props[spec.KEY] = record.encode()
    pro.metadata_props[spec.KEY] = record.encode()
    log.info("prologue: %d CPU nodes on %s moved to %s (digest %s)", len(moved), ", ".join(record.inputs),
             spec.FILE, digest)
    counts = {"CPU nodes moved": len(moved), "values handed over": len(frontier)}
    return PassResult(modified=True, counts=counts, prologue=pro)
