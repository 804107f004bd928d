"""Another size of a compiled component, re-derived from the primary's dispatch model instead of compiled again
(``sdnpu.passes.specialize``): the plan made in memory (``plan_specialization``), then its graph written over
the primary's data file, validated, and reported as a compile would (``write_specialized``)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from sdnpu.convert import shared
from sdnpu.convert.compile import FidelityCheck, fidelity_run, validate_dispatch_model, write_report
from sdnpu.formats import handoff, prologue, weights
from sdnpu.onnxrun import prologue_output_shapes
from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.pipeline import CompileOptions
from sdnpu.passes.specialize import CannotSpecialize, specialize
from sdnpu.progress import peak_rss_bytes


@dataclass(frozen=True)
class Specialization:
    """A plan (``sdnpu.passes.specialize.Specialized``) for the exported graph ``source`` from the dispatch
    model ``primary``, and the seconds it took."""

    plan: Any
    primary: Path
    source: Path
    seconds: float


def _io_dims(model: Any, primary: Path, source: Path) -> dict[str, list[int]]:
    """The shapes the re-derived model must have: the exported graph's inputs and outputs, in the form the
    dispatch model takes and gives them (handoff values in the NPU's layout, a step prologue's values)."""
    src = onnx.load(str(source), load_external_data=False)
    inits = {t.name for t in src.graph.initializer}
    dims = {vi.name: [int(d.dim_value) for d in vi.type.tensor_type.shape.dim]
            for vi in [*src.graph.input, *src.graph.output] if vi.name not in inits}
    for name, to_reference in handoff.of_proto(model).items():  # kept in the NPU's layout
        if name in dims:
            dims[name] = handoff.graph_shape(dims[name], to_reference)
    steps = prologue.of_proto(model)  # the step prologue's values, at this size
    if steps is not None:
        try:
            dims.update(prologue_output_shapes(steps.path(primary), {k: dims[k] for k in steps.inputs}))
        except Exception as e:  # onnxruntime's refusal: a constant of the prologue is sized for the primary
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise CannotSpecialize(f"its prologue does not run at this size, a constant in it is sized for the "
                                   f"primary (Flux.1's rotary tables are cut at the text length): {first}") from None
    return dims


def plan_specialization(primary: Path, source: Path, target: DispatchTarget) -> Specialization:
    """The dispatch model ``primary`` (a compiled size of a component) re-derived for the input shapes of
    the exported graph ``source`` (another size of it), in memory; its outputs must have the shapes
    ``source``'s have. Raises CannotSpecialize with the reason."""
    started = time.perf_counter()
    model = onnx.load(str(primary), load_external_data=False)
    dims = _io_dims(model, primary, source)
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
    return Specialization(plan, primary, source, time.perf_counter() - started)


def write_specialized(spec: Specialization, dest: Path, dd_dir: Path, info: dict[str, Any], options: CompileOptions,
                      check: FidelityCheck | None) -> tuple[dict[str, Any], Any]:
    """Write a specialized dispatch model to ``dest``, beside the primary whose data it reads, validate it,
    and write its report and weight record into ``dd_dir`` as a compile does (with ``check``, the fidelity
    run against the exported graph). Returns (the report, what the graph shares)."""
    plan, primary, source = spec.plan, spec.primary, spec.source
    name = info.get("component", source.parent.name)
    stats = shared.write_proto(plan.model, dest)
    validate_dispatch_model(dest, name, f"specialized from {primary}",
                            "convert this size on its own (sdnpu convert --res WxH)")
    fid, skipped = fidelity_run(name, source, dest, check) if check is not None else (None, None)
    first = json.loads((primary.parent / "report.json").read_text())
    counts = {f"from {_size_name(first)}: nodes re-shaped": plan.reshaped, "masks made": len(plan.new_masks)}
    passes = [{"name": "specialize", "seconds": round(spec.seconds, 3), "counts": counts},
              *[{**p, "seconds": 0.0} for p in first.get("passes", []) if p["name"] == "partition"]]
    extra = {"target": options.target.name, "precision": options.precision, "peak_rss_bytes": peak_rss_bytes(),
             "specialized_from": _size_name(first), **({"fidelity_skipped": skipped} if skipped else {})}
    report = write_report(dd_dir, dest, source, passes, {**info, **extra}, fid)
    record = json.loads((primary.parent / weights.FILE).read_text())
    kept = {k: v for k, v in record["weights"].items() if k not in set(plan.dropped)}
    kept.update({k: weights.LITERAL for k in plan.new_masks})
    weights.write_record(dd_dir / weights.FILE, {**record, "source": source.name, "weights": kept})
    return report, stats


def _size_name(report: dict[str, Any]) -> str:
    size = report.get("size") or {}
    return f"{size.get('width')}x{size.get('height')}" if size else "the primary"
