"""Stitch graphs that were exported (and compiled) one piece at a time into one graph, without holding their
weights in memory: the pieces' protos are read without their data, renamed apart, chained output to input,
and their weights copied byte for byte into the stitched graph's one data file.

Each input of piece ``i`` (``i > 0``) is an output of an earlier piece of the same name, the latest (an output
``x.next`` feeds inputs ``x``, a piece with one output also the next piece's ``chain_input``: T5's
``block_output`` -> ``hidden_states``); piece 0's
inputs and the last piece's outputs are the stitched graph's. A value several later pieces read (Flux.1's
timestep embedding and rotary tables, written once by its first piece) is read by all of them. Every other
name gets the piece's prefix (``b7/``). Where a dispatch model's piece ends in a ``CastAvx`` back to fp32 and
the pieces after it start with ``CastAvx`` to bf16 of it, the casts go: the bf16 value flows on (exact: a bf16
value widened to fp32 and narrowed again is itself). Identical small constants (the pieces each carry T5's
position bias) are kept once, and so are identical nodes on identical inputs (each piece's cast of a shared
table, the same Split or activation of it): the first computes it for all.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from sdnpu import external
from sdnpu.convert import shared

log = logging.getLogger(__name__)

_DEDUP_BYTES = 16 << 20  # constants up to this size are compared by content and kept once
_INLINE_BYTES = 1024  # smaller constants stay in the graph; the rest go to the data file
_ALIGN = 64  # each tensor's offset in the data file


@dataclass
class StitchStats:
    pieces: int = 0
    nodes: int = 0
    initializers: int = 0
    deduplicated: int = 0
    casts_cancelled: int = 0
    repeated_nodes: int = 0  # nodes that computed what an earlier piece's node computes, on the same inputs
    retyped: set[str] = field(default_factory=set)  # values a cancelled seam left in bf16 (their types dropped)
    data_bytes: int = 0
    alias: dict[str, str] = field(default_factory=dict)  # a constant dropped as a repeat -> the one kept


def _copy(message: Any) -> Any:
    """A copy of a piece's message that holds no reference into the piece's proto: a sub-message kept from a
    loaded model keeps all of that model's memory alive (a 0.8 GB T5-XXL block, for each piece)."""
    out = type(message)()
    out.CopyFrom(message)
    return out


def _rename_graph(g: onnx.GraphProto, names: dict[str, str]) -> None:
    def r(n: str) -> str:
        return names.get(n, n) if n else n

    for node in g.node:
        if node.name:
            node.name = r(node.name)
        node.input[:] = [r(n) for n in node.input]
        node.output[:] = [r(n) for n in node.output]
    for t in g.initializer:
        t.name = r(t.name)
    for coll in (g.input, g.output, g.value_info):
        for v in coll:
            v.name = r(v.name)


_VIEWS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})  # ops that move no value: any dtype


def _cancel_casts(nodes: list[onnx.NodeProto], link: str, outputs: set[str], cast: tuple[str, str],
                  retyped: set[str]) -> int:
    """Remove ``CastAvx(to=fp32)`` writing ``link`` (through views: a piece's output viewed back to its own
    shape after the cast) and the ``CastAvx(to=bf16)`` nodes reading it, when those are all that reads it;
    the views then run on the bf16 value (their outputs go into ``retyped``), and the readers of the bf16
    copies read it."""
    domain, op = cast
    by_output = {o: n for n in nodes for o in n.output}

    def is_cast(n: onnx.NodeProto, dtype: int) -> bool:
        return n.domain == domain and n.op_type == op and any(a.name == "to" and a.i == dtype for a in n.attribute)

    views, value = [], link
    while (writer := by_output.get(value)) is not None and writer.domain == "" and writer.op_type in _VIEWS:
        views.append(writer)
        value = writer.input[0]
    if writer is None or link in outputs or not is_cast(writer, onnx.TensorProto.FLOAT):
        return 0
    chain = {id(writer), *(id(v) for v in views)}
    inner = {x for v in (writer, *views) for x in v.output} - {link}
    if any(x in inner for n in nodes if id(n) not in chain for x in n.input):
        return 0  # an intermediate of the chain is read elsewhere
    readers = [n for n in nodes if link in n.input]
    if not readers or not all(is_cast(n, onnx.TensorProto.BFLOAT16) for n in readers):
        return 0
    source = writer.input[0]
    gone = {id(writer), *(id(n) for n in readers)}
    renamed = {n.output[0]: link for n in readers} if views else {n.output[0]: source for n in readers}
    renamed[writer.output[0]] = source  # the first view reads the bf16 value
    retyped.update(o for v in views for o in v.output)
    kept = [n for n in nodes if id(n) not in gone]
    for n in kept:
        n.input[:] = [renamed.get(x, x) for x in n.input]
    nodes[:] = kept
    return len(readers) + 1


