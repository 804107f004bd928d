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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sdnpu import __version__
from sdnpu.convert.components import build_wrapper
from sdnpu.convert.export import (
    CHECK_RTOL,
    DEFAULT_OPSET,
    EXPORTERS,
    MIN_OPSET,
    export_module,
    torch_outputs,
)
from sdnpu.convert.compile import OUTPUT_CHOICES, run_onnx
from sdnpu.convert.parameters import FILE as PARAMETERS_FILE
from sdnpu.convert.parameters import map_parameters
from sdnpu.convert.sources import COMPONENT_MODULES, COMPONENTS, Source, resolve_source
from sdnpu.errors import SdnpuError, storage_error
from sdnpu.ops.target import DEFAULT_TARGET
from sdnpu.fileio import atomic_write_json, recover_staging, staged_dir
from sdnpu.lora.adapters import COMPONENTS as LORA_COMPONENTS
from sdnpu.lora.adapters import LoraFile, LoraSpec, fuse_into, read_lora
from sdnpu.memory import check_fits
from sdnpu.passes.pipeline import CompileOptions
from sdnpu.pipelines import Signature, Size, check_resolution, sample_inputs, signature, vae_scale_factor
from sdnpu.pipelines import default_resolution as resolution_rule
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.reports.fidelity import fidelity
from sdnpu.worker import run_in_worker

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class ConvertOptions:
    """How ``convert`` exports, checks and compiles; validated once, when made (a bad value is an
    SdnpuError naming the choices before anything is loaded).

    ``res``: the image size (a ``Size``, a side for a square, or "WxH"; None: the model's own); ``check``:
    run the exported graph against PyTorch and the dispatch model against the graph; ``compile``: write
    ``<component>/dd/``; ``outputs``: "pipeline" (the dispatch models keep what a diffusers pipeline reads)
    or "all"; ``target``: the NPU whose op contract the dispatch models are written in; ``precision``: bf16
    or bfp16; ``loras``: LoRAs fused into the UNet and text encoders before export."""

    res: Size | int | str | None = None
    exporter: str = "dynamo"
    opset: int = DEFAULT_OPSET
    check: bool = True
    compile: bool = True
    outputs: str = "pipeline"
    target: str = DEFAULT_TARGET
    precision: str = "bf16"
    loras: tuple[LoraSpec, ...] = ()  # diffusers' fuse_lora, before export

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise SdnpuError(f"unknown exporter {self.exporter!r}", hint=f"choose one of: {', '.join(EXPORTERS)}")
        if self.opset < MIN_OPSET:
            raise SdnpuError(f"opset {self.opset} is too old", hint=f"use opset {MIN_OPSET} or newer")
        if self.outputs not in OUTPUT_CHOICES:
            raise SdnpuError(f"unknown --outputs {self.outputs!r}", hint=f"choose one of: {', '.join(OUTPUT_CHOICES)}")
        if self.res is not None:
            object.__setattr__(self, "res", Size.of(self.res))
        if self.res is not None and min(self.res) <= 0:
            raise SdnpuError(f"size {self.res} is not a positive number of pixels",
                             hint="RES is WxH in pixels (1152x896), or one number for a square (1024)")
        self.compile_options  # noqa: B018 -- validates target and precision
        object.__setattr__(self, "loras", tuple(LoraSpec.parse(x) if isinstance(x, str) else x for x in self.loras))

    @property
    def compile_options(self) -> CompileOptions:
        return CompileOptions.named(self.target, self.precision)


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
    resolution: Size
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
    """The resolution ``source`` was trained at (``sdnpu.pipelines.default_resolution``: 1024 for SDXL)."""
    return resolution_rule(source.module_config("unet") if "unet" in source.modules else None, _vae_config(source))


def _vae_config(source: Source) -> dict[str, Any] | None:
    return source.module_config("vae_decoder") if "vae" in source.modules else None


