"""``convert()``: resolve the source, then export and check each component into ``OUT/<component>/``.

Each component folder is built complete in a staging folder and swapped into place only when export and
check both succeeded (``sdnpu.fileio.staged_dir``), so a failed or interrupted run leaves the previous
output as it was. One module is in memory at a time (the VAE once for encoder and decoder), and the torch
module is dropped before onnxruntime loads the graph: at full SDXL size the two would not fit together.
"""

from __future__ import annotations

import logging
import platform
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sdnpu import __version__
from sdnpu.convert.components import (
    Signature,
    build_wrapper,
    resolution_step,
    sample_inputs,
    signature,
    vae_scale_factor,
)
from sdnpu.convert.export import (
    CHECK_RTOL,
    DEFAULT_OPSET,
    EXPORTERS,
    MIN_OPSET,
    export_module,
    torch_outputs,
)
from sdnpu.convert.compile import OUTPUT_CHOICES, run_onnx
from sdnpu.convert.sources import COMPONENT_MODULES, COMPONENTS, Source, resolve_source
from sdnpu.errors import SdnpuError, storage_error
from sdnpu.ops.target import DEFAULT_TARGET
from sdnpu.passes.pipeline import CompileOptions
from sdnpu.fileio import atomic_write_json, recover_staging, staged_dir
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports.fidelity import fidelity

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"


@dataclass
class ComponentResult:
    component: str
    path: Path
    nodes: int
    parameters: int
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: int = 0
    check: dict[str, Any] | None = None  # worst errors and per-output errors vs PyTorch
    report: dict[str, Any] | None = None  # the offload report's summary, when compiled

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


@dataclass
class ConvertResult:
    source: Source
    out: Path
    resolution: int
    components: list[ComponentResult]
    pipeline_files: list[str]


def parse_components(spec: str | Sequence[str], source: Source) -> list[str]:
    """``"all"``, one name, a comma-separated list or a sequence -> components in canonical order."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec) if s.strip()]
    if not names:
        raise SdnpuError("no component given", hint=f"choose from: {', '.join(COMPONENTS)}, all")
    if "all" in names:
        if not source.components:
            raise SdnpuError(f"{source.root} provides no component that sdnpu can export")
        return source.components
    unknown = [n for n in names if n not in COMPONENTS]
    if unknown:
        raise SdnpuError(f"unknown component {unknown[0]!r}", hint=f"valid components: {', '.join(COMPONENTS)}, all")
    for name in names:
        source.module_dir(name)  # names a component that this source lacks
    return [c for c in COMPONENTS if c in names]


def default_resolution(source: Source) -> int:
    """The resolution the source was trained at: the UNet's sample size in pixels (1024 for SDXL)."""
    vae_cfg = source.module_config("vae_decoder") if "vae" in source.modules else None
    factor = vae_scale_factor(vae_cfg)
    if "unet" in source.modules:
        return int(source.module_config("unet")["sample_size"]) * factor
    if vae_cfg is not None:
        return int(vae_cfg["sample_size"])
    return 1024


def _check_resolution(source: Source, components: list[str], res: int, factor: int) -> None:
    for comp in components:
        if comp.startswith("text_encoder"):
            continue
        multiple = resolution_step(comp, source.module_config(comp), factor)
        if res <= 0 or res % multiple:
            raise SdnpuError(f"resolution {res} does not fit the {comp}",
                             hint=f"RES must be a positive multiple of {multiple} for this model")


