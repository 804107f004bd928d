"""Block by block for a standard target (``qnn-htp``): each piece of ``sdnpu.convert.blockwise`` (T5's blocks,
Flux.1's) brought to the forms the NPU takes and compiled by the vendor into a context of its own, the contexts
chained in one ``qnn/ctx.onnx``. The module's fp32 graph is stitched from the pieces as for any target; the
rewritten pieces are compiled and deleted, so no rewritten graph of the whole is written (the disk holds the fp32
graph and the contexts: Flux.1 dev, 47.6 GB and 23.8 GB).

Per piece: its fp32 graph's run on PyTorch's inputs of the piece measures every tensor's magnitude (fp16
headroom, as ``sdnpu.convert.standard`` does for a whole graph, and the risks its guard pass reads); the standard
passes; the piece's inputs and outputs renamed to the chain's names (an output of piece ``i`` is ``b<i>/<name>``
but the module's own outputs, an input the latest earlier output of its link name: ``sdnpu.convert.stitch``); QNN's
compile with CPU fallback disabled into ``ctx<i+1>_qnn.bin``. Where the job checks and the emulator's time allows,
the contexts run one after another on the module's inputs, and the last one's outputs are measured against
PyTorch's pieces chained (each piece's fp32 graph within the export check of PyTorch).

The report counts the rewritten pieces together: their graphs, read without their weights, joined in one
(``_joined``: the names are the chain's, so the pieces meet) and reported as one graph.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from sdnpu.backends import backend_of
from sdnpu.convert.blockwise.piece import CHAIN_INPUT
from sdnpu.convert.split import weight_bytes
from sdnpu.convert.standard import compile_pieces, run_compiled, too_slow
from sdnpu.convert.stitch import link_name
from sdnpu.errors import SdnpuError
from sdnpu.passes.htp import guards_of
from sdnpu.passes.manager import records_json
from sdnpu.passes.modelfile import load, save
from sdnpu.passes.pipeline import CompileOptions, compile_model
from sdnpu.progress import release_memory, step
from sdnpu.reports import headroom
from sdnpu.reports import report as reports
from sdnpu.reports.fidelity import fidelity
from sdnpu.reports.report import macs_of
from sdnpu.worker import run_graph_isolated, run_in_worker

log = logging.getLogger(__name__)



@dataclass
class QnnChain:
    """The contexts so far: the chain's names, the compiled pieces, their rewritten graphs' structure, the
    emulated chain's values (None where it does not run), the pass counts and the fp16 headroom."""

    out_dir: Path
    options: CompileOptions
    module_outputs: tuple[str, ...]
    names: dict[str, str]  # a link name -> the chain's value that feeds it
    values: dict[str, np.ndarray] | None
    parts: list[Any] = field(default_factory=list)
    graphs: list[onnx.ModelProto] = field(default_factory=list)  # each piece's rewritten graph, no weights
    rows: list[dict[str, Any]] = field(default_factory=list)  # each context's nodes and weight (for the report)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    room: list[dict[str, Any]] = field(default_factory=list)
    emulator_seconds: float = 0.0
    skipped: str = ""

    def __getstate__(self) -> dict[str, Any]:  # the options are the job's: a run that goes on has its own
        return {k: v for k, v in self.__dict__.items() if k != "options"}

    def __setstate__(self, state: dict[str, Any]) -> None:  # a state written before the graphs went weightless
        self.__dict__.update(state)
        self.graphs = [_weightless(g) for g in self.graphs]


def start(out_dir: Path, options: CompileOptions, feeds: dict[str, np.ndarray], outputs: tuple[str, ...],
          emulate: bool) -> QnnChain:
    out_dir.mkdir(parents=True, exist_ok=True)
    return QnnChain(out_dir, options, outputs, {k: k for k in feeds}, dict(feeds) if emulate else None)


def move(chain: QnnChain, to: Path) -> None:
    """The chain's folder (its contexts, their binaries and traces) renamed to ``to``, its paths with it."""
    os.replace(chain.out_dir, to)
    for part in chain.parts:
        part.context = to / part.context.name
        part.binaries = [to / b.name for b in part.binaries]
    chain.out_dir = to


