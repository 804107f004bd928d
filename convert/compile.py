"""Compile stage: an ONNX graph -> ``dd/replaced.onnx`` + ``dd/onnx_report.txt`` + ``dd/report.json``.

Used by ``sdnpu convert`` (after export, inside the component's staging folder) and by ``sdnpu compile``
(any ONNX file, e.g. what ``optimum-cli export onnx`` writes). Needs no torch. ``write_report`` is the one
report writer of every compile: whole (``compile_into``), stitched block by block (``sdnpu.convert.blockwise``)
and re-derived for another size (``sdnpu.convert.specialized``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from sdnpu.convert.kept import folder_for as units_folder
from sdnpu.convert.standard import compile_standard
from sdnpu.convert.interface import (
    OUTPUT_CHOICES,
    keep_outputs,
    output_names,
    pipeline_kind,
    read_config,
    static_shapes,
)
from sdnpu.errors import SdnpuError
from sdnpu.fileio import staged_dir
from sdnpu.formats import prologue, weights
from sdnpu.formats.sizes import sizes_of
from sdnpu.imagesize import Size
from sdnpu.memory import check_fits, estimate
from sdnpu.onnxrun import is_ort_error, ort_message, run_onnx
from sdnpu.ops.target import get_target
from sdnpu.passes import provenance
from sdnpu.passes.canonical.constants import bind_input_shapes
from sdnpu.passes.canonical.driver import apply as apply_rewrite
from sdnpu.passes.canonical.noops import rewrite_bool_where
from sdnpu.passes.manager import records_json
from sdnpu.passes.modelfile import load, save
from sdnpu.passes.pipeline import CompileOptions, compile_model, pass_names
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports import bf16
from sdnpu.reports import report as reports
from sdnpu.reports.fidelity import CannotFeed, fidelity, generic_inputs
from sdnpu.specs import handoff_values, pipeline_outputs, prologue_inputs

__all__ = ["OUTPUT_CHOICES", "REPLACED", "FidelityCheck", "compile_file", "compile_into", "fidelity",
           "fidelity_run", "generic_inputs", "keep_outputs", "pipeline_outputs", "run_onnx", "static_shapes",
           "validate_dispatch_model", "write_report"]

log = logging.getLogger(__name__)

REPLACED = "replaced.onnx"
# The cosine a dispatch model keeps against its fp32 graph on the check's inputs: every zoo member keeps 0.9996 or
# better (tests/zoo_floors.json), the full-size presets' components 0.9997 (bench/results.md); a 4-level Kandinsky 3
# UNet read 0.9858 (PyTorch's own bf16 run of it: 0.9378), which the user is told
BF16_USUAL_COSINE = 0.999


@dataclass(frozen=True)
class FidelityCheck:
    """Run the dispatch model against the fp32 graph on ``feeds`` (None: generic seeded inputs);
    ``reference``: the fp32 graph's outputs when the caller has them already."""

    feeds: dict[str, np.ndarray] | None = None
    reference: dict[str, np.ndarray] | None = None


def compile_into(source: Path, dd_dir: Path, info: dict[str, Any], options: CompileOptions, *,
                 outputs: list[str] | None = None, check: FidelityCheck | None = FidelityCheck(),
                 keep: Path | None = None) -> dict[str, Any]:
    """Compile ``source`` into the folder ``dd_dir`` (which the caller stages). Returns the report.
    ``options.shapes`` fixes dynamic input axes (see ``static_shapes``); ``outputs``: the graph outputs the
    dispatch model keeps (None: all; see ``keep_outputs``); ``check`` None: no fidelity run; ``keep``: where a
    vendor's compile cut into pieces keeps its finished units until it is complete (``sdnpu.convert.kept``)."""
    if options.target.kind == "standard":  # the vendor compiles: sdnpu rewrites, then hands the graph over
        return compile_standard(source, dd_dir, info, options, outputs=outputs, check=check,
                                drop_outputs=_drop_outputs, keep=keep)
    name = info.get("component", source.parent.name)
    shapes = options.input_shapes
    with step(log, f"[{name}] compiling for {options.target.name} ({', '.join(pass_names(options, steps=False))})"):
        model = load(source)
        if shapes:
            bind_input_shapes(model, shapes)
        dropped = _drop_outputs(model, outputs, name) if outputs is not None else []
        records = compile_model(model, options)
    dd_dir.mkdir(parents=True, exist_ok=True)
    out = dd_dir / REPLACED
    with step(log, f"[{name}] writing {REPLACED} (bf16 weights)"):
        save(model, out)
    pro = next((r.result.prologue for r in records if r.result.prologue is not None), None)
    if pro is not None:
        save(pro, dd_dir / prologue.FILE)
        validate_dispatch_model(dd_dir / prologue.FILE, name, f"cut from {out.name}",
                                "`--no-compile` keeps the exported graph")
    weights.write_record(dd_dir / weights.FILE, provenance.record(model.graph, source.name))
    del model
    release_memory()
    validate_dispatch_model(out, name, f"compiled from {source}", "`--no-compile` keeps the exported graph", source)
    fid, skipped = fidelity_run(name, source, out, check, shapes or None) if check is not None else (None, None)
    extra: dict[str, Any] = {"target": options.target.name, "precision": options.precision,
                             "peak_rss_bytes": peak_rss_bytes()}
    if skipped:
        extra["fidelity_skipped"] = skipped
    if dropped:
        extra["dropped_outputs"] = dropped
    report = write_report(dd_dir, out, source, records_json(records), {**info, **extra}, fid)
    log_offload(name, report)
    return report


