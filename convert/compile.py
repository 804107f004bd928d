"""Compile stage: an ONNX graph -> ``dd/replaced.onnx`` + ``dd/onnx_report.txt`` + ``dd/report.json``.

Used by ``sdnpu convert`` (after export, inside the component's staging folder) and by ``sdnpu compile``
(any ONNX file, e.g. what ``optimum-cli export onnx`` writes). Needs no torch.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.components import COMPONENTS
from sdnpu.errors import SdnpuError
from sdnpu.fileio import staged_dir
from sdnpu.memory import check_fits
from sdnpu.formats import handoff, prologue, weights
from sdnpu.onnxrun import prologue_output_shapes, run_onnx
from sdnpu.passes.pipeline import CompileOptions
from sdnpu.imagesize import Size
from sdnpu.signatures import signature
from sdnpu.specs import default_resolution, handoff_values, pipeline_outputs, prologue_inputs
from sdnpu.signatures import vae_scale_factor
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports.fidelity import fidelity, generic_inputs

__all__ = ["OUTPUT_CHOICES", "FidelityCheck", "compile_file", "compile_into", "fidelity", "generic_inputs",
           "keep_outputs", "pipeline_outputs", "run_onnx", "static_shapes"]

log = logging.getLogger(__name__)

REPLACED = "replaced.onnx"

# --outputs: "pipeline" (default) keeps what a diffusers pipeline reads, "all" keeps every output of the
# graph; anything else is a comma-separated list of output names.
OUTPUT_CHOICES = ("pipeline", "all")


def keep_outputs(spec: str, available: list[str], component: str, config: dict[str, Any] | None,
                 sdxl: bool | None) -> list[str] | None:
    """``--outputs`` -> the output names to keep (None: all). ``sdxl`` None: the pipeline is unknown."""
    if spec == "all":
        return None
    if spec == "pipeline":
        if sdxl is None and component == "text_encoder":
            log.info("[%s] keeping every output: no model_index.json says which pipeline reads it "
                     "(--outputs NAME,... chooses)", component)
            return None
        wanted = pipeline_outputs(component, config or {}, bool(sdxl)) if config is not None else None
        if wanted is None:
            return None
        if not set(wanted) <= set(available):
            log.warning("[%s] keeping every output: the pipeline reads %s, the graph has %s", component,
                        ", ".join(wanted), ", ".join(available))
            return None
        return wanted if len(wanted) < len(available) else None
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        raise SdnpuError(f"--outputs {spec!r}: {', '.join(unknown) or 'no name'} is not an output of the graph",
                         hint=f"choose from {', '.join(available)}, or pipeline / all")
    return names


def static_shapes(path: Path, overrides: dict[str, list[int]] | None = None, res: int | str | Size | None = None
                  ) -> dict[str, list[int]]:
    """Static shapes for a graph's inputs where it has dynamic axes (optimum exports them). A component
    folder of an SD pipeline (``unet/model.onnx`` with its ``config.json``, as optimum writes it) gets the
    same shapes ``sdnpu convert`` uses at resolution ``res`` (default: the model's own, by the rule in
    ``sdnpu.pipelines``, from the component's config.json and the VAE's beside it); ``overrides``
    (``--shape``) win. Inputs that stay dynamic are an error naming them."""
    import onnx

    from sdnpu.passes.modelfile import unreadable

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError and friends: a truncated file, or not ONNX
        raise unreadable(path, e) from e
    inits = {i.name for i in model.graph.initializer}
    dynamic = {vi.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                         for d in vi.type.tensor_type.shape.dim]
               for vi in model.graph.input if vi.name not in inits}
    dynamic = {k: v for k, v in dynamic.items() if any(not isinstance(d, int) or d <= 0 for d in v)}
    shapes: dict[str, list[int]] = {}
    component, config_path = path.parent.name, path.parent / "config.json"
    if dynamic and component in COMPONENTS and config_path.is_file():
        config = _read_config(config_path)
        vae = _sibling_vae_config(path.parent) or (config if component.startswith("vae") else None)
        denoiser = config if component in ("unet", "transformer") else None
        size = Size.of(default_resolution(denoiser, vae) if res is None else res)
        sig = signature(component, config, size, vae_scale_factor(vae))
        shapes = {spec.name: list(spec.shape) for spec in sig.inputs if spec.name in dynamic}
    shapes.update(overrides or {})
    missing = {k: v for k, v in dynamic.items() if k not in shapes}
    if missing:
        raise SdnpuError(
            "the model has dynamic input axes, and an NPU needs static shapes: "
            + ", ".join(f"{k} {v}" for k, v in missing.items()),
            hint="pass them, e.g. " + " ".join(f"--shape {k}=" + ",".join("N" for _ in v) for k, v in missing.items()))
    return shapes


def _read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError) as e:
        raise SdnpuError(f"cannot read {path}: {e}", hint="it should be the component's diffusers config.json") from e


def _sibling_vae_config(folder: Path) -> dict[str, Any] | None:
    """The VAE's config beside a component folder (optimum writes vae_decoder/, diffusers vae/): it sets
    the latent size."""
    for name in ("vae_decoder", "vae", "vae_encoder"):
        path = folder.parent / name / "config.json"
        if path.is_file():
            return _read_config(path)
    return None


@dataclass(frozen=True)
class FidelityCheck:
    """Run the dispatch model against the fp32 graph on ``feeds`` (None: generic seeded inputs);
    ``reference``: the fp32 graph's outputs when the caller has them already."""

    feeds: dict[str, np.ndarray] | None = None
    reference: dict[str, np.ndarray] | None = None


