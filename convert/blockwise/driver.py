"""The block-by-block driver: a module whose fp32 weights do not fit this machine's memory whole (T5-XXL: 19 GB;
Flux.1's transformer: 47.6 GB) converted one piece at a time (``sdnpu.convert.blockwise.piece.Piece``: a torch
module, the names of its inputs, the module's own for the first, earlier pieces' outputs for the others, and of
its outputs), the pieces from the module of its class (``PIECES``: ``t5``, and each family's row in
``sdnpu.families``: ``flux``, ``qwenimage``).

Each piece is built with its weights alone, run in PyTorch, exported, checked against PyTorch, compiled, and its
dispatch model run (a standard target's pieces: ``sdnpu.convert.blockwise.qnn``); then the pieces' files are
stitched into the component's graphs (``sdnpu.convert.stitch``), each deleted as it is copied, and what runs on
the stitched dispatch model runs (``sdnpu.passes.pipeline.stitched_pipeline``). Memory holds one block (T5-XXL:
5.7 GB peak), the disk the pieces' graphs until they become the stitched ones (T5-XXL: 19.05 GB fp32 and 9.79 GB
bf16). A run that stops keeps the finished pieces, and the next goes on after them (``state``).

With ``--dispatch-only`` (``ConvertOptions.dispatch_only``) the disk holds half that: each piece's fp32 graph is
deleted once its dispatch model is compiled and checked (its export check, its parameter record and its node
count taken first), and no fp32 graph is stitched; the folder has ``dd/`` alone beside its records, which say so
(``sdnpu.formats.reference``). Everything the checks measure is measured as without it: the fp32 chain is
PyTorch's, and the stitched dispatch model's records name the pieces' constants as the stitched fp32 graph
would (``b<i>/<name>``).

The checks: each piece runs in PyTorch on what PyTorch's earlier pieces gave, so its last piece's outputs are the
whole module's, without holding it whole. Each piece's fp32 graph runs on the same inputs as its PyTorch run:
its own export error, held to the check's tolerance piece by piece (the export check). The dispatch models
chain (piece ``i`` on what the earlier dispatch models gave) and their last outputs are measured against
PyTorch's chain: the stitched dispatch model computes what the chained pieces compute (the casts it cancels
between them are exact), and PyTorch's fp32 chain is the fp32 graph's within the export check. So a piece
costs one PyTorch run and two onnxruntime runs (a Flux.1 block at 1024 px: about 2 GB of attention scores
each), not three (an fp32 chain of its own as well).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

from sdnpu import families
from sdnpu.convert.blockwise import qnn
from sdnpu.convert.blockwise.piece import CHAIN_INPUT, Piece, Weights, link_values
from sdnpu.convert.blockwise.state import STATE, Chain, Run, checkpoint, continued, fresh, work_dir
from sdnpu.convert.compile import REPLACED, compile_into, log_offload, validate_dispatch_model, write_report
from sdnpu.convert.export import CHECK_RTOL, export_module
from sdnpu.convert.job import MODEL_FILE, Job, compile_info, write_records
from sdnpu.convert.options import ComponentResult
from sdnpu.convert.parameters import map_parameters
from sdnpu.convert.sources import Source
from sdnpu.convert.stitch import StitchStats, stitch
from sdnpu.errors import SdnpuError
from sdnpu.formats import reference
from sdnpu.formats.prologue import FILE as PROLOGUE_FILE
from sdnpu.formats.weights import FILE as WEIGHTS_FILE
from sdnpu.formats.weights import make_record, read_record, write_record
from sdnpu.onnxrun import run_onnx
from sdnpu.passes.manager import records_json, run_passes
from sdnpu.passes.modelfile import save
from sdnpu.passes.pipeline import CompileOptions, stitched_pipeline
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports.fidelity import fidelity
from sdnpu.signatures import Signature
from sdnpu.worker import run_graph_isolated

log = logging.getLogger(__name__)

# the module of each class's pieces (``pieces``, ``whole_module``), named as strings and imported when a
# conversion asks for them (they import torch and transformers): T5's, and each family's that has one
PIECES = {"T5EncoderModel": "sdnpu.convert.blockwise.t5",
          **{f.denoiser_class: f.blockwise for f in families.TABLE if f.blockwise}}
CLASSES = tuple(PIECES)  # module classes that convert block by block


def supports(src: Source, key: str) -> bool:
    return src.classes.get(key) in CLASSES


def _pieces_module(src: Source, key: str) -> Any:
    cls = src.classes.get(key)
    if cls not in PIECES:
        raise SdnpuError(f"{key} ({cls}) does not convert block by block",
                         hint=f"block by block takes: {', '.join(CLASSES)}")
    return families.load(PIECES[cls])


def pieces(src: Source, key: str, sig: Signature, start: int = 0, latent: tuple[int, int] | None = None
           ) -> Iterator[Piece]:
    """The module's pieces in order for its graph's signature ``sig``, each built when asked for (the caller
    drops it); from piece ``start`` on (those before it are not built: a run that goes on after another);
    ``latent``: the image's latent size (H/f, W/f), for a module whose graph depends on it beyond its inputs'
    shapes (Qwen-Image's rotary tables)."""
    yield from _pieces_module(src, key).pieces(src, key, sig, Weights(src, key), start=start, latent=latent)


def whole_module(src: Source, key: str) -> Any:
    """The module whose weights the pieces hold (small modules only: tests compare against it)."""
    return _pieces_module(src, key).whole_module(src, key, Weights(src, key))


def convert_blockwise(src: Source, job: Job, stage: Path) -> ComponentResult:
    """Convert ``job`` (T5, Flux.1's and Qwen-Image's transformers) into ``stage`` block by block: ``model.onnx``
    (+ data) stitched from the pieces' fp32 graphs (none with ``--dispatch-only``), ``dd/`` from their dispatch
    models (a standard target's ``qnn/``: a
    context a piece, ``sdnpu.convert.blockwise.qnn``). Where a run of the same job stopped before, this one goes
    on after the pieces it finished (``STATE``). Returns the ComponentResult."""
    work = work_dir(stage, job.component)
    run = continued(job, work)
    if run is None:
        run = fresh(job, work)
    else:
        log.info("[%s] going on after the %d pieces an earlier run finished (kept in %s)", job.component,
                 len(run.fp32_parts), work)
    checkpoint(run)
    started = time.perf_counter()
    try:
        factor = job.spec.vae_factor
        latent = (job.res.height // factor, job.res.width // factor)
        for piece in pieces(src, job.key, job.signature(), start=len(run.fp32_parts), latent=latent):
            i, n = piece.i, piece.n
            shutil.rmtree(work / f"piece{i:03d}", ignore_errors=True)  # what a run that stopped in it left
            _piece(run, piece)
            del piece
            checkpoint(run)
            log.info("[%s] piece %d of %d done (%.0f s so far, peak memory %.1f GB)", job.component, i + 1, n,
                     time.perf_counter() - started, peak_rss_bytes() / 1e9)
    except BaseException:
        if run.fp32_parts:
            checkpoint(run, running=False)
            log.warning("[%s] stopped: the %d pieces finished are kept in %s; the same command goes on after them",
                        job.component, len(run.fp32_parts), work)
        else:
            shutil.rmtree(work, ignore_errors=True)
        raise
    (work / STATE).unlink()  # stitching consumes the pieces: from here on a stopped run starts again
    try:
        check_data = _export_check(run)  # before stitching: a graph that does not match is not worth writing
        s32, summary = _stitch(run, stage)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = {k: round(v, 2) for k, v in run.seconds.items()}
    result = ComponentResult(component=job.component, path=stage / MODEL_FILE, nodes=s32.nodes,
                             parameters=run.n_params, seconds=seconds, peak_rss_bytes=peak_rss_bytes(),
                             check=check_data, report=summary)
    write_records(job, stage, result, _parameters(run.params, run.wholes, s32.alias), blockwise=True,
                  dispatch_only=job.options.dispatch_only)
    return result


def _piece(run: Run, piece: Piece) -> None:
    """``piece``: run in PyTorch on the torch chain, exported, run in onnxruntime on the fp32 chain (and alone
    on PyTorch's inputs, its own error), compiled and its dispatch model run on the dispatch chain."""
    import torch  # at the first piece, not where the CLI imports the convert stage

    job, options, i = run.job, run.job.options, piece.i
    module = piece.module
    piece.module = None  # the caller's Piece must not keep the weights alive past this piece
    run.n_params += sum(p.numel() for p in module.parameters())
    folder = run.work / f"piece{i:03d}"
    folder.mkdir()
    path = folder / MODEL_FILE
    before = run.feeds if run.chain is None else run.chain.torch
    missing = [name for name in piece.inputs if name not in before]
    if missing:
        raise SdnpuError(f"{job.component}'s piece {i} takes {', '.join(missing)}, which no earlier piece gives")
    t0 = time.perf_counter()
    with torch.no_grad():
        t_in = tuple(torch.from_numpy(before[name]) for name in piece.inputs)
        got = module(*t_in)
        t_out = [o.numpy().copy() for o in (got if isinstance(got, tuple) else (got,))]
    run.timed("torch_run", t0)
    t0 = time.perf_counter()
    try:
        export_module(module, t_in, list(piece.inputs), list(piece.outputs), path, exporter=options.export_with)
        run.params.append(map_parameters(module, path))
        run.wholes.append(piece.whole)
    except SdnpuError:
        raise
    except Exception as e:
        raise SdnpuError(f"torch's {options.exporter} exporter failed on {job.component}'s piece {i}: "
                         f"{type(e).__name__}: {e}") from e
    run.timed("export", t0)
    del module, t_in, got
    release_memory()
    names = (piece.inputs, piece.outputs)
    _check_piece(run, i, path, {k: before[k] for k in piece.inputs}, dict(zip(piece.outputs, t_out, strict=True)))
    dispatch = _compile_piece(run, i, path, names) if options.compile and run.qnn is None else None
    if run.qnn is not None:
        qnn.compile_piece(run.qnn, i, piece.n, path, piece.inputs, piece.outputs,
                                    {k: before[k] for k in piece.inputs} if options.check else None, job.component)
    previous = run.chain
    run.chain = Chain(link_values(before, piece.outputs, t_out),
                      None if dispatch is None else link_values(
                          run.feeds if previous is None or previous.dispatch is None else previous.dispatch,
                          piece.outputs, dispatch))
    if options.dispatch_only:
        run.fp32_nodes += _drop_fp32(path)
    run.fp32_parts.append(path)


def _drop_fp32(path: Path) -> int:
    """``--dispatch-only``: the piece's fp32 graph at ``path`` deleted, with its weight files (its dispatch model
    is compiled and checked, and holds weights of its own: ``sdnpu.passes.modelfile.save``); its node count."""
    nodes = len(onnx.load(str(path), load_external_data=False).graph.node)
    for f in path.parent.iterdir():
        if f.is_file():
            f.unlink()
    return nodes


def _run_graph(path: Path, feeds: dict[str, np.ndarray], optimize: bool = False) -> dict[str, np.ndarray]:
    """``run_onnx``, in a worker process where the run is large (``sdnpu.worker.run_graph_isolated``): one piece
    after another, the heaps finished sessions leave would add up."""
    return run_graph_isolated(run_onnx, path, feeds, optimize, what=f"running {path.parent.name}")


def _check_piece(run: Run, i: int, path: Path, feeds: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """The piece's fp32 graph on PyTorch's inputs of the piece (``feeds``) against PyTorch's outputs (``want``):
    its own export error, within the check's tolerance or an SdnpuError naming the piece."""
    if not run.job.options.check:
        return
    t0 = time.perf_counter()
    res = _run_graph(path, feeds, optimize=True)
    run.timed("onnx_run", t0)
    fid = fidelity(want, {k: res[k] for k in want})
    rel = max(e["max_rel"] for e in fid["outputs"].values())
    worst = run.worst
    worst["max_abs"] = max(worst["max_abs"], fid["max_abs"])
    worst["max_rel"] = max(worst["max_rel"], rel)
    worst["min_cosine"] = min(worst["min_cosine"], fid["min_cosine"])
    run.last_check = fid["outputs"]
    name = max(fid["outputs"], key=lambda k: fid["outputs"][k]["max_rel"])
    log.info("[%s] piece %d: ONNX vs PyTorch max rel error %.3g (%s)", run.job.component, i, rel, name)
    if not rel <= CHECK_RTOL:
        raise SdnpuError(f"the exported {run.job.component} does not match PyTorch in its piece {i}: off by "
                         f"{rel:.3g} of its range (tolerance {CHECK_RTOL:g})", hint="try the other exporter (--exporter)")


def _compile_piece(run: Run, i: int, path: Path, names: tuple[tuple[str, ...], tuple[str, ...]]
                   ) -> list[np.ndarray] | None:
    """The piece compiled (its pass counts summed into ``run.records``) and, where the job checks, its dispatch
    model run on the dispatch chain."""
    piece_in, piece_out = names
    options = run.job.options
    t0 = time.perf_counter()
    report = compile_into(path, path.parent / "dd", {"component": f"{run.job.component} block {i}"},
                          options.compile_options, check=None)
    run.timed("compile", t0)
    for rec in report["passes"]:
        bucket = run.records.setdefault(rec["name"], {})
        for k, v in rec.get("counts", {}).items():
            if isinstance(v, (int, float)):
                bucket[k] = bucket.get(k, 0) + v
    dispatch = None
    if options.check:
        values = run.feeds if run.chain is None or run.chain.dispatch is None else run.chain.dispatch
        t0 = time.perf_counter()
        res = _run_graph(path.parent / "dd" / REPLACED, {k: values[k] for k in piece_in})
        dispatch = [res[k] for k in piece_out]
        run.timed("onnx_run", t0)
    run.dd_parts.append(path.parent / "dd" / REPLACED)
    return dispatch


def _export_check(run: Run) -> dict[str, Any] | None:
    """The export check of the whole module: every piece's fp32 graph against PyTorch on PyTorch's inputs
    (``_check_piece``), the worst of them."""
    if not run.job.options.check:
        return None
    worst = run.worst
    log.info("[%s] ONNX vs PyTorch, piece by piece over %d pieces: max abs error %.3g, max rel error %.3g, "
             "min cosine %.9f", run.job.component, len(run.fp32_parts), worst["max_abs"], worst["max_rel"],
             worst["min_cosine"])
    return {"max_abs_error": worst["max_abs"], "max_rel_error": worst["max_rel"], "min_cosine": worst["min_cosine"],
            "rel_tolerance": CHECK_RTOL, "outputs": run.last_check, "blockwise": True,
            "measured": "each piece's fp32 graph against PyTorch on PyTorch's inputs of the piece; the worst piece"}


def _stitch(run: Run, stage: Path) -> tuple[StitchStats, dict[str, Any] | None]:
    """The pieces stitched into ``stage/model.onnx`` and ``stage/dd/replaced.onnx`` (each piece deleted as it
    is copied), both checked, and the dispatch model's report. Returns the fp32 stitch and the summary."""
    comp, options = run.job.component, run.job.options
    t0 = time.perf_counter()
    if options.dispatch_only:
        s32 = StitchStats(pieces=len(run.fp32_parts), nodes=run.fp32_nodes)
        log.info("[%s] --dispatch-only: no fp32 graph stitched (the %d pieces' were deleted as they compiled)",
                 comp, len(run.fp32_parts))
    else:
        with step(log, f"[{comp}] stitching {len(run.fp32_parts)} pieces into {MODEL_FILE}"):
            s32 = stitch(run.fp32_parts, stage / MODEL_FILE, CHAIN_INPUT, consume=True)
    sdd = None
    if options.compile and run.qnn is None:
        (stage / "dd").mkdir(exist_ok=True)
        target = options.compile_options.target
        with step(log, f"[{comp}] stitching {len(run.dd_parts)} dispatch models into dd/{REPLACED}"):
            sdd = stitch(run.dd_parts, stage / "dd" / REPLACED, CHAIN_INPUT,
                         cast=(target.domain, "CastAvx"), consume=True)
        log.info("[%s] %d boundary casts between the blocks cancelled; %d repeated constants and %d repeated "
                 "nodes kept once", comp, sdd.casts_cancelled, sdd.deduplicated, sdd.repeated_nodes)
        stitched = dataclasses.replace(options.compile_options, prologue=run.job.spec.prologue)
        run.stitched, kept = _stitched_passes(stage / "dd" / REPLACED, stitched, comp)
        _stitch_provenance(run.dd_parts, stage / "dd", s32.alias, sdd.alias, kept)
    run.seconds["stitch"] = time.perf_counter() - t0
    if run.qnn is not None:  # the contexts go where the component's folder has them
        qnn.move(run.qnn, stage / options.compile_options.target.out_dir)
    shutil.rmtree(run.work, ignore_errors=True)
    if not options.dispatch_only:
        with step(log, f"[{comp}] validating the stitched graph (onnx.checker, full check)") as t:
            onnx.checker.check_model(str(stage / MODEL_FILE), full_check=True)
        run.seconds["onnx_check"] = t.seconds
    if run.qnn is not None:
        info = {**compile_info(run.job, None), "peak_rss_bytes": peak_rss_bytes()}
        reference = run.chain.torch if run.chain is not None and options.check else None
        report = qnn.finish(run.qnn, comp, stage / MODEL_FILE, info, reference)
        log_offload(comp, report)
        return s32, report["summary"]
    return s32, (_report(run, stage, sdd) if sdd is not None else None)


def _report(run: Run, stage: Path, sdd: StitchStats) -> dict[str, Any]:
    """The stitched dispatch model validated, its chained pieces' outputs measured against PyTorch's chain (the
    fp32 reference: each piece's fp32 graph within the export check of it), and reported."""
    comp, options, chain = run.job.component, run.job.options, run.chain
    assert chain is not None
    validate_dispatch_model(stage / "dd" / REPLACED, comp, "stitched from its blocks", "`--no-compile` keeps the graph")
    fid_dd = None
    if options.check:
        assert chain.dispatch is not None
        fid_dd = fidelity({k: chain.torch[k] for k in run.out_names}, {k: chain.dispatch[k] for k in run.out_names})
        fid_dd["inputs"] = (f"the module's seeded inputs, {len(run.dd_parts)} pieces: the dispatch models chained, "
                            "against PyTorch's fp32 pieces chained (each piece's fp32 graph within "
                            f"{CHECK_RTOL:g} of PyTorch on the same inputs)")
        log.info("[%s] dispatch vs fp32 (chained): min cosine %.6f, max abs error %.3g", comp,
                 fid_dd["min_cosine"], fid_dd["max_abs"])
    passes = [{"name": k, "seconds": 0.0, "counts": v} for k, v in run.records.items() if k != "partition"]
    passes += run.stitched  # the stitched model's partition in place of the pieces' summed
    passes.append({"name": "stitch", "seconds": round(run.seconds["stitch"], 3),
                   "counts": {"pieces": sdd.pieces, "boundary casts cancelled": sdd.casts_cancelled,
                              "repeated constants kept once": sdd.deduplicated,
                              "repeated nodes kept once": sdd.repeated_nodes}})
    info = {**compile_info(run.job, None), "target": options.compile_options.target.name,
            "precision": options.precision, "peak_rss_bytes": peak_rss_bytes(),
            "blockwise": {"pieces": len(run.dd_parts),
                          **({reference.KEY: True} if options.dispatch_only else {})}}
    source = None if options.dispatch_only else stage / MODEL_FILE
    report = write_report(stage / "dd", stage / "dd" / REPLACED, source, passes, info, fid_dd)
    log_offload(comp, report)
    return report["summary"]  # type: ignore[no-any-return]


def _parameters(per_piece: list[dict[str, Any]], wholes: list[Any], alias: dict[str, str]) -> dict[str, Any]:
    """parameters.json for the stitched graph: each piece's record under its prefix, named as the whole module
    names its parameters (each piece's ``whole``; None: the piece names them so)."""
    found: dict[str, Any] = {}
    ambiguous = 0
    n = len(per_piece)
    for i, (record, naming) in enumerate(zip(per_piece, wholes, strict=True)):
        def whole(param: str, i: int = i, naming: Any = naming) -> str:
            return param if naming is None else naming(i, param)

        for name, entry in record["initializers"].items():
            stitched = f"b{i}/{name}"
            if stitched in alias:
                continue  # kept once, under the first piece's name
            if entry.get("param") is not None:
                found[stitched] = {**entry, "param": whole(entry["param"])}
            else:
                found[stitched] = {**entry, "candidates": [whole(c) for c in entry.get("candidates", [])]}
                ambiguous += 1
    return {**(per_piece[0] if per_piece else {}), "module": "", "ambiguous": ambiguous, "initializers": found,
            "blockwise": n}


def _stitch_provenance(parts: list[Path], dd_dir: Path, alias32: dict[str, str], alias_dd: dict[str, str],
                       kept: set[str]) -> None:
    """dd/weights.json for the stitched dispatch model: each piece's record under its prefix, its ``init``
    references renamed to the stitched fp32 graph's constants (a repeat to the one kept); only the constants
    the model holds (``kept``: those its prologue took are the prologue's)."""

    def rename(expr: Any, i: int) -> Any:
        if isinstance(expr, dict):
            if "init" in expr:
                name = f"b{i}/{expr['init']}"
                return {**expr, "init": alias32.get(name, name)}
            return {k: rename(v, i) for k, v in expr.items()}
        if isinstance(expr, list):
            return [rename(v, i) for v in expr]
        return expr

    stitched_weights: dict[str, Any] = {}
    for i, part in enumerate(parts):
        record = read_record(part.parent / WEIGHTS_FILE)
        for name, expr in record["weights"].items():
            stitched = f"b{i}/{name}"
            if stitched not in alias_dd and stitched in kept:
                stitched_weights[stitched] = rename(expr, i)
    write_record(dd_dir / WEIGHTS_FILE, make_record("model.onnx", stitched_weights))


def _stitched_passes(path: Path, options: CompileOptions, name: str) -> tuple[list[dict[str, Any]], set[str]]:
    """``stitched_pipeline`` on the stitched dispatch model at ``path``, read without its weights (but the small
    constants a prologue may take) and written back so; the prologue, where one is cut, written beside it.
    Returns the passes' records and the names of the constants the model keeps."""
    proto = onnx.load(str(path), load_external_data=False)
    if options.prologue:
        for t in proto.graph.initializer:  # a table's frequencies, column indices: kept in the graph proper
            size = next((int(e.value) for e in t.external_data if e.key == "length"), None)
            if uses_external_data(t) and size is not None and size <= _SMALL_CONSTANT:
                load_external_data_for_tensor(t, str(path.parent))
                t.data_location = onnx.TensorProto.DEFAULT
                del t.external_data[:]
    model = ir.serde.deserialize_model(proto)
    records = run_passes(model, stitched_pipeline(options))
    pro = next((r.result.prologue for r in records if r.result.prologue is not None), None)
    if pro is not None:
        save(pro, path.parent / PROLOGUE_FILE)
        validate_dispatch_model(path.parent / PROLOGUE_FILE, name, f"cut from the stitched {path.name}",
                                "`--no-compile` keeps the graph")
    out = ir.serde.serialize_model(model)
    onnx.save(out, str(path))
    return records_json(records), {t.name for t in out.graph.initializer}


_SMALL_CONSTANT = 1 << 16  # bytes: constants read into memory for the prologue pass (it copies what it moves)