def compile_piece(chain: QnnChain, i: int, n: int, path: Path, inputs: tuple[str, ...], outputs: tuple[str, ...],
                  feeds: dict[str, np.ndarray] | None, component: str) -> None:
    """Piece ``i`` of ``n`` (its fp32 graph at ``path``; ``feeds``: PyTorch's inputs of the piece, None where the
    job does not check) rewritten, compiled into its context and, where the chain runs, run on the emulator."""
    options, backend = chain.options, backend_of(chain.options.target)
    name = f"{component} piece {i + 1} of {n}"
    if feeds is not None:
        with step(log, f"[{name}] fp16 headroom: every tensor's largest magnitude in the fp32 run"):
            near = headroom.near_limit(run_graph_isolated(headroom.magnitudes, path, feeds,
                                                          what=f"measuring {name} in fp32"))
        options = dataclasses.replace(options, fp16_risks=tuple((e["tensor"], e["max_abs"]) for e in near))
    else:
        near = []
    model = load(path)
    records = compile_model(model, options)
    guards = guards_of(dict(model.metadata_props))
    for e in near:
        e["tensor"], e["guard"] = f"b{i}/{e['tensor']}", guards.get(e["tensor"], "")
    chain.room += near
    for rec in records_json(records):
        bucket = chain.records.setdefault(rec["name"], {})
        for k, v in rec.get("counts", {}).items():
            if isinstance(v, (int, float)):
                bucket[k] = bucket.get(k, 0) + v
    qnn_path = path.parent / "qnn" / "model.onnx"
    qnn_path.parent.mkdir(exist_ok=True)
    save(model, qnn_path)
    del model
    release_memory()
    _rename(qnn_path, i, i == n - 1, inputs, outputs, chain)
    arch = backend.parse_arch(options.htp_arch, options.htp_optimization)
    parts, cut, structure = compile_pieces(qnn_path, chain.out_dir, name, backend, arch, None, stem=f"ctx{i + 1}",
                                           piece_stem=f"ctx{i + 1}_")
    chain.parts += parts
    chain.rows += ([{"nodes": len(structure.graph.node), "weight_bytes": _fp16_bytes(structure)}] if cut is None
                   else [p.to_json() for p in cut])
    chain.graphs.append(_weightless(structure))  # a piece's weights, held to the end, added up (Flux.1: 1.4 GB each)
    if chain.values is not None and i == 0:  # the first piece's MACs, n times: the chain's time on the emulator
        slow = too_slow(backend, macs_of(structure, options.target) * n)
        if slow:
            log.warning("[%s] the compiled pieces do not run: %s", component, slow)
            chain.skipped, chain.values = slow, None
    for part in parts if chain.values is not None else []:
        wanted = {v.name for v in onnx.load(str(part.context), load_external_data=False).graph.input}
        t0 = time.perf_counter()
        got = run_in_worker(run_compiled, part.context, arch, not part.whole,
                            {k: v for k, v in chain.values.items() if k in wanted},
                            what=f"running QNN's compile of {name}")
        chain.emulator_seconds += time.perf_counter() - t0
        chain.values.update(got)
    if chain.values is not None:  # what later pieces read and the module's outputs; the rest is done with
        keep = {*chain.names.values(), *chain.module_outputs}
        chain.values = {k: v for k, v in chain.values.items() if k in keep}
    for f in [qnn_path, *qnn_path.parent.glob(qnn_path.name + ".data")]:
        f.unlink(missing_ok=True)


def _rename(path: Path, i: int, last: bool, inputs: tuple[str, ...], outputs: tuple[str, ...], chain: QnnChain
            ) -> None:
    """The piece's inputs and outputs under the chain's names (in place; the weights are not read)."""
    m = onnx.load(str(path), load_external_data=False)
    new: dict[str, str] = {}
    for x in inputs:
        if x not in chain.names:
            raise SdnpuError(f"piece {i} takes {x}, which no earlier piece gives")
        new[x] = chain.names[x]
    for o in outputs:
        new[o] = o if last and o in chain.module_outputs else f"b{i}/{o}"
    for v in [*m.graph.input, *m.graph.output, *m.graph.value_info]:
        v.name = new.get(v.name, v.name)
    for node in m.graph.node:
        node.input[:] = [new.get(x, x) for x in node.input]
        node.output[:] = [new.get(x, x) for x in node.output]
    onnx.save(m, str(path))  # the weights stay where they are: external data keeps its location
    for o in outputs:
        chain.names[link_name(o)] = new[o]
    if len(outputs) == 1:
        chain.names[CHAIN_INPUT] = new[outputs[0]]