NEXT = ".next"  # a piece output ``x.next`` feeds later pieces' input ``x`` (a graph cannot take and give one name)


def link_name(output: str) -> str:
    """The input name a piece's output feeds in later pieces (``NEXT``)."""
    return output.removesuffix(NEXT)


_IMPURE = ("Random", "Multinomial", "Bernoulli")  # op types that draw: two of them are not one


def _merge_repeats(nodes: list[onnx.NodeProto], outputs: set[str]) -> int:
    """Drop each node that computes what an earlier node computes (the same op, attributes and inputs; nodes
    are in order, so the earlier one's inputs are ready where the later one's are); its readers read the
    earlier one's outputs. Graph outputs are kept as they are written. Returns how many went."""
    seen: dict[tuple[Any, ...], list[str]] = {}
    renamed: dict[str, str] = {}
    kept = []
    for n in nodes:
        n.input[:] = [renamed.get(x, x) for x in n.input]
        key = (n.domain, n.op_type, tuple(n.input), tuple(a.SerializeToString() for a in n.attribute), len(n.output))
        first = seen.get(key)
        if first is not None and not n.op_type.startswith(_IMPURE) and not outputs & set(n.output):
            renamed.update((o, f) for o, f in zip(n.output, first, strict=True) if o)
            continue
        seen.setdefault(key, list(n.output))
        kept.append(n)
    gone = len(nodes) - len(kept)
    nodes[:] = kept
    return gone


@dataclass
class _Stitching:
    """What the stitched graph gathers from its pieces, piece after piece."""

    dest: Path
    chain_input: str
    prefix: str
    stats: StitchStats
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    value_info: list[onnx.ValueInfoProto] = field(default_factory=list)
    functions: dict[tuple[str, str, str], onnx.FunctionProto] = field(default_factory=dict)
    opsets: dict[str, int] = field(default_factory=dict)
    seen: dict[str, str] = field(default_factory=dict)  # digest -> kept name
    links: list[str] = field(default_factory=list)  # each chained value
    produced: dict[str, str] = field(default_factory=dict)  # a piece output's name -> its stitched name
    head: dict[str, Any] = field(default_factory=dict)
    graph_inputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    graph_outputs: list[onnx.ValueInfoProto] = field(default_factory=list)
    offset: int = 0

    @property
    def data_name(self) -> str:
        return self.dest.name + ".data"


def stitch(pieces: list[Path], dest: Path, chain_input: str, *, prefix: str = "b",
           cast: tuple[str, str] | None = None, consume: bool = False) -> StitchStats:
    """Write ``dest`` (and ``dest.data``) from the graphs ``pieces`` in order. ``chain_input``: the name of
    each later piece's input that takes the previous piece's (only) output. ``cast``: the (domain, op_type) of
    the boundary cast to cancel between pieces (dispatch models). ``consume``: delete each piece's graph and
    data once copied (the disk then holds the pieces or the stitched graph, not both)."""
    st = _Stitching(dest, chain_input, prefix, StitchStats(pieces=len(pieces)))
    with open(dest.parent / st.data_name, "wb") as data:
        for i, path in enumerate(pieces):
            m = onnx.load(str(path), load_external_data=False)
            own = {where[0] for t in m.graph.initializer if (where := external.place(t))}  # the piece's data files
            _add_piece(st, m, path, (i, i == len(pieces) - 1), data)
            del m
            log.debug("stitched piece %d of %d (%s)", i + 1, len(pieces), path)
            if consume:
                for location in own:
                    if (path.parent / location).resolve() != (dest.parent / st.data_name).resolve():
                        (path.parent / location).unlink(missing_ok=True)
                path.unlink()
    return _write(st, cast)