def write_report(dd_dir: Path, model: Path, source: Path | None, passes: list[dict[str, Any]], info: dict[str, Any],
                 fid: dict[str, Any] | None) -> dict[str, Any]:
    """Build the report of the dispatch model at ``model`` (compiled from ``source``; ``info`` names the target)
    and write it into ``dd_dir`` (``report.json`` and ``onnx_report.txt``). Returns it."""
    report = reports.build(model, source, passes, info, fid, get_target(info["target"]))
    reports.write(dd_dir, report)
    return report


def log_offload(name: str, report: dict[str, Any]) -> None:
    s = report["summary"]
    log.info("[%s] offload rate %.2f%% (%d dispatch ops, %d CPU nodes, %d NPU regions)", name,
             100 * s["offload_rate"], s["offloaded_nodes"], s["cpu_nodes"], s["npu_regions"])


def validate_dispatch_model(path: Path, name: str, made: str, meanwhile: str, source: Path | None = None) -> None:
    """onnx's full check of a dispatch model just written; a failure is one line: the compiler's bug, or
    where ``source`` (the graph it was compiled from) fails the same check, the source's."""
    errors = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)
    with step(log, f"[{name}] validating {path.name} (onnx.checker, full check)"):
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except errors as e:
            if source is not None:
                try:
                    onnx.checker.check_model(str(source), full_check=True)
                except errors as bad:
                    raise SdnpuError(f"{source} is not valid ONNX: {' '.join(str(bad).split())[:500]}",
                                     hint="the graph itself breaks ONNX's rules (often an exporter bug: try the "
                                     "other exporter, or another opset); sdnpu compiles valid graphs") from None
            raise SdnpuError(f"the dispatch model {made} is not valid ONNX: {str(e)[:600]}",
                             hint=f"this is a compiler bug worth reporting with the model; meanwhile {meanwhile}"
                             ) from e


def fidelity_run(name: str, source: Path, out: Path, check: FidelityCheck,
                 shapes: dict[str, list[int]] | None = None) -> tuple[dict[str, Any] | None, str | None]:
    """The dispatch model ``out`` against the fp32 graph ``source`` on ``check``'s inputs (seeded generic
    ones where it has none), each run checked to fit in memory first: (the fidelity, None), or (None, why
    the check could not run) where the graph has inputs no seeded value fits (a shape, axes). A graph that
    onnxruntime cannot load or run is one line naming the node and what onnxruntime said."""
    hint = "--no-verify skips the fidelity run, or convert at a smaller RES"
    reference = check.reference
    if reference is None:
        check_fits(source, f"[{name}] the fidelity run of the fp32 graph", hint)
    check_fits(out, f"[{name}] the fidelity run of {out.name}", hint)
    try:
        _check_runnable(source, out)
        feeds = check.feeds if check.feeds is not None else generic_inputs(source, shapes=shapes)
    except CannotFeed as e:
        log.warning("[%s] no fidelity check: %s (give the model's test inputs in test_data_set_0/, or "
                    "compile it with --no-verify)", name, e)
        return None, str(e)
    runnable = None
    try:
        if reference is None:
            reference, runnable = _reference_run(name, source, out, feeds)
        return _fidelity_of(name, runnable or source, out, feeds, reference), None
    finally:
        if runnable is not None:
            _remove_model(runnable)