def compile_into(source: Path, dd_dir: Path, info: dict[str, Any], options: CompileOptions, *,
                 shapes: dict[str, list[int]] | None = None, outputs: list[str] | None = None,
                 check: FidelityCheck | None = FidelityCheck()) -> dict[str, Any]:
    """Compile ``source`` into the folder ``dd_dir`` (which the caller stages). Returns the report.
    ``shapes`` fixes dynamic input axes (see ``static_shapes``); ``outputs``: the graph outputs the
    dispatch model keeps (None: all; see ``keep_outputs``); ``check`` None: no fidelity run."""

    from sdnpu.passes import provenance
    from sdnpu.passes.canonicalize import bind_input_shapes
    from sdnpu.passes.manager import records_json
    from sdnpu.passes.modelfile import load, save
    from sdnpu.passes.pipeline import compile_model, pass_names
    from sdnpu.reports import report as reports

    name = info.get("component", source.parent.name)
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
        _validate(dd_dir / prologue.FILE, name, f"cut from {out.name}", "`--no-compile` keeps the exported graph")
    weights.write_record(dd_dir / weights.FILE, provenance.record(model.graph, source.name))
    del model
    release_memory()
    _validate(out, name, f"compiled from {source}", "`--no-compile` keeps the exported graph")
    fid = _fidelity_run(name, source, out, check, shapes) if check is not None else None
    extra: dict[str, Any] = {"target": options.target.name, "precision": options.precision,
                             "peak_rss_bytes": peak_rss_bytes()}
    if dropped:
        extra["dropped_outputs"] = dropped
    report = reports.build(out, source, records_json(records), {**info, **extra}, fid, options.target)
    reports.write(dd_dir, report)
    s = report["summary"]
    log.info("[%s] offload rate %.2f%% (%d dispatch ops, %d CPU nodes, %d NPU regions)", name,
             100 * s["offload_rate"], s["offloaded_nodes"], s["cpu_nodes"], s["npu_regions"])
    return report


def plan_specialization(primary: Path, source: Path, target: Any) -> Any:
    """The dispatch model ``primary`` (a compiled size of a component) re-derived for the input shapes of
    the exported graph ``source`` (another size of it), in memory (``sdnpu.passes.specialize``); its outputs
    must have the shapes ``source``'s have. Raises CannotSpecialize with the reason."""
    import onnx

    from sdnpu.convert import shared
    from sdnpu.passes.specialize import CannotSpecialize, specialize

    model = onnx.load(str(primary), load_external_data=False)
    src = onnx.load(str(source), load_external_data=False)
    inits = {t.name for t in src.graph.initializer}
    dims = {vi.name: [int(d.dim_value) for d in vi.type.tensor_type.shape.dim]
            for vi in [*src.graph.input, *src.graph.output] if vi.name not in inits}
    for name, to_reference in handoff.of_proto(model).items():  # kept in the NPU's layout
        if name in dims:
            dims[name] = handoff.graph_shape(dims[name], to_reference)
    steps = prologue.of_proto(model)  # the step prologue's values, at this size
    if steps is not None:
        dims.update(prologue_output_shapes(steps.path(primary), {k: dims[k] for k in steps.inputs}))
    handles: dict[str, Any] = {}
    try:
        plan = specialize(model, target, dims, lambda t: shared.tensor_bytes(primary.parent, t, handles))
    finally:
        for f in handles.values():
            f.close()
    for vi in plan.model.graph.output:
        shape = [int(d.dim_value) for d in vi.type.tensor_type.shape.dim]
        if vi.name in dims and dims[vi.name] != shape:
            raise CannotSpecialize(f"its output {vi.name} comes out {shape}, the exported graph's is {dims[vi.name]}")
    return plan


