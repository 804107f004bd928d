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
from sdnpu.memory import check_fits
from sdnpu.onnxrun import run_onnx
from sdnpu.ops.target import get_target
from sdnpu.passes import provenance
from sdnpu.passes.canonicalize import bind_input_shapes
from sdnpu.passes.manager import records_json
from sdnpu.passes.modelfile import load, save
from sdnpu.passes.pipeline import CompileOptions, compile_model, pass_names
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports import report as reports
from sdnpu.reports.fidelity import fidelity, generic_inputs
from sdnpu.specs import handoff_values, pipeline_outputs, prologue_inputs

__all__ = ["OUTPUT_CHOICES", "REPLACED", "FidelityCheck", "compile_file", "compile_into", "fidelity",
           "fidelity_run", "generic_inputs", "keep_outputs", "pipeline_outputs", "run_onnx", "static_shapes",
           "validate_dispatch_model", "write_report"]

log = logging.getLogger(__name__)

REPLACED = "replaced.onnx"


@dataclass(frozen=True)
class FidelityCheck:
    """Run the dispatch model against the fp32 graph on ``feeds`` (None: generic seeded inputs);
    ``reference``: the fp32 graph's outputs when the caller has them already."""

    feeds: dict[str, np.ndarray] | None = None
    reference: dict[str, np.ndarray] | None = None


def compile_into(source: Path, dd_dir: Path, info: dict[str, Any], options: CompileOptions, *,
                 outputs: list[str] | None = None, check: FidelityCheck | None = FidelityCheck()) -> dict[str, Any]:
    """Compile ``source`` into the folder ``dd_dir`` (which the caller stages). Returns the report.
    ``options.shapes`` fixes dynamic input axes (see ``static_shapes``); ``outputs``: the graph outputs the
    dispatch model keeps (None: all; see ``keep_outputs``); ``check`` None: no fidelity run."""
    name = info.get("component", source.parent.name)
    shapes = options.input_shapes
    with step(log, f"[{name}] compiling for {options.target.name} ({', '.join(pass_names(options))})"):
        model = load(source)
        if shapes:
            bind_input_shapes(model, shapes)
        dropped = _drop_outputs(model, outputs, name) if outputs is not None else []
        records = compile_model(model, options)
    dd_dir.mkdir(parents=True, exist_ok=True)
    out = dd_dir / REPLACED
    with step(log, f"[{name}] writing {REPLACED} (bf16 weights)"):
        save(model, out)
    pro = next((r.result.details["prologue"] for r in records if "prologue" in r.result.details), None)
    if pro is not None:
        save(pro, dd_dir / prologue.FILE)
        validate_dispatch_model(dd_dir / prologue.FILE, name, f"cut from {out.name}",
                                "`--no-compile` keeps the exported graph")
    weights.write_record(dd_dir / weights.FILE, provenance.record(model.graph, source.name))
    del model
    release_memory()
    validate_dispatch_model(out, name, f"compiled from {source}", "`--no-compile` keeps the exported graph")
    fid = fidelity_run(name, source, out, check, shapes or None) if check is not None else None
    extra: dict[str, Any] = {"target": options.target.name, "precision": options.precision,
                             "peak_rss_bytes": peak_rss_bytes()}
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


def validate_dispatch_model(path: Path, name: str, made: str, meanwhile: str) -> None:
    """onnx's full check of a dispatch model just written; a failure is one line (a compiler bug)."""
    import onnx

    with step(log, f"[{name}] validating {path.name} (onnx.checker, full check)"):
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
            raise SdnpuError(f"the dispatch model {made} is not valid ONNX: {str(e)[:600]}",
                             hint=f"this is a compiler bug worth reporting with the model; meanwhile {meanwhile}"
                             ) from e


def fidelity_run(name: str, source: Path, out: Path, check: FidelityCheck,
                 shapes: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """The dispatch model ``out`` against the fp32 graph ``source`` on ``check``'s inputs (seeded generic
    ones where it has none), each run checked to fit in memory first."""
    hint = "--no-verify skips the fidelity run, or convert at a smaller RES"
    reference = check.reference
    if reference is None:
        check_fits(source, f"[{name}] the fidelity run of the fp32 graph", hint)
    check_fits(out, f"[{name}] the fidelity run of {out.name}", hint)
    feeds = check.feeds if check.feeds is not None else generic_inputs(source, shapes=shapes)
    if reference is None:
        with step(log, f"[{name}] running the fp32 graph for the fidelity check"):
            reference = run_onnx(source, feeds, optimize=True)
    with step(log, f"[{name}] running {out.name} (reference bodies) for the fidelity check"):
        actual = run_onnx(out, feeds)
    fid = fidelity(reference, actual)
    log.info("[%s] dispatch vs fp32: min cosine %.6f, max abs error %.3g", name, fid["min_cosine"], fid["max_abs"])
    return fid


def _drop_outputs(model: Any, keep: list[str], name: str) -> list[str]:
    """Remove the graph outputs not in ``keep`` (canonicalize then removes the nodes only they needed)."""
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
    dd_dir = Path(out) if out is not None else source.parent / "dd"
    _refuse_shared_dd(dd_dir)
    with staged_dir(dd_dir) as stage:
        info = {"component": source.parent.name, "source": {"name": str(source), "kind": "onnx"}}
        return compile_into(source, stage, info, options, outputs=keep, check=FidelityCheck() if verify else None)
