"""More sizes of a component over one copy of its weights: each size after the primary is exported in a scratch
folder beside it, its fp32 graph written into the component's folder pointing at the primary's data file
(``sdnpu.convert.shared``), its dispatch model re-derived from the primary's (``sdnpu.convert.specialized``) or,
where that is refused, compiled in full; then ``sizes.json`` lists it. ``--add`` does the same for a folder
converted before (``check_addable`` refuses, before any export, one whose settings differ)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import onnx

from sdnpu.components import LORA_COMPONENTS, SIZED
from sdnpu.convert import budget, shared, specialized
from sdnpu.convert.compile import REPLACED, FidelityCheck
from sdnpu.convert.job import MODEL_FILE, Job, compile_info
from sdnpu.convert.options import ComponentResult
from sdnpu.convert.sources import Source
from sdnpu.convert.stages import compile_stage, export_component
from sdnpu.convert.torch_stage import read_loras, run_torch_stage, run_torch_stage_in_worker
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_bytes
from sdnpu.formats import prologue, reference
from sdnpu.formats.sizes import SizeFiles, Variant, read_manifest, sizes_of, write_manifest
from sdnpu.passes.specialize import CannotSpecialize
from sdnpu.progress import release_memory, step
from sdnpu.reports import report as reports

log = logging.getLogger(__name__)


def _settings(done: dict[str, Any]) -> dict[str, Any]:
    """What a component folder's export.json says it was converted with."""
    return {"weights (source fingerprint)": done.get("source", {}).get("fingerprint"),
            "exporter": done.get("exporter"), "opset": done.get("opset"),
            "LoRAs fused": [f"{x.get('name')}:{x.get('scale'):g} (sha256 {str(x.get('sha256'))[:12]})"
                            for x in (done.get("lora_fused") or {}).get("fused", [])]}


def check_addable(src: Source, job: Job, comp_dir: Path) -> None:
    """``--add``: refuse, before any export, a component whose folder is missing or was converted from other
    weights or with other settings than this run's (its sizes could not share them)."""
    comp, options = job.component, job.options
    export = comp_dir / "export.json"
    if not export.is_file():
        raise SdnpuError(f"--add: {comp_dir} holds no converted {comp}",
                         hint=f"convert it first without --add: make convert MODEL={comp} OUT={comp_dir.parent}")
    reference.require(comp_dir, "derive the added sizes from (--add)")
    try:
        theirs = _settings(json.loads(export.read_text()))
    except (OSError, ValueError) as e:
        raise SdnpuError(f"--add: cannot read {export}: {e}", hint="convert the component again without --add") from e
    ours = {"weights (source fingerprint)": job.origin.fingerprint, "exporter": options.exporter,
            "opset": options.opset,
            "LoRAs fused": [f"{d['name']}:{d['scale']:g} (sha256 {str(d['sha256'])[:12]})"
                            for d in (x.describe() for x in read_loras(src, options.loras))]
            if options.loras and comp in LORA_COMPONENTS else []}
    report = comp_dir / "dd" / "report.json"
    if options.compile:
        if not report.is_file():
            raise SdnpuError(f"--add: {comp_dir} has no dispatch model (it was converted with --no-compile)",
                             hint="add with --no-compile too, or convert again without --add")
        r = json.loads(report.read_text())
        theirs.update({"target": r.get("target"), "precision": r.get("precision", "bf16")})
        ours.update({"target": options.target, "precision": options.precision})
    for what, value in ours.items():
        if theirs[what] != value:
            raise SdnpuError(f"--add: {comp_dir} was converted with {what} {theirs[what]}, this run has {value}",
                             hint="sizes share weights only with the same settings: give the same ones, or "
                             "convert again without --add")


def files_of(comp_dir: Path, variant: Variant) -> SizeFiles:
    """The files ``variant`` gets beside the primary in ``comp_dir`` (whose batch its names carry where it
    differs)."""
    have = sizes_of(comp_dir)
    return SizeFiles.of(variant, have[0].batch if have else None)


def add_sizes(src: Source, job: Job, comp_dir: Path, variants: list[Variant]) -> list[ComponentResult]:
    """``--add``: convert the variants (sizes; a denoiser's batches) ``comp_dir`` lacks beside the ones it has;
    only their files are written (each atomically), then ``sizes.json``. The shared data files are read, never
    written."""
    comp = job.component
    for leftover in [*comp_dir.glob("*.partial"), *(comp_dir / "dd").glob("*.partial")]:
        log.info("removing %s, left by an add that did not finish", leftover)
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    have = {f.variant for f in sizes_of(comp_dir)}
    new = [v for v in variants if v not in have]
    if comp not in SIZED or not new:
        log.info("[%s] %s: nothing to add (%s)", comp, comp_dir,
                 "it does not depend on the size" if comp not in SIZED else
                 "it has " + ", ".join(str(v) for v in variants))
        return []
    results = []
    for variant in new:
        result, stats = convert_size(src, job.at(variant), comp_dir)
        result.path = comp_dir / files_of(comp_dir, variant).model
        results.append(result)
        finish_sizes(comp_dir, comp, {variant: stats})
    return results