def _reference_run(name: str, source: Path, out: Path, feeds: dict[str, np.ndarray]
                   ) -> tuple[dict[str, np.ndarray], Path | None]:
    """The fp32 graph's outputs on ``feeds``, and the copy of it that ran where onnxruntime refuses the graph for
    its boolean Wheres alone (it has no such kernel: dynamo's ``masked_fill`` of a bool mask, HunyuanVideo's):
    that copy has them as And / Or / Not (``canonical.noops.rewrite_bool_where``, the same values), written
    beside ``out`` for the check and deleted after it. Anything else onnxruntime refuses is one line."""
    with step(log, f"[{name}] running the fp32 graph for the fidelity check"):
        try:
            return run_onnx(source, feeds, optimize=True), None
        except Exception as e:  # onnxruntime's Fail, InvalidGraph, InvalidArgument, RuntimeException
            if not is_ort_error(e):
                raise
            error = SdnpuError(f"onnxruntime cannot run {source} for the fidelity check: {ort_message(e)}",
                               hint="the graph itself is what onnxruntime refuses (often an exporter bug: try "
                               "the other exporter); `--no-verify` compiles it without the check")
            if "Where" not in ort_message(e):
                raise error from None
    model = load(source)
    if not apply_rewrite(model.graph, rewrite_bool_where):
        raise error from None
    runnable = out.with_name(f"{source.stem}.fp32_bool_where.onnx")
    save(model, runnable)
    del model
    log.info("[%s] onnxruntime has no boolean Where: the fp32 graph runs with its Wheres of booleans as And, Or "
             "and Not (the same values)", name)
    try:
        with step(log, f"[{name}] running the fp32 graph, its boolean Wheres rewritten, for the fidelity check"):
            return run_onnx(runnable, feeds, optimize=True), runnable
    except Exception as e:
        _remove_model(runnable)
        if not is_ort_error(e):
            raise
        raise error from None


def _remove_model(path: Path) -> None:
    """A model file ``save`` wrote, and its external data file if it has one."""
    for file in (path, path.with_name(path.name + ".data")):
        file.unlink(missing_ok=True)


def _fidelity_of(name: str, source: Path, out: Path, feeds: dict[str, np.ndarray],
                 reference: dict[str, np.ndarray]) -> dict[str, Any]:
    with step(log, f"[{name}] running {out.name} (reference bodies) for the fidelity check"):
        try:
            actual = run_onnx(out, feeds)
        except Exception as e:
            if not is_ort_error(e):
                raise
            raise SdnpuError(f"onnxruntime cannot run the dispatch model compiled from {source}, though it runs "
                             f"the graph itself: {ort_message(e)}",
                             hint="this is a compiler bug worth reporting with the model; meanwhile "
                             "`--no-compile` keeps the exported graph") from None
    fid = fidelity(reference, actual)
    log.info("[%s] dispatch vs fp32: min cosine %.6f, max abs error %.3g", name, fid["min_cosine"], fid["max_abs"])
    if fid["min_cosine"] < BF16_USUAL_COSINE:
        fid["bf16_rounding"] = _bf16_rounding(name, source, feeds, reference, fid)
    bad = {k: o["reference_not_finite"] for k, o in fid["outputs"].items() if o.get("reference_not_finite")}
    if bad:
        log.warning("[%s] the fp32 graph's own outputs are not finite on the check's inputs (%s values): the "
                    "fidelity is measured over the finite ones", name,
                    ", ".join(f"{k}: {v}" for k, v in bad.items()))
    return fid


# A dispatch model whose 1 - cosine passes this many times its graph's own op-by-op bf16 rounding's is broken by a
# rewrite, not by bf16: the zoo's members keep 0.01x-1.00x (bench/results.md), so 10x is far past any of them
REWRITE_FACTOR = 10.0
_BF16_PROBE_BYTES = 4 << 30  # the op-by-op bf16 run holds every value of the graph: past this, not run


