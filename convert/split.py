"""Cut one graph into consecutive pieces, each holding at most a given weight, for a vendor compiler that limits
what one compiled unit may hold (QNN: one context binary lives in the HTP's 32-bit address space, about 3.5 GB,
and the SDXL UNet's fp16 weights are 5.1 GB).

The graph is read without its weights (``onnx.load(..., load_external_data=False)``) and its nodes are taken in
their (topological) file order. A piece is a run of consecutive nodes. Its inputs are the graph inputs it reads
and the values earlier pieces wrote; its outputs are the values later pieces or the graph read. A weight read by
two pieces is in both; a ``Constant`` node is copied into every piece that reads it rather than carried across a
cut. Where the cuts go: the fewest pieces the limit allows, each cut near an equal share of the weight (within a
tenth of a share), at the node where the fewest bytes of activations cross (a UNet's skip connections cross
every cut; a transformer's residual stream is one tensor).

A piece is written as an ONNX model beside the graph's file that points into the graph's own data file
(``write_piece``): nothing is copied, and the vendor's compiler reads the piece's weights only.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from sdnpu.errors import SdnpuError

log = logging.getLogger(__name__)

_WINDOW = 0.1  # a cut lies within this share of one piece's weight of its even place


@dataclass(frozen=True)
class Piece:
    """Nodes ``start`` to ``end`` (exclusive) of the graph, what it reads from before and writes for after."""

    index: int
    start: int
    end: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weight_bytes: int  # what its weights take in the compiled precision

    def to_json(self) -> dict[str, Any]:
        return {"nodes": self.end - self.start, "inputs": list(self.inputs), "outputs": list(self.outputs),
                "weight_bytes": self.weight_bytes}


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _elements(dims: Any) -> int:
    return int(np.prod([int(d) for d in dims], dtype=np.int64)) if len(dims) else 1


def weight_bytes(t: onnx.TensorProto, float_bytes: int) -> int:
    """What ``t`` takes once compiled: a float tensor at ``float_bytes`` a value (fp16: 2), the rest as stored."""
    n = _elements(t.dims)
    if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                       onnx.TensorProto.BFLOAT16):
        return n * float_bytes
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def _reads(node: onnx.NodeProto) -> list[str]:
    """The values ``node`` reads: its inputs and what its subgraphs read from the enclosing scope."""
    names = [n for n in node.input if n]
    for a in node.attribute:
        for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                  list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
            inner = {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                names += [x for x in _reads(n) if x not in inner]
                inner.update(n.output)
    return names


def _value_bytes(info: dict[str, onnx.ValueInfoProto], name: str) -> int:
    """An activation's bytes from its inferred type (1 where its shape is not known: it still counts)."""
    v = info.get(name)
    if v is None or not v.type.HasField("tensor_type"):
        return 1
    t = v.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
    try:
        size = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).itemsize
    except (KeyError, TypeError):
        size = 4
    return max(1, _elements(dims) * size)


@dataclass
class _Layout:
    """What the cuts are chosen by: the nodes in order, what each reads, each weight's bytes, each node's own
    weights (first use), the activation bytes that cross a cut after each node, and those each node writes."""

    nodes: list[onnx.NodeProto]
    reads: list[list[str]]
    inits: dict[str, int]
    own: np.ndarray
    crossing: np.ndarray
    written: np.ndarray


def _layout(model: onnx.ModelProto, float_bytes: int) -> _Layout:
    g = model.graph
    nodes = list(g.node)
    inits = {t.name: weight_bytes(t, float_bytes) for t in g.initializer}
    consts = {o for n in nodes if n.op_type == "Constant" for o in n.output}
    free = set(inits) | {i.name for i in g.input} | consts  # every piece reads these where they lie
    reads = [_reads(n) for n in nodes]
    own = np.asarray([sum(inits[x] for x in dict.fromkeys(r) if x in inits) for r in reads], dtype=np.int64)
    # crossing[k]: activation bytes that cross a cut after node k (written at or before k, read after it)
    info = {v.name: v for v in [*g.value_info, *g.output]}
    last: dict[str, int] = {}
    for k, r in enumerate(reads):
        for x in r:
            if x not in free:
                last[x] = k
    for o in g.output:
        last[o.name] = len(nodes)
    delta = np.zeros(len(nodes) + 1, dtype=np.int64)
    written = np.zeros(len(nodes), dtype=np.int64)
    for k, n in enumerate(nodes):
        for o in n.output:
            if o and o not in consts:
                written[k] += _value_bytes(info, o)
            if o in last and o not in consts and last[o] > k:
                delta[k] += _value_bytes(info, o)
                delta[last[o]] -= _value_bytes(info, o)
    return _Layout(nodes, reads, inits, own, np.cumsum(delta), written)