def convert(source: str | Path, components: str | Sequence[str] = "all", out: str | Path | None = None,
            options: ConvertOptions | None = None, **settings: Any) -> ConvertResult:
    """Export ``components`` of ``source`` to ``out`` (default ``models/<source name>``) and, unless
    ``options.compile`` is off, compile each into ``<component>/dd/`` (dispatch model and offload report).
    ``settings`` are ``ConvertOptions`` fields, applied over ``options``: ``convert("tiny-sdxl", res=256)``."""
    options = replace(options, **settings) if options is not None else ConvertOptions(**settings)
    src = resolve_source(source)
    comps = parse_components(components, src)
    factor = vae_scale_factor(_vae_config(src))
    res = Size.of(default_resolution(src)) if options.res is None else Size.of(options.res)
    check_resolution(res, {c: src.module_config(c) for c in comps}, factor)
    out_dir = Path(out) if out is not None else Path("models") / src.name
    out_dir.mkdir(parents=True, exist_ok=True)
    recover_staging(out_dir)
    try:  # a read-only or forbidden --out fails now, not after loading the module
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(out_dir)) from e
    log.info("converting %s (%s: %s) -> %s at %s px: %s", src.name, src.kind, src.root, out_dir, res,
             ", ".join(comps))

    fingerprint = src.fingerprint()
    if options.loras:  # a bad LoRA file fails now, before any export
        _read_loras(src, options.loras)
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
        job = _Job(comp, key, res, factor, options)
        with staged_dir(out_dir / comp) as stage:
            path = str(stage / MODEL_FILE)
            torch_stage = _torch_stage_in_child(src, job, path) if isolate else _torch_stage(src, job, path, holder)
            release_memory()  # the torch weights go before onnxruntime loads the graph's copy
            result = _export_component(src, job, torch_stage, stage, fingerprint)
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
class _Job:
    """One component's conversion, as both stages read it (the torch stage perhaps in a worker process)."""

    component: str
    key: str  # its diffusers module ("vae" for both VAE halves)
    res: Size
    factor: int  # the VAE's scale factor
    options: ConvertOptions

    def signature(self, config: dict[str, Any]) -> Signature:
        return signature(self.component, config, self.res, self.factor)


@dataclass
class _TorchStage:
    """What the torch side hands over: PyTorch's outputs on the seeded inputs, the size, the times."""

    reference: list[Any] | None
    parameters: int
    seconds: dict[str, float]
    peak_rss_bytes: int  # of the process that ran it
    sources: dict[str, Any]  # parameters.json: the parameter each constant of the graph holds
    lora: dict[str, Any] | None = None  # the LoRAs fused before export


def _read_loras(src: Source, specs: Sequence[LoraSpec]) -> list[LoraFile]:
    unet_config = src.module_config("unet") if "unet" in src.modules else None
    return [read_lora(spec, "text_encoder_2" in src.modules, unet_config) for spec in specs]


def _fuse_loras(src: Source, job: _Job, module: Any) -> dict[str, Any] | None:
    """``sdnpu convert --lora``: the LoRAs fused into ``module`` by diffusers; what export.json records."""
    if not job.options.loras or job.component not in LORA_COMPONENTS:
        return None
    loras = _read_loras(src, job.options.loras)
    with step(log, f"[{job.component}] fusing {len(loras)} LoRA(s) into the module (diffusers' fuse_lora)"):
        modules = fuse_into(module, job.component, loras, "text_encoder_2" in src.modules)
    return {"fused": [lora.describe() for lora in loras], "modules": modules}


def _torch_stage(src: Source, job: _Job, path: str, holder: list[Any]) -> _TorchStage:
    """Load (unless ``holder`` has the module), run PyTorch on the seeded inputs, export. Every torch
    object lives and dies in here."""
    comp = job.component
    module, load_s = holder.pop() if holder else _load(src, comp, job.key)
    seconds = {"load": round(load_s, 2)}
    lora = _fuse_loras(src, job, module)
    config = src.module_config(comp)
    sig = job.signature(config)
    wrapper = build_wrapper(comp, module, config)
    del module
    n_params = sum(p.numel() for p in wrapper.parameters())
    feeds = sample_inputs(sig, config, job.res)
    reference = None
    exporter, opset = job.options.exporter, job.options.opset
    if job.options.check:
        with step(log, f"[{comp}] running PyTorch on seeded inputs") as t:
            reference = torch_outputs(wrapper, feeds)
        seconds["torch_run"] = round(t.seconds, 2)
    with step(log, f"[{comp}] exporting with torch's {exporter} exporter (opset {opset})") as t:
        try:
            export_module(wrapper, tuple(_as_torch(feeds)), [s.name for s in sig.inputs], list(sig.outputs),
                          Path(path), exporter=exporter, opset=opset)
        except SdnpuError:
            raise
        except Exception as e:  # the exporters raise many types; name the component and the exporter
            if isinstance(e, OSError) and (err := storage_error(e)) is not None:
                raise err from e  # a full or read-only disk while saving is not the exporter's fault
            raise SdnpuError(f"torch's {exporter} exporter failed on {comp}: {type(e).__name__}: {e}",
                             hint="try --exporter torchscript" if exporter == "dynamo" else None) from e
    seconds["export"] = round(t.seconds, 2)
    with step(log, f"[{comp}] matching the graph's constants to the module's parameters") as t:
        sources = map_parameters(wrapper, Path(path))
    seconds["parameters"] = round(t.seconds, 2)
    log.info("[%s] %d of the graph's constants are module parameters (%d ambiguous)", comp,
             len(sources["initializers"]), sources["ambiguous"])
    return _TorchStage(reference, n_params, seconds, peak_rss_bytes(), sources, lora)


