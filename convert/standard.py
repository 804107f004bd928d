"""The compile stage of a standard target (``qnn-htp``): an fp32 ONNX graph -> ``<out_dir>/`` holding

    model.onnx (+ .data)   the graph in the forms the NPU takes (``sdnpu.passes.pipeline.standard_pipeline``),
                           float32 at its edges, the fp32 graph's inputs and outputs
    ctx.onnx, ctx_*.bin    the vendor's compile of it (QNN's EPContext model and its context binary)
    qnn_op_trace.json      the vendor's own account of what it took
    report.json, onnx_report.txt   sdnpu's count beside the vendor's, fp16 headroom, fidelity

The fidelity run executes the vendor's compiled model (on Qualcomm's HTP emulator on x86-64: slow, and it says
so) against the fp32 graph on onnxruntime's CPU provider, on the same inputs. fp16 headroom is measured on the
fp32 graph's run (``sdnpu.reports.headroom``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from sdnpu.backends import backend_of
from sdnpu.convert import split
from sdnpu.convert.kept import Kept, fingerprint
from sdnpu.errors import SdnpuError
from sdnpu.memory import check_fits
from sdnpu.onnxrun import is_ort_error, ort_message, run_onnx
from sdnpu.passes.canonical.constants import bind_input_shapes
from sdnpu.passes.htp import guards_of
from sdnpu.passes.manager import records_json
from sdnpu.passes.modelfile import load, save
from sdnpu.passes.pipeline import CompileOptions, compile_model, pass_names
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports import headroom
from sdnpu.reports import report as reports
from sdnpu.reports.fidelity import CannotFeed, fidelity, generic_inputs
from sdnpu.worker import CRASHED, KILLED, WorkerDied, run_graph_isolated, run_in_worker

log = logging.getLogger(__name__)

MODEL = "model.onnx"


def compile_standard(source: Path, out_dir: Path, info: dict[str, Any], options: CompileOptions, *,
                     outputs: list[str] | None, check: Any, drop_outputs: Any, keep: Path | None = None
                     ) -> dict[str, Any]:
    """Compile ``source`` for ``options.target`` (a standard target) into ``out_dir`` (which the caller stages).
    ``check`` (a ``FidelityCheck`` or None) runs the vendor's model against the fp32 graph; ``drop_outputs``
    removes the outputs not kept; ``keep``: where the vendor's units are kept until the compile is complete, for
    a run that stops to go on (``sdnpu.convert.kept``). Returns the report."""
    target = options.target
    name = info.get("component", source.parent.name)
    shapes = options.input_shapes
    backend = backend_of(target)
    assert backend is not None, f"target {target.name} names no backend"
    arch = backend.parse_arch(options.htp_arch, options.htp_optimization)
    feeds, reference, room, skipped = None, None, None, None
    if check is not None:  # the fp32 run first: its magnitudes say which values need a guard against fp16
        try:
            feeds = check.feeds if check.feeds is not None else generic_inputs(source, shapes=shapes or None)
        except CannotFeed as e:
            log.warning("[%s] no fidelity check: %s", name, e)
            skipped = str(e)
    if feeds is not None:
        release_memory()  # what the check's runs left in the heap, before measuring what the machine has
        check_fits(source, f"[{name}] the fp32 run for the fidelity check and fp16 headroom",
                   "--no-verify skips the fidelity run, or convert at a smaller RES")
        reference = check.reference
        with _onnxruntime_says(f"onnxruntime cannot run {source} for the fidelity check",
                               "the graph itself is what onnxruntime refuses (often an exporter bug: try the other "
                               "exporter); `--no-verify` compiles it without the check"):
            what = "the fidelity check's reference and " if reference is None else ""
            with step(log, f"[{name}] the fp32 graph on onnxruntime's CPU: {what}fp16 headroom (every tensor's "
                      "largest magnitude)"):
                before, outs = _measure(source, feeds)
            reference = reference if reference is not None else outs
        room = headroom.near_limit(before)
        risks = tuple((e["tensor"], e["max_abs"]) for e in room)
        options = dataclasses.replace(options, fp16_risks=risks)
    with step(log, f"[{name}] rewriting for {target.name} ({', '.join(pass_names(options, steps=False))})"):
        model = load(source)
        if shapes:
            bind_input_shapes(model, shapes)
        dropped = drop_outputs(model, outputs, name) if outputs is not None else []
        records = compile_model(model, options)
        guards = guards_of(dict(model.metadata_props))
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / MODEL
    with step(log, f"[{name}] writing {target.out_dir}/{MODEL} (float32, the forms {target.name} takes)"):
        save(model, out)
    del model
    release_memory()
    _validate(out, name)
    emulated = " on the HTP emulator (x86-64)" if backend.is_emulated() else ""
    gb = options.unit_gb or getattr(target, "unit_gb", None)
    compiled = _compile(out, out_dir, name, backend, arch, gb, keep)
    qnn = {**compiled.to_json(), "arch": f"v{arch.arch}", "soc_model": arch.soc_model, "chips": arch.chips,
           "optimization": arch.optimization, "context_gb": gb,
           "versions": backend.versions(), "emulated": bool(emulated)}
    if not compiled.whole:
        log.warning("[%s] QNN refused %d of %d nodes (the report names them); they run on the CPU", name,
                    qnn["trace"].get("unsupported_nodes", 0), qnn["trace"].get("total_onnx_nodes", 0))
    if feeds is not None and room:  # the values near fp16's limit, after the rewrite (one more fp32 run)
        after, _ = _measure(out, feeds)
        for e in room:
            e["after"] = after.get(e["tensor"])
            e["guard"] = guards.get(e["tensor"]) or (
                "" if e["after"] is not None else "the rewritten graph no longer computes it (a pass replaced the "
                "nodes that wrote it)")
        unguarded = [e["tensor"] for e in room if not e["guard"]]
        if unguarded:
            log.warning("[%s] %d values come within 4x of fp16's largest (65504) with no guard: %s", name,
                        len(unguarded), ", ".join(unguarded[:5]))
    extra: dict[str, Any] = {"target": target.name, "precision": options.precision, "qnn": qnn,
                             "fp16_headroom": room}
    if dropped:
        extra["dropped_outputs"] = dropped
    report = reports.build(out, source, records_json(records), {**info, **extra}, None, target)
    if feeds is not None and reference is not None:
        macs = report["summary"].get("macs_total") or 0
        slow = too_slow(backend, macs)
        if slow:
            log.warning("[%s] no fidelity run: %s", name, slow)
            skipped = slow
        else:
            with step(log, f"[{name}] running the compiled model{emulated} for the fidelity check"
                      + (" (slow: the emulator runs the NPU's program on this CPU)" if emulated else "")) as t:
                actual = run_in_worker(run_compiled, compiled.context, arch, not compiled.whole, feeds,
                                       what=f"running QNN's compile of {name}")
            fid = fidelity({k: np.asarray(v) for k, v in reference.items() if k in actual}, actual)
            given = ("the conversion's inputs" if check.feeds is not None else "the test's own inputs "
                     "(test_data_set_0)" if (source.parent / "test_data_set_0").is_dir() else "seeded inputs")
            fid["inputs"] = (f"{given}; the compiled model ran{emulated or ' on the NPU'} in {t.seconds:.1f} s"
                             + (f" (emulation time, not the NPU's: {macs / 1e9 / t.seconds:.3g} GMAC/s)"
                                if emulated else ""))
            report["fidelity"] = fid
            log.info("[%s] QNN (fp16) vs fp32: min cosine %.6f, max abs error %.3g", name, fid["min_cosine"],
                     fid["max_abs"])
            if fid["min_cosine"] < ROUNDED_INPUTS_BELOW:
                fid["input_rounding"] = _input_rounding(source, feeds, {k: np.asarray(v) for k, v in
                                                                       reference.items() if k in actual}, name)
                worst = fid["input_rounding"]["min_cosine"]
                if worst is not None and 1 - worst >= 0.5 * (1 - fid["min_cosine"]):
                    log.warning("[%s] %s", name, input_rounding_line(fid))
            bad = {k: o["reference_not_finite"] for k, o in fid["outputs"].items() if o.get("reference_not_finite")}
            if bad:
                log.warning("[%s] the fp32 graph's own outputs are not finite on the check's inputs (%s values): the "
                            "fidelity is measured over the finite ones", name,
                            ", ".join(f"{k}: {v}" for k, v in bad.items()))
    if skipped:
        report["fidelity_skipped"] = skipped
    report["peak_rss_bytes"] = peak_rss_bytes()
    trace = qnn["trace"]
    report["summary"].update(vendor_nodes=trace.get("total_onnx_nodes", 0),
                             vendor_taken=trace.get("supported_nodes", 0),
                             vendor_whole=compiled.whole)
    reports.write(out_dir, report)
    if keep is not None:  # complete: the units kept for a run that stopped go
        Kept(keep, "").drop()
    s = report["summary"]
    log.info("[%s] sdnpu's count: %d of %d nodes on %s; QNN's: %d of %d (%d QNN partitions)%s", name,
             s["offloaded_nodes"], s["total_nodes"], target.name, qnn["trace"].get("supported_nodes", 0),
             qnn["trace"].get("total_onnx_nodes", 0), qnn["trace"].get("qnn_subgraphs", 0),
             "" if compiled.whole else "; NOT taken whole")
    return report


def _compile(model: Path, out_dir: Path, name: str, backend: Any, arch: Any, gb: float | None,
             keep: Path | None) -> Any:
    """The vendor's compile of ``model`` (written in ``out_dir``): one unit, or where its weights pass ``gb``
    (what one unit holds), one per piece (``sdnpu.convert.split``), chained in one model."""
    parts, pieces, structure = compile_pieces(model, out_dir, name, backend, arch, gb, keep=keep)
    if pieces is None:
        return parts[0]
    compiled = backend.chain(parts, structure.graph, out_dir)
    for row, p in zip(compiled.pieces, pieces, strict=True):
        row.update(p.to_json())
    return compiled


def compile_pieces(model: Path, out_dir: Path, name: str, backend: Any, arch: Any, gb: float | None, *,
                   stem: str = "ctx", piece_stem: str = "ctx", keep: Path | None = None
                   ) -> tuple[list[Any], list[split.Piece] | None, Any]:
    """The vendor's compile of ``model`` into ``out_dir``: ``[<stem>]`` where it is one unit (``gb`` None, or its
    weights within ``gb``), else one unit per piece (``<piece_stem>1``, ...), in order. A unit the vendor has no
    room for (its own out-of-memory error; the compile's process killed, this machine's memory) is cut in two and
    compiled again. With ``keep`` (a folder, ``sdnpu.convert.kept``), the plan and each finished piece are kept
    there, and a run that stopped goes on after them. Returns the compiled units, the pieces (None for one unit)
    and the graph's structure (no weights, shapes inferred where it was cut)."""
    structure = onnx.load(str(model), load_external_data=False)
    def key() -> str:  # what a kept unit depends on: read only where there are units to keep or to compare
        with step(log, f"[{name}] fingerprinting {model.name} (a compile in pieces goes on where it stopped)"):
            mode = {} if arch.optimization is None else {"optimization": arch.optimization}  # QNN's default: none
            return fingerprint(model, arch=arch.arch, soc_model=arch.soc_model, unit_gb=gb, vendor=backend.versions(),
                               **mode)

    kept = Kept.open(keep, key, name)
    if len(kept.plan) > 1:  # an earlier run's pieces, as it had cut them
        structure = onnx.shape_inference.infer_shapes(structure)
        pieces = [split.piece_of(structure, a, b) for a, b in kept.plan]
    else:
        pieces = split.plan(structure, int(gb * 1e9)) if gb else []
    if len(pieces) <= 1:
        try:
            return [compile_unit(backend, model, out_dir, arch, stem, name)], None, structure
        except SdnpuError as e:
            memory = _no_room(backend, e)
            if not memory:
                raise
            log.warning("[%s] QNN's compile ran out of %s memory on the whole graph: cutting it in two", name,
                        memory)
            structure = onnx.shape_inference.infer_shapes(structure)
            pieces = _halve(structure, split.piece_of(structure, 0, len(structure.graph.node)), e, memory)
    elif not kept.plan:
        structure = onnx.shape_inference.infer_shapes(structure)  # the types of the values handed across a cut
        log.info("[%s] %.2f GB of fp16 weights: more than one QNN context holds (%.1f GB), so %d contexts, "
                 "chained in one model", name, sum(p.weight_bytes for p in pieces) / 1e9, gb, len(pieces))
    kept.replan([(p.start, p.end) for p in pieces])
    parts, done, queue = [], [], list(pieces)
    while queue:
        p = dataclasses.replace(queue.pop(0), index=len(parts))  # its QNN graph named by its place
        k = len(parts) + 1
        what = (f"{name} piece {k} of {len(parts) + len(queue) + 1} ({p.end - p.start} nodes, "
                f"{p.weight_bytes / 1e9:.2f} GB)")
        record = kept.unit(p.start, p.end)
        if record is not None:
            parts.append(_restored(backend, kept, p, out_dir))
            done.append(p)
            log.info("[%s] compiled by an earlier run (%s)", what, kept.folder)
            continue
        path = model.parent / f".{model.stem}.piece{k}.onnx"  # beside the graph: it points into its data file
        try:
            split.write_piece(structure, p, path)
            part = compile_unit(backend, path, out_dir, arch, f"{piece_stem}{k}", what)
            parts.append(part)
            done.append(p)
            kept.add(p.start, p.end, part)
        except SdnpuError as e:
            memory = _no_room(backend, e)
            if not memory:
                raise
            log.warning("[%s] QNN's compile ran out of %s memory on piece %d (%.2f GB of weights and its "
                        "activations): cutting it in two", name, memory, k, p.weight_bytes / 1e9)
            queue[:0] = _halve(structure, p, e, memory)
            kept.replan([(q.start, q.end) for q in [*done, *queue]])
        finally:
            path.unlink(missing_ok=True)
    return parts, done, structure