def convert_size(src: Source, job: Job, comp_dir: Path) -> tuple[ComponentResult, dict[str, Any]]:
    """Convert ``job`` (one more size of a component whose primary is in ``comp_dir``); its reports and records
    get their size's names. Returns its result and what its graphs share."""
    files = files_of(comp_dir, job.variant)
    scratch = comp_dir / f".size-{files.tag}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        log.info("[%s] %s (sharing the weights of %s)", job.component, job.variant, comp_dir)
        path = str(scratch / MODEL_FILE)
        if budget.module_bytes(src, job.key) > budget.ISOLATE_BYTES:
            torch_stage = run_torch_stage_in_worker(src, job, path)
        else:
            torch_stage = run_torch_stage(src, job, path, [])
        release_memory()
        reuse = job.options.compile and (comp_dir / "dd" / REPLACED).is_file()
        kept: dict[str, Any] = {}
        result = export_component(job, torch_stage, scratch, compile=not reuse, keep=kept)
        plan = _specialize_or_compile(job, comp_dir, scratch, result, kept) if reuse else None
        stats = _write_shared(job, comp_dir, scratch, result, with_dispatch=job.options.compile and plan is None)
        if plan is not None:
            _write_specialized(job, comp_dir, scratch, result, (plan, kept, stats))
        elif job.options.compile:
            with step(log, f"[{job.component}] {job.variant}: validating {files.dispatch} (onnx.checker, "
                           "full check)"):
                onnx.checker.check_model(str(comp_dir / files.dispatch), full_check=True)
        _move_records(job, comp_dir, scratch, result, stats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result, stats


def _specialize_or_compile(job: Job, comp_dir: Path, scratch: Path, result: ComponentResult,
                           kept: dict[str, Any]) -> specialized.Specialization | None:
    """The primary's dispatch model re-derived for this size; where that is refused, this size compiled in full
    in ``scratch`` (None)."""
    dd_primary = comp_dir / "dd" / REPLACED
    if shared.make_shareable(dd_primary):  # its data file just became shareable: the digests cached for it go
        cache = shared.read_digest_cache(comp_dir)
        if cache.pop(f"dd/{REPLACED}.data", None) is not None:
            shared.write_digest_cache(comp_dir, cache)
    try:
        return specialized.plan_specialization(dd_primary, scratch / MODEL_FILE, job.options.compile_options.target)
    except CannotSpecialize as e:
        log.warning("[%s] %s: the dispatch model of %s cannot be re-derived for it (%s); compiling "
                    "it in full", job.component, job.variant, comp_dir, e)
    except Exception as e:  # noqa: BLE001 - a size is never lost to the shortcut: the full compile is the answer
        log.warning("[%s] %s: re-deriving the dispatch model of %s failed (%s: %s; a bug in sdnpu's size "
                    "specializer, please report it); compiling it in full", job.component, job.variant, comp_dir,
                    type(e).__name__, e)
    with step(log, f"[{job.component}] compile stage") as t:
        result.report = compile_stage(job, scratch, kept["feeds"], kept["actual"], kept["lora"])["summary"]
    place_prologue(scratch / "dd" / REPLACED, comp_dir / "dd", files_of(comp_dir, job.variant).tag)
    result.seconds["compile"] = round(t.seconds, 2)
    return None


def _write_shared(job: Job, comp_dir: Path, scratch: Path, result: ComponentResult, with_dispatch: bool
                  ) -> dict[str, Any]:
    """This size's fp32 graph (and, ``with_dispatch``, its dispatch model compiled in full) written into
    ``comp_dir`` over the primary's data files; returns what each shares."""
    files = files_of(comp_dir, job.variant)
    graphs = [(MODEL_FILE, files.model)] + ([(f"dd/{REPLACED}", files.dispatch)] if with_dispatch else [])
    cache = shared.read_digest_cache(comp_dir)
    cached = json.dumps(cache, sort_keys=True)
    stats: dict[str, Any] = {}
    with step(log, f"[{job.component}] {job.variant}: writing its graphs over the shared weights") as t:
        for primary, name in graphs:
            if shared.make_shareable(comp_dir / primary):
                cache.pop(primary + ".data", None)
            index = shared.digests(comp_dir / primary, cache.setdefault(primary + ".data", {}))
            s = shared.write_sized(scratch / primary, comp_dir / name, index, Path(primary).name + ".data")
            stats["model" if primary == MODEL_FILE else "dispatch"] = s.to_json()
            log.info("[%s] %s: %s -> %d tensors (%s) in the shared file, %d (%s) its own, graph %s", job.component,
                     job.variant, name, s.shared, budget.human(s.shared_bytes), s.own, budget.human(s.own_bytes),
                     budget.human(s.graph_bytes))
        if json.dumps(cache, sort_keys=True) != cached:
            shared.write_digest_cache(comp_dir, cache)
    result.seconds["share"] = round(t.seconds, 2)
    return stats


def _write_specialized(job: Job, comp_dir: Path, scratch: Path, result: ComponentResult,
                       planned: tuple[specialized.Specialization, dict[str, Any], dict[str, Any]]) -> None:
    """The re-derived dispatch model written beside the primary's, its report and record into ``scratch``."""
    plan, kept, stats = planned
    files = files_of(comp_dir, job.variant)
    with step(log, f"[{job.component}] {job.variant}: writing {files.dispatch}, re-derived from the primary's "
                   f"({plan.plan.reshaped} nodes re-shaped, {len(plan.plan.new_masks)} masks made)") as t:
        check = FidelityCheck(kept["feeds"], reference=kept["actual"]) if job.options.check else None
        report, s = specialized.write_specialized(plan, comp_dir / files.dispatch, scratch / "dd",
                                                  compile_info(job, kept["lora"]), job.options.compile_options, check)
    stats["dispatch"] = s.to_json()
    result.report = report["summary"]
    result.seconds["compile"] = round(plan.seconds + t.seconds, 2)
    log.info("[%s] %s: offload rate %.2f%% (%d dispatch ops, %d CPU nodes)", job.component, job.variant,
             100 * result.report["offload_rate"], result.report["offloaded_nodes"], result.report["cpu_nodes"])


def _move_records(job: Job, comp_dir: Path, scratch: Path, result: ComponentResult, stats: dict[str, Any]) -> None:
    """The size's records from ``scratch`` into ``comp_dir`` under its size's names, each atomically; its
    export.json and report with what its graphs share."""
    files, plain = files_of(comp_dir, job.variant), SizeFiles(job.res, True)
    moves = [(plain.export, files.export), (plain.parameters, files.parameters)]
    if job.options.compile:
        moves += [(plain.report, files.report), (plain.text_report, files.text_report),
                  (plain.weights, files.weights)]
    for a, b in moves:
        data = (scratch / a).read_bytes()
        if a in (plain.export, plain.report):
            record = {**json.loads(data), "shared": stats}
            if a == plain.export:
                record["seconds"] = result.seconds
            data = (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()
        atomic_write_bytes(comp_dir / b, data)


def finish_sizes(comp_dir: Path, comp: str, added: dict[Variant, dict[str, Any]]) -> None:
    """``sizes.json`` for what ``comp_dir`` holds: its variants so far (the primary first), then ``added``
    (variant -> what its graphs share), and the sizes table of the primary's report. Written after the
    variants' own files: one is listed only once its graphs are whole."""
    manifest = read_manifest(comp_dir)
    listed = sizes_of(comp_dir)
    stats: dict[Variant, Any] = {f.variant: e.get("shared")
                                 for f, e in zip(listed, (manifest or {}).get("sizes", []), strict=False)}
    for variant, value in added.items():
        stats[variant] = value
        if variant not in {f.variant for f in listed}:
            listed.append(files_of(comp_dir, variant))
    write_manifest(comp_dir, comp, listed, stats)
    if (comp_dir / "dd" / "report.json").is_file():
        reports.write_sizes(comp_dir, read_manifest(comp_dir) or {})


def place_prologue(compiled: Path, dd_dir: Path, tag: str) -> None:
    """A size compiled in full beside the primary (``compiled``, in the scratch folder) reads its step prologue
    (``sdnpu.formats.prologue``) from the component's ``dd/``: the primary's where the two compute the same (the
    same digest: one prologue serves every size), else its own copy under the size's name, which its model
    then names."""
    model = onnx.load(str(compiled), load_external_data=False)
    spec = prologue.of_proto(model)
    if spec is None:
        return
    primary = dd_dir / prologue.FILE
    theirs = prologue.of_proto(onnx.load(str(primary))) if primary.is_file() else None
    if theirs is not None and theirs.digest == spec.digest:
        return
    own = dataclasses.replace(spec, file=f"prologue.{tag}.onnx")
    atomic_write_bytes(dd_dir / own.file, spec.path(compiled).read_bytes())
    for p in model.metadata_props:
        if p.key == prologue.KEY:
            p.value = own.encode()
    onnx.save(model, str(compiled))