def write_specialized(plan: Any, primary: Path, source: Path, dest: Path, dd_dir: Path, info: dict[str, Any],
                      options: CompileOptions, check: FidelityCheck | None, seconds: float
                      ) -> tuple[dict[str, Any], Any]:
    """Write a specialized dispatch model (``plan_specialization``) to ``dest``, beside ``primary`` whose data
    it reads, validate it, and write its report and weight record into ``dd_dir`` as a compile does (with
    ``check``, the fidelity run against ``source``). Returns (the report, what the graph shares)."""
    from sdnpu.convert import shared
    from sdnpu.reports import report as reports

    name = info.get("component", source.parent.name)
    stats = shared.write_proto(plan.model, dest)
    _validate(dest, name, f"specialized from {primary}", "convert this size on its own (sdnpu convert --res WxH)")
    fid = _fidelity_run(name, source, dest, check) if check is not None else None
    first = json.loads((primary.parent / "report.json").read_text())
    counts = {f"from {_size_name(first)}: nodes re-shaped": plan.reshaped, "masks made": len(plan.new_masks)}
    passes = [{"name": "specialize", "seconds": round(seconds, 3), "counts": counts},
              *[{**p, "seconds": 0.0} for p in first.get("passes", []) if p["name"] == "partition"]]
    extra = {"target": options.target.name, "precision": options.precision, "peak_rss_bytes": peak_rss_bytes(),
             "specialized_from": _size_name(first)}
    report = reports.build(dest, source, passes, {**info, **extra}, fid, options.target)
    reports.write(dd_dir, report)
    record = json.loads((primary.parent / weights.FILE).read_text())
    kept = {k: v for k, v in record["weights"].items() if k not in set(plan.dropped)}
    kept.update({k: weights.LITERAL for k in plan.new_masks})
    weights.write_record(dd_dir / weights.FILE, {**record, "source": source.name, "weights": kept})
    return report, stats


def _validate(path: Path, name: str, made: str, meanwhile: str) -> None:
    """onnx's full check of a dispatch model just written; a failure is one line (a compiler bug)."""
    import onnx

    with step(log, f"[{name}] validating {path.name} (onnx.checker, full check)"):
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
            raise SdnpuError(f"the dispatch model {made} is not valid ONNX: {str(e)[:600]}",
                             hint=f"this is a compiler bug worth reporting with the model; meanwhile {meanwhile}"
                             ) from e


def _fidelity_run(name: str, source: Path, out: Path, check: FidelityCheck,
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


def _size_name(report: dict[str, Any]) -> str:
    size = report.get("size") or {}
    return f"{size.get('width')}x{size.get('height')}" if size else "the primary"


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


def _pipeline_kind(source: Path) -> bool | None:
    """Whether ``source`` (``<pipeline>/<component>/model.onnx``) belongs to an SDXL pipeline (one with a
    text_encoder_2), from the pipeline's model_index.json; None where there is none."""
    if source.parent.name == "text_encoder_2":
        return True
    try:
        return "text_encoder_2" in json.loads((source.parent.parent / "model_index.json").read_text())
    except (OSError, ValueError):
        return None


def output_names(path: Path) -> list[str]:
    import onnx

    return [o.name for o in onnx.load(str(path), load_external_data=False).graph.output]


def _refuse_shared_dd(dd_dir: Path) -> None:
    """``sdnpu compile`` replaces its output folder whole: refuse a component's ``dd/`` that holds the
    dispatch models of several sizes over one data file (``sdnpu.convert.shared``), which it would drop."""
    from sdnpu.formats.sizes import sizes_of

    if dd_dir.name != "dd" or not dd_dir.is_dir():
        return
    sizes = sizes_of(dd_dir.parent)
    if len(sizes) > 1:
        raise SdnpuError(f"{dd_dir} holds the dispatch models of {len(sizes)} sizes "
                         f"({', '.join(str(f.size) for f in sizes)}) over one copy of the weights; compiling "
                         "into it would replace them all",
                         hint="give --out DIR for this compile, or convert the component again (sdnpu convert "
                         "--res ...)")


def compile_file(source: Path, out: Path | None = None, options: CompileOptions | None = None, *,
                 verify: bool = True, shapes: dict[str, list[int]] | None = None, res: int | str | Size | None = None,
                 outputs: str = "pipeline") -> dict[str, Any]:
    """``sdnpu compile``: ``source`` -> ``out`` (default: ``dd/`` beside the source), replaced atomically.
    ``options``: target and precision (default: amd-xdna2, bf16); ``shapes`` / ``res``: see
    ``static_shapes``; ``outputs``: pipeline, all, or a comma-separated list of output names (see
    ``keep_outputs``)."""
    options = options or CompileOptions()
    source = Path(source)
    if not source.is_file():
        raise SdnpuError(f"{source} is not a file", hint="give the path of an .onnx model")
    bound = static_shapes(source, shapes, res)
    config_path = source.parent / "config.json"
    config = _read_config(config_path) if config_path.is_file() else None
    keep = keep_outputs(outputs, output_names(source), source.parent.name, config, _pipeline_kind(source))
    if config is not None and not options.handoff:  # a ControlNet's residuals, the residual UNet's inputs for them
        options = dataclasses.replace(options, handoff=handoff_values(source.parent.name, config))
    if config is not None and not options.prologue:  # the step inputs a ControlNet and the residual UNet share
        options = dataclasses.replace(options, prologue=prologue_inputs(source.parent.name, config))
    dd_dir = Path(out) if out is not None else source.parent / "dd"
    _refuse_shared_dd(dd_dir)
    with staged_dir(dd_dir) as stage:
        return compile_into(source, stage, {"component": source.parent.name,
                                            "source": {"name": str(source), "kind": "onnx"}}, options,
                            shapes=bound, outputs=keep, check=FidelityCheck() if verify else None)