def finish(chain: QnnChain, component: str, source: Path, info: dict[str, Any],
           reference: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """The contexts chained in ``qnn/ctx.onnx``, the report written (the pieces' graphs counted as one; the
    emulated chain against ``reference``, PyTorch's chain, where it ran). Returns the report."""
    backend = backend_of(chain.options.target)
    joined = _joined(chain, onnx.load(str(source), load_external_data=False).graph)
    compiled = backend.chain(chain.parts, joined.graph, chain.out_dir)
    for row, own in zip(compiled.pieces, chain.rows, strict=True):
        row.update(own)
    arch = backend.parse_arch(chain.options.htp_arch, chain.options.htp_optimization)
    qnn = {**compiled.to_json(), "arch": f"v{arch.arch}", "soc_model": arch.soc_model, "chips": arch.chips,
           "optimization": arch.optimization,
           "context_gb": None, "versions": backend.versions(), "emulated": backend.is_emulated()}
    fid = None
    if chain.values is not None and reference is not None:
        fid = fidelity({k: reference[k] for k in chain.module_outputs},
                       {k: chain.values[k] for k in chain.module_outputs})
        fid["inputs"] = (f"the module's seeded inputs, {len(chain.parts)} pieces: QNN's contexts chained"
                         f"{' on the HTP emulator' if qnn['emulated'] else ''} ({chain.emulator_seconds:.1f} s"
                         f"{', emulation time, not the NPU' + chr(39) + 's' if qnn['emulated'] else ''}), against "
                         "PyTorch's fp32 pieces chained")
        log.info("[%s] QNN (fp16) vs PyTorch fp32 (chained): min cosine %.6f, max abs error %.3g", component,
                 fid["min_cosine"], fid["max_abs"])
    structure = chain.out_dir / ".pieces.onnx"  # the joined graph without weights, read by the report only
    onnx.save(joined, str(structure))
    try:
        passes = [{"name": k, "seconds": 0.0, "counts": v} for k, v in chain.records.items()
                  if k != "partition"]  # the pieces' regions, each counted from 0: the report counts the whole's
        extra = {**info, "target": chain.options.target.name, "precision": chain.options.precision, "qnn": qnn,
                 "fp16_headroom": chain.room, "blockwise": {"pieces": len(chain.parts)}}
        if chain.skipped:
            extra["fidelity_skipped"] = chain.skipped
        report = reports.build(structure, source, passes, extra, fid, chain.options.target)
    finally:
        structure.unlink(missing_ok=True)
    report["summary"].update(vendor_nodes=qnn["trace"].get("total_onnx_nodes", 0),
                             vendor_taken=qnn["trace"].get("supported_nodes", 0), vendor_whole=compiled.whole)
    reports.write(chain.out_dir, report)
    return report


_KEPT_BYTES = 1024  # constants up to this size keep their values (shapes, axes: the report's analysis reads them)


def _weightless(m: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``m`` without the data of its larger initializers (their names, types and shapes kept): the chain
    keeps each piece's graph for the report only, which reads its weights' sizes, not their values. A copy, not
    the fields cleared in place: protobuf keeps a message's memory until the whole message goes."""
    lean = onnx.ModelProto()
    lean.ir_version, lean.producer_name, lean.producer_version = m.ir_version, m.producer_name, m.producer_version
    lean.opset_import.extend(m.opset_import)
    lean.metadata_props.extend(m.metadata_props)
    g = lean.graph
    g.name = m.graph.name
    for field_name in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(g, field_name).extend(getattr(m.graph, field_name))
    for t in m.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or t.ByteSize() <= _KEPT_BYTES:
            g.initializer.append(t)
            continue
        kept = g.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims,
                                 data_location=onnx.TensorProto.EXTERNAL)
        kept.external_data.add(key="location", value="(not kept: the piece's weights are in its context)")
    return lean


def _fp16_bytes(m: onnx.ModelProto) -> int:
    return sum(weight_bytes(t, 2) for t in m.graph.initializer)


def _joined(chain: QnnChain, fp32: onnx.GraphProto) -> onnx.ModelProto:
    """The rewritten pieces as one graph, without weights: their nodes in order (each piece's own values
    prefixed with its block, as the stitch does), the inputs and outputs of ``fp32`` (the module's fp32 graph)."""
    nodes, inits, infos = [], [], []
    ends = {o.name for o in fp32.output}
    for i, g in enumerate(chain.graphs):
        ios = {v.name for v in [*g.graph.input, *g.graph.output]}
        own = {x for n in g.graph.node for x in n.output if x not in ios} | {t.name for t in g.graph.initializer}

        def r(x: str, own: set[str] = own, i: int = i) -> str:
            return f"b{i}/{x}" if x in own else x

        for n in g.graph.node:
            c = onnx.NodeProto()
            c.CopyFrom(n)
            c.name = f"b{i}/{n.name}"
            c.input[:] = [r(x) if x else x for x in n.input]
            c.output[:] = [r(x) for x in n.output]
            nodes.append(c)
        for t in g.graph.initializer:
            c = onnx.TensorProto()
            c.CopyFrom(t)
            c.name = r(t.name)
            inits.append(c)
        for v in [*g.graph.value_info, *(o for o in g.graph.output if o.name not in ends)]:
            c = onnx.ValueInfoProto()
            c.CopyFrom(v)
            c.name = r(v.name)
            infos.append(c)
    graph = onnx.helper.make_graph(nodes, "blocks", list(fp32.input), list(fp32.output), initializer=inits,
                                   value_info=infos)
    opsets = {}
    for g in chain.graphs:
        for o in g.opset_import:
            opsets[o.domain] = max(opsets.get(o.domain, 0), o.version)
    out = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()])
    out.ir_version = chain.graphs[0].ir_version
    for p in chain.graphs[0].metadata_props:
        out.metadata_props.add(key=p.key, value=p.value)
    return out