def _restored(backend: Any, kept: Kept, piece: split.Piece, out_dir: Path) -> Any:
    """A unit an earlier run compiled, its files linked back into ``out_dir``."""
    return backend.Compiled.from_record(kept.restore(piece.start, piece.end, out_dir), out_dir)


_HTP = "the HTP's"


def _no_room(backend: Any, e: SdnpuError) -> str:
    """Whose memory a failed compile ran out of: ``"the HTP's"`` (the vendor says so), ``"this machine's"`` (the
    compile's process killed: the kernel's out-of-memory killer), ``""`` (another failure)."""
    if getattr(backend, "OUT_OF_MEMORY", None) is not None and backend.OUT_OF_MEMORY in e.message:
        return _HTP
    return "this machine's" if isinstance(e, WorkerDied) and e.exitcode == KILLED else ""


def _halve(structure: Any, piece: split.Piece, cause: SdnpuError, memory: str) -> list[split.Piece]:
    """``piece`` in two: by its weight where the HTP had no room for it, by the activations its nodes write where
    the compile's process had none (QNN's compile grows with them)."""
    try:
        return split.halve(structure, piece, by="weight" if memory == _HTP else "activations")
    except SdnpuError as e:
        raise SdnpuError(f"{cause.message}; {e.message}", hint=cause.hint) from None