def _bf16_rounding(name: str, source: Path, feeds: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                   fid: dict[str, Any]) -> dict[str, Any] | None:
    """Where the dispatch model loses more than bf16 usually loses: the graph's own op-by-op bf16 rounding on the
    same inputs beside it (``sdnpu.reports.bf16``). Within ``REWRITE_FACTOR`` of it, the graph is sensitive to
    bf16 itself (a warning naming where its error grows); past it, a rewrite broke its numbers: an SdnpuError
    (exit 2), nothing written."""
    if 3 * estimate(source).bytes > _BF16_PROBE_BYTES:
        log.warning("[%s] the dispatch model loses more than bf16 usually loses: cosine %.4f against the fp32 graph "
                    "(the presets' components and the zoo's members keep %.3f or better); the graph is too large "
                    "here to set its own op-by-op bf16 rounding beside it", name, fid["min_cosine"],
                    BF16_USUAL_COSINE)
        return None
    with step(log, f"[{name}] the fp32 graph rounded to bf16 op by op, on the check's inputs"):
        try:
            rounding = bf16.measure(onnx.load(str(source)), feeds, reference)  # the graph with its weights
        except Exception as e:  # onnxruntime refuses the rounded graph (an op without a bf16-free form, say)
            if not is_ort_error(e):
                raise
            log.warning("[%s] the dispatch model loses more than bf16 usually loses: cosine %.4f against the fp32 "
                        "graph (the presets' components and the zoo's members keep %.3f or better); onnxruntime "
                        "would not run the graph rounded to bf16 op by op beside it (%s)", name, fid["min_cosine"],
                        BF16_USUAL_COSINE, ort_message(e)[:200])
            return None
    ours, theirs = 1 - fid["min_cosine"], 1 - rounding["min_cosine"]
    rounding["ratio"] = round(ours / max(theirs, 1e-9), 3)
    where = ", ".join(f"{d['op_type']} {d['node']} ({d['cosine']:.4f})" for d in rounding["departures"]) or "no node"
    broken = {k: o["reference_not_finite"] for k, o in fid["outputs"].items() if o.get("reference_not_finite")}
    if ours > REWRITE_FACTOR * max(theirs, 1e-7) and broken:  # no rewrite to blame: the graph is not finite itself
        raise SdnpuError(
            f"the fp32 graph {source} computes NaN or inf itself on the check's inputs ("
            + ", ".join(f"{k}: {v} values" for k, v in broken.items())
            + f"), and where it is finite the dispatch model is far from it (cosine {fid['min_cosine']:.4f}; the "
            f"graph rounded to bf16 op by op keeps {rounding['min_cosine']:.6f} there)", hint="check the export "
            "first: a graph whose own outputs are not finite is often the exporter's fault (`sdnpu convert` runs "
            "model.onnx against PyTorch; the other exporter may not have it); if the export is right, this is a "
            "compiler bug worth reporting with the model. Nothing was written; `--no-compile` keeps the graph")
    if ours > REWRITE_FACTOR * max(theirs, 1e-7):
        raise SdnpuError(
            f"the dispatch model compiled from {source} computes wrong: cosine {fid['min_cosine']:.4f} against the "
            f"fp32 graph, where the graph rounded to bf16 op by op keeps {rounding['min_cosine']:.6f} ({ours / max(theirs, 1e-9):.0f}x "
            "its error, past the "
            f"{REWRITE_FACTOR:g}x bf16 allows): a rewrite broke its numbers", hint="this is a compiler bug worth "
            "reporting with the model (nothing was written); meanwhile `--no-compile` keeps the exported graph")
    log.warning("[%s] bf16-sensitive graph: the dispatch model keeps cosine %.4f against the fp32 graph, and the graph "
                "itself rounded to bf16 op by op keeps %.4f (the dispatch model's error is %.2fx that); bf16's error "
                "grows first at %s", name, fid["min_cosine"], rounding["min_cosine"], rounding["ratio"], where)
    return rounding


# the element types onnxruntime's Python API hands over as numpy arrays (bf16 through the handoff code)
_NUMPY_TYPES = frozenset(range(1, 14)) | {16}  # FLOAT ... UINT64 (no COMPLEX: 14, 15), BFLOAT16