def plan(model: onnx.ModelProto, limit: int, float_bytes: int = 2) -> list[Piece]:
    """The pieces of ``model``'s graph, each with at most ``limit`` bytes of weights (one piece where the whole
    fits). A single node whose weights pass the limit alone cannot be cut: that is an error naming it."""
    g = model.graph
    lay = _layout(model, float_bytes)
    nodes, own = lay.nodes, lay.own
    total = sum(lay.inits.values())
    if total <= limit:
        return [_cut(g, lay, 0, 0, len(nodes))]
    for i, w in enumerate(own):
        if w > limit:
            raise SdnpuError(f"node {nodes[i].name or i} ({nodes[i].op_type}) alone holds {_size(w)} of weights, "
                             f"more than one compiled unit holds ({_size(limit)})",
                             hint="a larger --context-gb, if the NPU allows it")
    cum = np.cumsum(own)  # first-use weight sums (a weight two pieces read is counted once here)
    fewest = math.ceil(total / limit)
    for cuts in [*(_even(cum, lay.crossing, total, n) for n in range(fewest, min(fewest + 4, len(nodes) + 1))),
                 _greedy(cum, lay.crossing, limit)]:
        if cuts is None:
            continue
        bounds = [0, *(c + 1 for c in cuts), len(nodes)]
        pieces = [_cut(g, lay, i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        if all(p.weight_bytes <= limit for p in pieces):
            return pieces
    raise SdnpuError(f"cannot cut {g.name or 'the graph'} into pieces of at most {_size(limit)} of weights",
                     hint="a larger --context-gb, if the NPU allows it")


def halve(model: onnx.ModelProto, piece: Piece, float_bytes: int = 2, by: str = "weight") -> list[Piece]:
    """``piece`` cut in two near the middle of its weight (of its nodes, where it has none), or with ``by=
    "activations"`` of the activation bytes its nodes write, where the fewest bytes cross: for a compiler that
    could not fit it (QNN: the HTP's memory holds the weights and the activations; the compile's own memory on
    this machine grows with the activations: SD 3.5's attention scores at 1024 px are 3.8 GB each)."""
    a, b = piece.start, piece.end
    if b - a < 2:
        raise SdnpuError(f"one node ({model.graph.node[a].op_type}) is more than one compiled unit holds",
                         hint="this graph cannot be compiled for this NPU as it is")
    lay = _layout(model, float_bytes)
    cum = np.cumsum((lay.written if by == "activations" else lay.own)[a:b])
    if cum[-1] > 0:
        half = cum[-1] / 2
        lo = int(np.searchsorted(cum, half * (1 - 2 * _WINDOW)))
        hi = int(np.searchsorted(cum, half * (1 + 2 * _WINDOW), side="right"))
    else:
        lo, hi = (b - a) // 4, 3 * (b - a) // 4
    lo, hi = min(lo, b - a - 2), min(max(hi, lo + 1), b - a - 1)
    k = a + lo + int(np.argmin(lay.crossing[a + lo:a + hi]))
    return [_cut(model.graph, lay, piece.index, a, k + 1), _cut(model.graph, lay, piece.index + 1, k + 1, b)]


def _even(cum: np.ndarray, crossing: np.ndarray, total: int, count: int) -> list[int] | None:
    """``count`` pieces of about equal weight: each cut where the fewest bytes cross, within a tenth of a
    share of its even place. None where a share has no node to cut after (one weight outweighs the rest)."""
    share, cuts = total / count, []
    for j in range(1, count):
        lo = int(np.searchsorted(cum, share * (j - _WINDOW)))
        hi = int(np.searchsorted(cum, share * (j + _WINDOW), side="right"))
        lo = max(lo, cuts[-1] + 1 if cuts else 0)
        hi = min(hi, len(cum) - 1)
        if lo >= hi:
            return None
        cuts.append(lo + int(np.argmin(crossing[lo:hi])))
    return cuts


def _greedy(cum: np.ndarray, crossing: np.ndarray, limit: int) -> list[int] | None:
    """Pieces as full as the limit allows (for weights spread unevenly: a text encoder's token table), each cut
    where the fewest bytes cross in the last fifth of what it may hold."""
    cuts: list[int] = []
    base = 0
    while cum[-1] - base > limit:
        hi = int(np.searchsorted(cum, base + limit, side="right")) - 1  # the last node the piece may end at
        lo = max(int(np.searchsorted(cum, base + limit * (1 - 2 * _WINDOW))), cuts[-1] + 1 if cuts else 0)
        if hi < lo:
            return None
        cuts.append(lo + int(np.argmin(crossing[lo:hi + 1])))
        base = int(cum[cuts[-1]])
    return cuts


def piece_of(model: onnx.ModelProto, start: int, end: int, float_bytes: int = 2) -> Piece:
    """Nodes ``start`` to ``end`` of ``model``'s graph as a piece (a block to compile and run alone)."""
    return _cut(model.graph, _layout(model, float_bytes), 0, start, end)


def _cut(g: onnx.GraphProto, lay: _Layout, index: int, start: int, end: int) -> Piece:
    """Nodes ``start`` to ``end`` as a piece: what it reads from before, writes for after, and its weights."""
    nodes, reads = lay.nodes, lay.reads
    consts = {o for n in nodes if n.op_type == "Constant" for o in n.output}
    written = {o for k in range(start, end) for o in nodes[k].output}
    inputs = dict.fromkeys(x for k in range(start, end) for x in reads[k]
                           if x not in written and x not in lay.inits and x not in consts)
    later = {x for k in range(end, len(nodes)) for x in reads[k]} | {o.name for o in g.output}
    outputs = [o for k in range(start, end) for o in nodes[k].output if o in later and o not in consts]
    weights = {x for k in range(start, end) for x in reads[k] if x in lay.inits}
    return Piece(index, start, end, tuple(inputs), tuple(outputs), sum(lay.inits[x] for x in weights))


def write_piece(model: onnx.ModelProto, piece: Piece, path: Path) -> None:
    """``piece`` as an ONNX model at ``path``, in the folder of the graph's own file: its weights stay where they
    are (an external one keeps its location and offset), its inputs and outputs keep their names and types."""
    g = model.graph
    nodes = list(g.node)[piece.start:piece.end]
    reads = {x for n in nodes for x in _reads(n)}
    consts = [n for k, n in enumerate(g.node) if n.op_type == "Constant" and not piece.start <= k < piece.end
              and any(o in reads for o in n.output)]
    info = {v.name: v for v in [*g.input, *g.value_info, *g.output]}
    missing = [x for x in [*piece.inputs, *piece.outputs] if x not in info]
    if missing:
        raise SdnpuError(f"the graph has no type for {', '.join(missing[:3])} where it is cut into pieces",
                         hint="this is a compiler bug worth reporting with the model")
    graph = onnx.helper.make_graph(
        [*consts, *nodes], f"{g.name or 'graph'}_piece{piece.index}",
        [info[x] for x in piece.inputs], [info[x] for x in piece.outputs],
        initializer=[t for t in g.initializer if t.name in reads],
        value_info=[v for v in g.value_info if v.name in reads and v.name not in piece.inputs])
    out = onnx.helper.make_model(graph, opset_imports=list(model.opset_import), ir_version=model.ir_version)
    out.producer_name, out.producer_version = model.producer_name, model.producer_version
    with open(path, "wb") as f:
        f.write(out.SerializeToString())