def compile_unit(backend: Any, model: Path, out_dir: Path, arch: Any, stem: str, what: str) -> Any:
    """The vendor's compile of ``model`` into ``out_dir/<stem>.onnx`` and its binary, in a worker process."""
    mode = "" if arch.optimization is None else f", optimization mode {arch.optimization}"
    with step(log, f"[{what}] QNN's compiler: HTP v{arch.arch} (soc_model {arch.soc_model}{mode}), CPU fallback off"):
        # in a process of its own: QNN's compiler takes gigabytes it keeps (8.9 GB peak on sd-turbo's UNet), and a
        # graph it cannot handle may crash it (ONNX's STFT node test: SIGSEGV), which must not take sdnpu along
        try:
            return run_in_worker(backend.compile_context, model, out_dir, arch, stem,
                                 what=f"compiling {what} with QNN's compiler")
        except WorkerDied as e:
            if e.exitcode != CRASHED:
                raise
            raise SdnpuError(f"QNN's compiler crashed on {what} (a segmentation fault in QNN's compile; nothing was "
                             "written)", hint="the graph holds something QNN cannot compile: its fp32 graph still "
                             "runs on the CPU, and `--target amd-xdna2` compiles it for AMD's NPU") from None


def _measure(path: Path, feeds: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """``headroom.measure``, in a worker process where the run is large (``sdnpu.worker.run_graph_isolated``)."""
    return run_graph_isolated(headroom.measure, path, feeds, what=f"running {path.name} in fp32")


ROUNDED_INPUTS_BELOW = 0.999  # a compiled model below this cosine is looked at for its inputs' fp16 rounding


def _input_rounding(source: Path, feeds: dict[str, np.ndarray], reference: dict[str, np.ndarray], name: str
                    ) -> dict[str, Any]:
    """The fp32 graph on its float inputs rounded to fp16, as the HTP takes a float32 input (measured: 0.6 + 3e-5
    arrives as 0.6), one input at a time, the others exact: each one's min cosine against ``reference``, and the
    lowest. A graph that multiplies an input up (Stable Cascade's ``timestep_ratio`` times 10000 before its
    sinusoid) loses there what no rewrite inside the graph can give back."""
    rounded: dict[str, float] = {}
    for k, v in feeds.items():
        if v.dtype.kind != "f" or np.array_equal(v.astype(np.float16).astype(v.dtype), v):
            continue
        with step(log, f"[{name}] the fp32 graph with {k} rounded to fp16 (why the cosine is low)"):
            got = run_graph_isolated(run_onnx, source, {**feeds, k: v.astype(np.float16).astype(v.dtype)},
                                     what=f"running {source.name} on {k} rounded to fp16")
        rounded[k] = fidelity(reference, {o: got[o] for o in reference})["min_cosine"]
    return {"inputs": rounded, "min_cosine": min(rounded.values()) if rounded else None,
            "worst": min(rounded, key=rounded.__getitem__) if rounded else None}


def input_rounding_line(fid: dict[str, Any]) -> str:
    """The line that says a low cosine is the inputs' fp16 rounding (``fid["input_rounding"]``)."""
    r = fid["input_rounding"]
    return (f"cosine {fid['min_cosine']:.6f} against fp32, where the fp32 graph itself on {r['worst']} rounded to "
            f"fp16 (as the HTP takes a float32 input) keeps {r['min_cosine']:.6f}: the loss is the input's "
            "rounding, which no rewrite inside the graph can undo")


def too_slow(backend: Any, macs: int) -> str:
    """Why the compiled model is not run for the fidelity check ("" where it is): on an emulator, the time it
    would take (``backend.too_slow_to_emulate``); on the NPU itself, never."""
    return backend.too_slow_to_emulate(macs) if backend.is_emulated() else ""


def run_compiled(context: Path, arch: Any, fallback: bool, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """(In a worker.) The compiled EPContext model on ``feeds`` (those it takes), its outputs by name."""
    # the qnn-htp backend where its target runs (onnxruntime with it): the CLI starts without them (25-45 ms)
    from sdnpu.backends import qnn_htp

    with _onnxruntime_says(f"onnxruntime-qnn cannot run QNN's compile {context}",
                           "this is worth reporting with the model; `--no-verify` writes the context without "
                           "running it"):
        sess = qnn_htp.session(context, qnn_htp.HtpOptions(arch, fallback=fallback))
        wanted = [o.name for o in sess.get_outputs()]
        inputs = {i.name for i in sess.get_inputs()}
        return dict(zip(wanted, sess.run(wanted, {k: v for k, v in feeds.items() if k in inputs}), strict=True))


@contextlib.contextmanager
def _onnxruntime_says(what: str, hint: str) -> Iterator[None]:
    """onnxruntime's (or QNN's) own errors inside as one line: ``what``, then its words."""
    try:
        yield
    except SdnpuError:
        raise
    except Exception as e:
        if not is_ort_error(e):
            raise
        raise SdnpuError(f"{what}: {ort_message(e)}", hint=hint) from None


def _validate(path: Path, name: str) -> None:
    with step(log, f"[{name}] validating {path.name} (onnx.checker, full check)"):
        try:
            onnx.checker.check_model(str(path), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
            raise SdnpuError(f"the rewritten graph {path} is not valid ONNX: {str(e)[:600]}",
                             hint="this is a compiler bug worth reporting with the model") from e