def _check_runnable(*paths: Path) -> None:
    """``CannotFeed`` where a graph's inputs or outputs are of a type the check cannot hand over (float8,
    int4, complex, sequences): onnxruntime's Python API has no numpy type for them."""
    for path in paths:
        graph = onnx.load(str(path), load_external_data=False).graph
        inits = {t.name for t in graph.initializer}
        for vi in [*graph.input, *graph.output]:
            if vi.name in inits:
                continue
            kind = vi.type.WhichOneof("value")
            elem = vi.type.tensor_type.elem_type if kind == "tensor_type" else None
            if elem is None or elem not in _NUMPY_TYPES:
                what = onnx.TensorProto.DataType.Name(elem) if elem else (kind or "untyped").replace("_type", "")
                raise CannotFeed(f"{vi.name!r} is a {what} value, which onnxruntime's Python API does not hand "
                                 "over")


def _drop_outputs(model: Any, keep: list[str], name: str) -> list[str]:
    """Remove the graph outputs not in ``keep`` (the canonical steps then remove the nodes only they needed)."""
    dropped = [v.name for v in model.graph.outputs if v.name not in keep]
    kept = [v for v in model.graph.outputs if v.name in keep]
    model.graph.outputs.clear()
    model.graph.outputs.extend(kept)
    if dropped:
        log.info("[%s] keeping outputs %s; dropping %d that the pipeline does not read (--outputs all keeps them)",
                 name, ", ".join(keep), len(dropped))
    return dropped


def _refuse_shared_dd(dd_dir: Path) -> None:
    """``sdnpu compile`` replaces its output folder whole: refuse a component's ``dd/`` that holds the
    dispatch models of several sizes over one data file (``sdnpu.convert.shared``), which it would drop."""
    if dd_dir.name != "dd" or not dd_dir.is_dir():
        return
    sizes = sizes_of(dd_dir.parent)
    if len(sizes) > 1:
        raise SdnpuError(f"{dd_dir} holds the dispatch models of {len(sizes)} sizes "
                         f"({', '.join(str(f.size) for f in sizes)}) over one copy of the weights; compiling "
                         "into it would replace them all",
                         hint="give --out DIR for this compile, or convert the component again (sdnpu convert "
                         "--res ...)")


def _file_options(source: Path, options: CompileOptions, config: dict[str, Any] | None) -> CompileOptions:
    """``options`` for compiling the graph at ``source`` alone: where its folder's config says it is a ControlNet
    or the UNet taking one's residuals, their handoff values and step-prologue inputs (unless given)."""
    component = source.parent.name
    if config is not None and not options.handoff:  # a ControlNet's residuals, the residual UNet's inputs for them
        options = dataclasses.replace(options, handoff=handoff_values(component, config))
    if config is not None and not options.prologue:  # the step inputs a ControlNet and the residual UNet share
        options = dataclasses.replace(options, prologue=prologue_inputs(component, config))
    return options


def compile_file(source: Path, out: Path | None = None, options: CompileOptions | None = None, *,
                 verify: bool = True, res: int | str | Size | None = None, outputs: str = "pipeline"
                 ) -> dict[str, Any]:
    """``sdnpu compile``: ``source`` -> ``out`` (default: ``dd/`` beside the source), replaced atomically.
    ``options``: target and precision (default: amd-xdna2, bf16), and ``shapes`` for dynamic input axes
    (``--shape``); ``res``: the image size for the shapes of an SD component folder (see ``static_shapes``);
    ``outputs``: pipeline, all, or a comma-separated list of output names (see ``keep_outputs``)."""
    source = Path(source)
    if not source.is_file():
        raise SdnpuError(f"{source} is not a file", hint="give the path of an .onnx model")
    options = options or CompileOptions()
    options = dataclasses.replace(options, shapes=static_shapes(source, options.input_shapes, res))
    config_path = source.parent / "config.json"
    config = read_config(config_path) if config_path.is_file() else None
    options = _file_options(source, options, config)
    keep = keep_outputs(outputs, output_names(source), source.parent.name, config, pipeline_kind(source))
    dd_dir = Path(out) if out is not None else source.parent / options.target.out_dir
    _refuse_shared_dd(dd_dir)
    with staged_dir(dd_dir) as stage:
        info = {"component": source.resolve().parent.name, "source": {"name": str(source), "kind": "onnx"}}
        return compile_into(source, stage, info, options, outputs=keep, check=FidelityCheck() if verify else None,
                            keep=units_folder(dd_dir))