def _torch_stage_in_child(src: Source, job: _Job, path: str) -> _TorchStage:
    """``_torch_stage`` in a worker process (``sdnpu.worker``); its result (small: PyTorch's outputs) comes
    back by pipe."""
    log.info("[%s] exporting in a worker process (%s)", job.component, "weights above 1 GiB")
    source = src.name if src.kind == "preset" else str(src.root)
    return run_in_worker(_torch_stage_from, source, job, path, what=f"exporting {job.component}")


def _torch_stage_from(source: str, job: _Job, path: str) -> _TorchStage:
    return _torch_stage(resolve_source(source), job, path, [])


def _export_component(src: Source, job: _Job, torch_stage: _TorchStage, stage: Path,
                      fingerprint: str) -> ComponentResult:
    import onnx

    comp, res, options = job.component, job.res, job.options
    config = src.module_config(comp)
    sig = job.signature(config)
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
    if options.check and reference is not None:
        check_fits(path, f"[{comp}] running the exported graph in onnxruntime (the check against PyTorch)",
                   hint=f"--no-check skips the check, or convert at a smaller RES (now {res})")
        with step(log, f"[{comp}] running the graph in onnxruntime") as t:
            actual = run_onnx(path, feeds, optimize=True)
        seconds["onnx_run"] = round(t.seconds, 2)
        check_data = _check_outputs(comp, sig, reference, actual)
    summary = None
    if options.compile:
        from sdnpu.convert.compile import FidelityCheck, compile_into, keep_outputs

        keep = keep_outputs(options.outputs, list(sig.outputs), comp, config, "text_encoder_2" in src.modules)
        info = {"component": comp, "source": {"name": src.name, "kind": src.kind, "fingerprint": fingerprint},
                **_resolution(res)}
        if torch_stage.lora:
            info["lora_fused"] = torch_stage.lora
        check = FidelityCheck(feeds, reference=actual) if options.check else None
        with step(log, f"[{comp}] compile stage") as t:
            summary = compile_into(path, stage / "dd", info, options.compile_options, outputs=keep,
                                   check=check)["summary"]
        seconds["compile"] = round(t.seconds, 2)

    result = ComponentResult(component=comp, path=path, nodes=len(graph.graph.node), parameters=n_params,
                             seconds=seconds, peak_rss_bytes=max(peak_rss_bytes(), torch_stage.peak_rss_bytes),
                             check=check_data, report=summary)
    src_config = src.module_dir(comp) / "config.json"
    (stage / "config.json").write_bytes(src_config.read_bytes())
    atomic_write_json(stage / PARAMETERS_FILE, torch_stage.sources)
    atomic_write_json(stage / "export.json", {
        "component": comp,
        "source": {"name": src.name, "kind": src.kind, "path": str(src.root), "fingerprint": fingerprint},
        "module_class": src.classes[COMPONENT_MODULES[comp]],
        "exporter": options.exporter,
        "opset": options.opset,
        **_resolution(res),
        "inputs": [s.to_json() for s in sig.inputs],
        "outputs": list(sig.outputs),
        "nodes": result.nodes,
        "parameters": n_params,
        "check": check_data,
        "lora_fused": torch_stage.lora,
        "seconds": seconds,
        "peak_rss_bytes": result.peak_rss_bytes,
        "tool": {"sdnpu": __version__, "python": platform.python_version(), **_versions()},
    })
    return result


def _resolution(res: Size) -> dict[str, Any]:
    """How export.json and the report name the size: ``resolution`` the side of a square (None otherwise, as
    before non-square sizes), ``size`` always."""
    return {"resolution": res.width if res.square else None, "size": res.to_json()}


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