def convert(
    source: str | Path,
    components: str | Sequence[str] = "all",
    out: str | Path | None = None,
    res: int | None = None,
    exporter: str = "dynamo",
    opset: int = DEFAULT_OPSET,
    check: bool = True,
    compile: bool = True,
    precision: str = "bf16",
    outputs: str = "pipeline",
    target: str = DEFAULT_TARGET,
) -> ConvertResult:
    """Export ``components`` of ``source`` to ``out`` (default ``models/<source name>``) and, unless
    ``compile=False``, compile each into ``<component>/dd/`` (dispatch model and offload report).
    ``outputs``: "pipeline" (the dispatch models keep what a diffusers pipeline reads) or "all";
    ``target``: the NPU whose op contract the dispatch models are written in."""
    if exporter not in EXPORTERS:
        raise SdnpuError(f"unknown exporter {exporter!r}", hint=f"choose one of: {', '.join(EXPORTERS)}")
    if opset < MIN_OPSET:
        raise SdnpuError(f"opset {opset} is too old", hint=f"use opset {MIN_OPSET} or newer")
    options = CompileOptions.named(target, precision)
    if outputs not in OUTPUT_CHOICES:
        raise SdnpuError(f"unknown --outputs {outputs!r}", hint=f"choose one of: {', '.join(OUTPUT_CHOICES)}")
    src = resolve_source(source)
    comps = parse_components(components, src)
    vae_cfg = src.module_config("vae_decoder") if "vae" in src.modules else None
    factor = vae_scale_factor(vae_cfg)
    res = default_resolution(src) if res is None else int(res)
    _check_resolution(src, comps, res, factor)
    out_dir = Path(out) if out is not None else Path("models") / src.name
    out_dir.mkdir(parents=True, exist_ok=True)
    recover_staging(out_dir)
    try:  # a read-only or forbidden --out fails now, not after loading the module
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(out_dir)) from e
    log.info("converting %s (%s: %s) -> %s at %d px: %s", src.name, src.kind, src.root, out_dir, res,
             ", ".join(comps))

    fingerprint = src.fingerprint()
    results: list[ComponentResult] = []
    cached: tuple[str, Any] | None = None
    for i, comp in enumerate(comps):
        key = COMPONENT_MODULES[comp]
        isolate = module_bytes(src, key) > ISOLATE_BYTES
        holder: list[Any] = []
        if not isolate:
            if cached is None or cached[0] != key:
                cached = None
                release_memory()
                cached = (key, _load(src, comp, key))
            holder.append(cached[1])  # the torch stage takes it out, so it holds the last reference
            cached = (key, (cached[1][0], 0.0))  # a second component of the same module loaded nothing
            if not (i + 1 < len(comps) and COMPONENT_MODULES[comps[i + 1]] == key):
                cached = None
        with staged_dir(out_dir / comp) as stage:
            job = _TorchJob(comp, key, str(stage / MODEL_FILE), res, factor, exporter, opset, check)
            torch_stage = _torch_stage_in_child(src, job) if isolate else _torch_stage(src, job, holder)
            release_memory()  # the torch weights go before onnxruntime loads the graph's copy
            result = _export_component(src, comp, torch_stage, stage, res, factor, exporter, opset, check,
                                       fingerprint, compile, options, outputs)
        result.path = out_dir / comp / MODEL_FILE
        results.append(result)
    written = src.write_pipeline_files(out_dir)
    return ConvertResult(source=src, out=out_dir, resolution=res, components=results, pipeline_files=written)


# Modules above this many bytes of fp32 weights are exported in a child process: torch 2.13's exporter
# keeps tensors alive after it returns (held outside Python's reach), and at full SDXL size that is 10 GB
# sitting beside onnxruntime's copy during the check. A process that exits gives everything back.
ISOLATE_BYTES = 1 << 30


def module_bytes(src: Source, key: str) -> int:
    """fp32 weight bytes of module ``key``: counted on the meta device for presets, from the weight files'
    sizes for folders (fp16 files count twice)."""
    if src.kind == "preset":
        import torch

        with torch.device("meta"):
            module = src.load_module(key)
        return 4 * sum(p.numel() for p in module.parameters())
    total = 0
    for f in src.modules[key].iterdir():
        if f.suffix in (".safetensors", ".bin"):
            total += f.stat().st_size * (2 if ".fp16." in f.name else 1)
    return total


def _load(src: Source, comp: str, key: str) -> tuple[Any, float]:
    """The module and the seconds it took to load (for export.json)."""
    what = "drawing seeded weights for" if src.kind == "preset" else "loading"
    with step(log, f"[{comp}] {what} {src.classes[key]} ({src.name})") as t:
        module = src.load_module(key)
    return module, t.seconds


@dataclass(frozen=True)
class _TorchJob:
    component: str
    key: str
    path: str
    res: int
    factor: int
    exporter: str
    opset: int
    check: bool


@dataclass
class _TorchStage:
    """What the torch side hands over: PyTorch's outputs on the seeded inputs, the size, the times."""

    reference: list[Any] | None
    parameters: int
    seconds: dict[str, float]
    peak_rss_bytes: int  # of the process that ran it


def _torch_stage(src: Source, job: _TorchJob, holder: list[Any]) -> _TorchStage:
    """Load (unless ``holder`` has the module), run PyTorch on the seeded inputs, export. Every torch
    object lives and dies in here."""
    comp = job.component
    module, load_s = holder.pop() if holder else _load(src, comp, job.key)
    seconds = {"load": round(load_s, 2)}
    config = src.module_config(comp)
    sig = signature(comp, config, job.res, job.factor)
    wrapper = build_wrapper(comp, module, config)
    del module
    n_params = sum(p.numel() for p in wrapper.parameters())
    feeds = sample_inputs(sig, config, job.res)
    reference = None
    if job.check:
        with step(log, f"[{comp}] running PyTorch on seeded inputs") as t:
            reference = torch_outputs(wrapper, feeds)
        seconds["torch_run"] = round(t.seconds, 2)
    with step(log, f"[{comp}] exporting with torch's {job.exporter} exporter (opset {job.opset})") as t:
        try:
            export_module(wrapper, tuple(_as_torch(feeds)), [s.name for s in sig.inputs], list(sig.outputs),
                          Path(job.path), exporter=job.exporter, opset=job.opset)
        except SdnpuError:
            raise
        except Exception as e:  # the exporters raise many types; name the component and the exporter
            if isinstance(e, OSError) and (err := storage_error(e)) is not None:
                raise err from e  # a full or read-only disk while saving is not the exporter's fault
            raise SdnpuError(f"torch's {job.exporter} exporter failed on {comp}: {type(e).__name__}: {e}",
                             hint="try --exporter torchscript" if job.exporter == "dynamo" else None) from e
    seconds["export"] = round(t.seconds, 2)
    return _TorchStage(reference, n_params, seconds, peak_rss_bytes())


