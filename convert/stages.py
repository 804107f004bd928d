"""The stages of one component after its torch side: the exported graph checked (onnx's full check, then run
in onnxruntime against PyTorch), compiled into ``dd/`` (with the fidelity run), and its records written."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import onnx

from sdnpu.components import SIZED
from sdnpu.convert.compile import FidelityCheck, compile_into, keep_outputs
from sdnpu.convert.export import CHECK_RTOL
from sdnpu.convert.job import MODEL_FILE, Job, compile_info, write_records
from sdnpu.convert.kept import folder_for as units_folder
from sdnpu.convert.options import ComponentResult
from sdnpu.convert.torch_stage import TorchStage
from sdnpu.errors import SdnpuError
from sdnpu.fileio import staging_target
from sdnpu.memory import check_fits
from sdnpu.onnxrun import run_onnx
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports.fidelity import fidelity
from sdnpu.signatures import Signature

log = logging.getLogger(__name__)


def export_component(job: Job, torch_stage: TorchStage, stage: Path, compile: bool = True,
                     keep: dict[str, Any] | None = None) -> ComponentResult:
    """Check the exported graph in ``stage`` and, with ``compile`` (and the job's options), compile it into
    ``stage/dd``; ``keep`` (when given) receives what a later compile of the same graph needs."""
    comp, res, options = job.component, job.res, job.options
    sig = job.signature()
    feeds = job.sample_inputs()
    path = stage / MODEL_FILE
    seconds = dict(torch_stage.seconds)
    with step(log, f"[{comp}] validating the graph (onnx.checker, full check)") as t:
        onnx.checker.check_model(str(path), full_check=True)
    seconds["onnx_check"] = round(t.seconds, 2)
    graph = onnx.load(str(path), load_external_data=False)
    check_data = None
    actual = None
    if options.check and torch_stage.reference is not None:
        check_fits(path, f"[{comp}] running the exported graph in onnxruntime (the check against PyTorch)",
                   hint=f"--no-check skips the check, or convert at a smaller RES (now {res})")
        with step(log, f"[{comp}] running the graph in onnxruntime") as t:
            actual = run_onnx(path, feeds, optimize=True)
        release_memory()  # the session's heap back to the OS before the compile stage measures what it has
        seconds["onnx_run"] = round(t.seconds, 2)
        check_data = check_outputs(comp, sig, torch_stage.reference, actual)
    summary = None
    if keep is not None:
        keep.update(feeds=feeds, actual=actual, lora=torch_stage.lora)
    if options.compile and compile:
        with step(log, f"[{comp}] compile stage") as t:
            summary = compile_stage(job, stage, feeds, actual, torch_stage.lora)["summary"]
        seconds["compile"] = round(t.seconds, 2)
    result = ComponentResult(component=comp, path=path, nodes=len(graph.graph.node), parameters=torch_stage.parameters,
                             seconds=seconds, peak_rss_bytes=max(peak_rss_bytes(), torch_stage.peak_rss_bytes),
                             check=check_data, report=summary, size=str(res) if comp in SIZED else "",
                             batch=job.batch)
    write_records(job, stage, result, torch_stage.sources, torch_stage.lora)
    return result


def compile_stage(job: Job, stage: Path, feeds: dict[str, Any], actual: dict[str, Any] | None,
                  lora: dict[str, Any] | None) -> dict[str, Any]:
    """Compile ``stage/model.onnx`` into ``stage/dd`` (with the fidelity run when the job checks). Returns
    the report."""
    spec, options = job.spec, job.options
    keep = keep_outputs(options.outputs, list(job.signature().outputs), job.component, spec.config, spec.family)
    check = FidelityCheck(feeds, reference=actual) if options.check else None
    compile_options = dataclasses.replace(options.compile_options, handoff=spec.handoff, prologue=spec.prologue)
    target = staging_target(stage)  # the component's folder: its vendor units are kept beside it
    return compile_into(stage / MODEL_FILE, stage / compile_options.target.out_dir, compile_info(job, lora),
                        compile_options, outputs=keep, check=check,
                        keep=units_folder(target) if target is not None else None)


def check_outputs(comp: str, sig: Signature, reference: list[Any], actual: dict[str, Any]) -> dict[str, Any]:
    """The exported graph's outputs against PyTorch's; off by more than ``CHECK_RTOL`` of the range stops."""
    fid = fidelity(dict(zip(sig.outputs, reference, strict=True)), actual)
    per_output = fid["outputs"]
    worst_name = max(per_output, key=lambda n: per_output[n]["max_rel"])
    worst = per_output[worst_name]["max_rel"]
    log.info("[%s] ONNX vs PyTorch: max abs error %.3g, max rel error %.3g (%s), min cosine %.9f", comp,
             fid["max_abs"], worst, worst_name, fid["min_cosine"])
    if not worst <= CHECK_RTOL:
        raise SdnpuError(
            f"the exported {comp} does not match PyTorch: output {worst_name!r} is off by {worst:.3g} "
            f"of its range (tolerance {CHECK_RTOL:g})",
            hint="try the other exporter (--exporter), or --no-check to keep the graph anyway",
        )
    return {"max_abs_error": fid["max_abs"], "max_rel_error": worst, "min_cosine": fid["min_cosine"],
            "rel_tolerance": CHECK_RTOL, "outputs": per_output}