def _add_piece(st: _Stitching, m: onnx.ModelProto, path: Path, place: tuple[int, bool], data: Any) -> None:
    """Piece ``m`` (at ``path``; ``place``: its index, and whether it is the last) renamed apart, chained to the
    one before, and copied in."""
    g, (i, last) = m.graph, place
    if i == 0:  # what the stitched model takes from the first piece (copied: nothing of a piece is kept)
        st.head = {"graph": g.name, "ir_version": m.ir_version, "producer_name": m.producer_name,
                   "producer_version": m.producer_version, "metadata": [(p.key, p.value) for p in m.metadata_props]}
    inputs = [v.name for v in g.input]
    outs = [v.name for v in g.output]
    unknown = [n for n in inputs if n not in st.produced] if i > 0 else []
    if unknown:
        raise ValueError(f"piece {path} takes {unknown}, which no earlier piece gives ({sorted(st.produced)})")
    every = {n for node in g.node for n in (*node.input, *node.output) if n}
    every |= {t.name for t in g.initializer} | {v.name for v in g.value_info} | set(inputs) | set(outs)
    every |= {node.name for node in g.node if node.name}
    names = {n: f"{st.prefix}{i}/{n}" for n in every}
    if i == 0:
        names.update((n, n) for n in inputs)
    else:
        for n in inputs:
            names[n] = st.produced[n]
            if st.produced[n] not in st.links:
                st.links.append(st.produced[n])
    if last:
        names.update((n, n) for n in outs)
    _rename_graph(g, names)
    if i == 0:
        st.graph_inputs = [_copy(v) for v in g.input]
    if last:
        st.graph_outputs = [_copy(v) for v in g.output]
    for old_name, v in zip(outs, g.output, strict=True):
        st.produced[link_name(old_name)] = v.name
    if len(outs) == 1:
        st.produced[st.chain_input] = g.output[0].name
    _copy_weights(st, g, path.parent, data)
    st.nodes.extend(_copy(n) for n in g.node)
    st.value_info.extend(_copy(v) for v in g.value_info)
    for f in m.functions:
        st.functions.setdefault((f.domain, f.name, getattr(f, "overload", "")), _copy(f))
    for o in m.opset_import:
        st.opsets[o.domain] = max(st.opsets.get(o.domain, 0), o.version)


def _copy_weights(st: _Stitching, g: onnx.GraphProto, folder: Path, data: Any) -> None:
    """A piece's constants, byte for byte: small repeats kept once, small ones inline, the rest appended to the
    stitched data file."""
    handles: dict[str, Any] = {}
    try:
        for t in g.initializer:
            raw = shared.tensor_bytes(folder, t, handles)  # its values' bytes, wherever they lie
            if len(raw) <= _DEDUP_BYTES:
                digest = hashlib.sha256(f"{t.data_type}:{list(t.dims)}".encode() + raw).hexdigest()
                if digest in st.seen:
                    st.stats.alias[t.name] = st.seen[digest]
                    st.stats.deduplicated += 1
                    continue
                st.seen[digest] = t.name
            kept = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=list(t.dims))
            if len(raw) < _INLINE_BYTES:
                kept.raw_data = raw
            else:
                pad = (-st.offset) % _ALIGN
                data.write(b"\0" * pad + raw)
                external.point(kept, st.data_name, st.offset + pad, len(raw))
                st.offset += pad + len(raw)
            st.inits.append(kept)
    finally:
        for handle in handles.values():
            handle.close()


def _write(st: _Stitching, cast: tuple[str, str] | None) -> StitchStats:
    """The stitched graph: repeats read the constant kept, the boundary casts between pieces cancelled."""
    stats, nodes = st.stats, st.nodes
    stats.data_bytes = st.offset
    if not st.offset:
        (st.dest.parent / st.data_name).unlink()  # every constant inline: no data file
    for n in nodes:
        n.input[:] = [stats.alias.get(x, x) for x in n.input]
    outputs = {v.name for v in st.graph_outputs}
    if cast is not None:
        for link in st.links:
            stats.casts_cancelled += _cancel_casts(nodes, link, outputs, cast, stats.retyped)
    stats.repeated_nodes = _merge_repeats(nodes, outputs)
    present = {x for n in nodes for x in (*n.input, *n.output)}
    retyped = set(st.links) | stats.retyped  # now bf16 where a seam's views run on the bf16 value
    value_info = [v for v in st.value_info if v.name in present and v.name not in retyped]
    graph = onnx.helper.make_graph(nodes, st.head["graph"], st.graph_inputs, st.graph_outputs, st.inits,
                                   value_info=value_info)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in st.opsets.items()],
                                   functions=list(st.functions.values()), ir_version=st.head["ir_version"],
                                   producer_name=st.head["producer_name"], producer_version=st.head["producer_version"])
    for key, value in st.head["metadata"]:
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, str(st.dest))
    stats.nodes, stats.initializers = len(nodes), len(st.inits)
    return stats