def _torch_stage_in_child(src: Source, job: _TorchJob) -> _TorchStage:
    """``_torch_stage`` in a spawned process; its result (small: PyTorch's outputs) comes back by pipe."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    source = src.name if src.kind == "preset" else str(src.root)
    proc = ctx.Process(target=_child_main, args=(sender, source, job, logging.getLogger("sdnpu").getEffectiveLevel()),
                       name=f"sdnpu-export-{job.component}")
    log.info("[%s] exporting in a worker process (%s)", job.component, "weights above 1 GiB")
    proc.start()
    sender.close()
    try:
        kind, payload = receiver.recv()
    except EOFError:
        kind, payload = "died", None
    finally:
        proc.join()
    if kind == "ok":
        return payload  # type: ignore[no-any-return]
    if kind == "error":
        raise SdnpuError(*payload)
    if kind == "crash":
        raise SdnpuError(f"exporting {job.component} failed: {payload}")
    raise SdnpuError(f"the export worker for {job.component} died (exit code {proc.exitcode})",
                     hint="a negative code is the signal that killed it; -9 is often the kernel's "
                     "out-of-memory killer: close other large jobs and retry")


def _child_main(conn: Any, source: str, job: _TorchJob, level: int) -> None:
    import ctypes
    import signal
    import traceback
    import warnings

    try:  # die with the parent (Ctrl-C, SIGKILL): no orphan keeps exporting into a staging folder
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("sdnpu").setLevel(level)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    try:
        conn.send(("ok", _torch_stage(resolve_source(source), job, [])))
    except SdnpuError as e:
        conn.send(("error", (e.message, e.hint)))
    except BaseException as e:  # a bug: send the traceback, the parent names the component
        conn.send(("crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _export_component(src: Source, comp: str, torch_stage: _TorchStage, stage: Path, res: int, factor: int,
                      exporter: str, opset: int, check: bool, fingerprint: str, compile: bool,
                      options: CompileOptions, outputs: str) -> ComponentResult:
    import onnx

    config = src.module_config(comp)
    sig: Signature = signature(comp, config, res, factor)
    feeds = sample_inputs(sig, config, res)
    path = stage / MODEL_FILE
    seconds = dict(torch_stage.seconds)
    reference = torch_stage.reference
    n_params = torch_stage.parameters

    with step(log, f"[{comp}] validating the graph (onnx.checker, full check)") as t:
        onnx.checker.check_model(str(path), full_check=True)
    seconds["onnx_check"] = round(t.seconds, 2)

    graph = onnx.load(str(path), load_external_data=False)
    check_data = None
    actual = None
    if check and reference is not None:
        with step(log, f"[{comp}] running the graph in onnxruntime") as t:
            actual = run_onnx(path, feeds, optimize=True)
        seconds["onnx_run"] = round(t.seconds, 2)
        check_data = _check_outputs(comp, sig, reference, actual)
    summary = None
    if compile:
        from sdnpu.convert.compile import compile_into, keep_outputs

        keep = keep_outputs(outputs, list(sig.outputs), comp, config, "text_encoder_2" in src.modules)
        info = {"component": comp, "source": {"name": src.name, "kind": src.kind, "fingerprint": fingerprint},
                "resolution": res}
        fp32 = actual
        with step(log, f"[{comp}] compile stage") as t:
            summary = compile_into(path, stage / "dd", info, feeds, fp32, verify=check,
                                   options=options, outputs=keep)["summary"]
        seconds["compile"] = round(t.seconds, 2)

    result = ComponentResult(component=comp, path=path, nodes=len(graph.graph.node), parameters=n_params,
                             seconds=seconds, peak_rss_bytes=max(peak_rss_bytes(), torch_stage.peak_rss_bytes),
                             check=check_data, report=summary)
    src_config = src.module_dir(comp) / "config.json"
    (stage / "config.json").write_bytes(src_config.read_bytes())
    atomic_write_json(stage / "export.json", {
        "component": comp,
        "source": {"name": src.name, "kind": src.kind, "path": str(src.root), "fingerprint": fingerprint},
        "module_class": src.classes[COMPONENT_MODULES[comp]],
        "exporter": exporter,
        "opset": opset,
        "resolution": res,
        "inputs": [s.to_json() for s in sig.inputs],
        "outputs": list(sig.outputs),
        "nodes": result.nodes,
        "parameters": n_params,
        "check": check_data,
        "seconds": seconds,
        "peak_rss_bytes": result.peak_rss_bytes,
        "tool": {"sdnpu": __version__, "python": platform.python_version(), **_versions()},
    })
    return result


def _check_outputs(comp: str, sig: Signature, reference: list[Any], actual: dict[str, Any]) -> dict[str, Any]:
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


def _as_torch(feeds: dict[str, Any]) -> list[Any]:
    import torch

    return [torch.from_numpy(v) for v in feeds.values()]


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import torch

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
