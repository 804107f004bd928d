"""``convert()``: resolve the source, then export and check each component into ``OUT/<component>/``.

Each component folder is built complete in a staging folder and swapped into place only when export and
check both succeeded (``sdnpu.fileio.staged_dir``), so a failed or interrupted run leaves the previous
output as it was. One module is in memory at a time (the VAE once for encoder and decoder), and the torch
module is dropped before onnxruntime loads the graph: at full SDXL size the two would not fit together.
"""

from __future__ import annotations

import dataclasses
import logging
import platform
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sdnpu import __version__
from sdnpu.convert import blockwise, shared
from sdnpu.convert.export import (
    CHECK_RTOL,
    DEFAULT_OPSET,
    EXPORTERS,
    MIN_OPSET,
    export_module,
    torch_outputs,
)
from sdnpu.convert.compile import OUTPUT_CHOICES, run_onnx
from sdnpu.formats.parameters import FILE as PARAMETERS_FILE
from sdnpu.convert.parameters import map_parameters
from sdnpu.components import COMPONENTS, LORA_COMPONENTS, SIZED, module_of
from sdnpu.convert.sources import Source, resolve_source
from sdnpu.errors import SdnpuError, storage_error
from sdnpu.formats import prologue
from sdnpu.ops.target import DEFAULT_TARGET
from sdnpu.fileio import atomic_write_bytes, atomic_write_json, recover_staging, staged_dir
from sdnpu.lora.adapters import LoraFile, LoraSpec, fuse_into, read_lora
from sdnpu.memory import available_bytes, check_fits
from sdnpu.passes.pipeline import CompileOptions
from sdnpu.imagesize import Size, parse_sizes
from sdnpu.signatures import Signature, sample_inputs, signature, unet_text_time, vae_scale_factor
from sdnpu.specs import check_resolution, handoff_values, prologue_inputs
from sdnpu.specs import default_resolution as resolution_rule
from sdnpu.progress import peak_rss_bytes, release_memory, step
from sdnpu.formats.sizes import SizeFiles, read_manifest, sizes_of, write_manifest
from sdnpu.reports.fidelity import fidelity
from sdnpu.worker import run_in_worker

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class ConvertOptions:
    """How ``convert`` exports, checks and compiles; validated once, when made (a bad value is an
    SdnpuError naming the choices before anything is loaded).

    ``res``: the image sizes (``parse_sizes``: a ``Size``, a side, "WxH", a comma-separated list or
    "sdxl-buckets"; None: the model's own), the first the primary (see ``sdnpu.convert.shared``); ``add``:
    add the sizes to the conversion already in OUT, writing only theirs; ``check``:
    run the exported graph against PyTorch and the dispatch model against the graph; ``compile``: write
    ``<component>/dd/``; ``outputs``: "pipeline" (the dispatch models keep what a diffusers pipeline reads)
    or "all"; ``target``: the NPU whose op contract the dispatch models are written in; ``precision``: bf16
    or bfp16; ``loras``: LoRAs fused into the UNet and text encoders before export."""

    res: Size | int | str | Sequence[Size | int | str] | None = None
    exporter: str = "dynamo"
    opset: int = DEFAULT_OPSET
    check: bool = True
    compile: bool = True
    outputs: str = "pipeline"
    target: str = DEFAULT_TARGET
    precision: str = "bf16"
    loras: tuple[LoraSpec, ...] = ()  # diffusers' fuse_lora, before export
    add: bool = False
    blockwise: bool = False  # T5 block by block even where it fits whole (it does where it does not)

    def __post_init__(self) -> None:
        if self.exporter not in EXPORTERS:
            raise SdnpuError(f"unknown exporter {self.exporter!r}", hint=f"choose one of: {', '.join(EXPORTERS)}")
        if self.opset < MIN_OPSET:
            raise SdnpuError(f"opset {self.opset} is too old", hint=f"use opset {MIN_OPSET} or newer")
        if self.outputs not in OUTPUT_CHOICES:
            raise SdnpuError(f"unknown --outputs {self.outputs!r}", hint=f"choose one of: {', '.join(OUTPUT_CHOICES)}")
        if self.res is not None:
            object.__setattr__(self, "res", tuple(parse_sizes(self.res)))  # type: ignore[arg-type]
            for size in self.res:  # type: ignore[union-attr]
                if min(size) <= 0:
                    raise SdnpuError(f"size {size} is not a positive number of pixels",
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
    size: str = ""  # WxH

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


@dataclass
class ConvertResult:
    source: Source
    out: Path
    resolution: Size  # the primary size
    components: list[ComponentResult]
    pipeline_files: list[str]
    sizes: list[Size] = field(default_factory=list)  # every size converted (or, with --add, added)


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
    """The resolution ``source`` was trained at (``sdnpu.pipelines.default_resolution``: 1024 for SDXL; a
    ControlNet alone: 1024 for SDXL's, 512 for SD 1.x's)."""
    if "unet" not in source.modules and "controlnet" in source.modules:
        return 1024 if unet_text_time(source.module_config("controlnet")) else 512
    denoiser = next((c for c in ("unet", "transformer") if c in source.modules), None)
    return resolution_rule(source.module_config(denoiser) if denoiser else None, _vae_config(source))


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
    sizes = list(options.res or [Size.of(default_resolution(src))])  # type: ignore[arg-type]
    configs = {c: src.module_config(c) for c in comps}
    for size in sizes:
        check_resolution(size, configs, factor)
    res = sizes[0]
    if options.loras and "transformer" in src.modules:
        raise SdnpuError(f"{src.name} is an SD3 pipeline: sdnpu fuses LoRAs into UNets and CLIP encoders (SDXL, "
                         "SD 1.x) only", hint="convert it without --lora")
    weights = {key: module_bytes(src, key) for key in dict.fromkeys(module_of(c) for c in comps)}
    by_block: set[str] = set()
    for key, need in weights.items():  # one that cannot fit: before anything is written
        if blockwise.supports(src, key) and (options.blockwise or not _fits(need, BLOCKWISE_SHARE)):
            by_block.add(key)
            log.info("%s: %s of fp32 weights; converting it block by block", key, _human(need))
            continue
        _check_module_fits(key, need, comps)
    if options.blockwise and not by_block:
        log.warning("--blockwise: none of %s converts block by block (only %s do); converting them whole",
                    ", ".join(comps), ", ".join(blockwise.CLASSES))
    out_dir = Path(out) if out is not None else Path("models") / src.name
    if options.add and not out_dir.is_dir():
        raise SdnpuError(f"--add: {out_dir} holds no conversion to add sizes to",
                         hint="convert it first without --add (the first size given is the primary)")
    out_dir.mkdir(parents=True, exist_ok=True)
    recover_staging(out_dir)
    try:  # a read-only or forbidden --out fails now, not after loading the module
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(out_dir)) from e
    log.info("converting %s (%s: %s) -> %s at %s px: %s", src.name, src.kind, src.root, out_dir,
             ", ".join(str(s) for s in sizes), ", ".join(comps))

    fingerprint = src.fingerprint()
    if options.loras:  # a bad LoRA file fails now, before any export
        _read_loras(src, options.loras)
    if options.add:
        for comp in comps:  # every refusal before any export
            _check_addable(src, comp, out_dir / comp, options, fingerprint)
    results: list[ComponentResult] = []
    cached: tuple[str, Any] | None = None
    for i, comp in enumerate(comps):
        key = module_of(comp)
        comp_sizes = sizes if comp in SIZED else sizes[:1]
        if options.add:
            results += _add_sizes(src, comp, out_dir / comp, comp_sizes, factor, options, fingerprint)
            continue
        if key in by_block:
            with staged_dir(out_dir / comp) as stage:
                result = blockwise.convert_blockwise(src, _Job(comp, key, res, factor, options), stage, fingerprint)
            result.path = out_dir / comp / MODEL_FILE
            results.append(result)
            continue
        isolate = weights[key] > ISOLATE_BYTES
        holder: list[Any] = []
        if not isolate:
            if cached is None or cached[0] != key:
                cached = None
                release_memory()
                cached = (key, _load(src, comp, key))
            holder.append(cached[1])  # the torch stage takes it out, so it holds the last reference
            cached = (key, (cached[1][0], 0.0))  # a second component of the same module loaded nothing
            if not (i + 1 < len(comps) and module_of(comps[i + 1]) == key):
                cached = None
        job = _Job(comp, key, res, factor, options)
        with staged_dir(out_dir / comp) as stage:
            path = str(stage / MODEL_FILE)
            torch_stage = _torch_stage_in_child(src, job, path) if isolate else _torch_stage(src, job, path, holder)
            release_memory()  # the torch weights go before onnxruntime loads the graph's copy
            result = _export_component(src, job, torch_stage, stage, fingerprint)
            result.path = out_dir / comp / MODEL_FILE
            extra: list[ComponentResult] = []
            added: dict[Size, dict[str, Any]] = {}
            for size in comp_sizes[1:]:
                r, added[size] = _convert_size(src, replace(job, res=size), stage, fingerprint)
                r.path = out_dir / comp / SizeFiles(size, False).model
                extra.append(r)
            if comp in SIZED:
                _finish_sizes(stage, comp, added)
        results += [result, *extra]
    written = [] if options.add else src.write_pipeline_files(out_dir)
    return ConvertResult(source=src, out=out_dir, resolution=res, components=results, pipeline_files=written,
                         sizes=sizes)


def _check_addable(src: Source, comp: str, comp_dir: Path, options: ConvertOptions, fingerprint: str) -> None:
    """``--add``: refuse, before any export, a component whose folder is missing or was converted from other
    weights or with other settings than this run's (its sizes could not share them)."""
    import json

    export = comp_dir / "export.json"
    if not export.is_file():
        raise SdnpuError(f"--add: {comp_dir} holds no converted {comp}",
                         hint=f"convert it first without --add: make convert MODEL={comp} OUT={comp_dir.parent}")
    try:
        done = json.loads(export.read_text())
    except (OSError, ValueError) as e:
        raise SdnpuError(f"--add: cannot read {export}: {e}", hint="convert the component again without --add") from e
    theirs = {"weights (source fingerprint)": done.get("source", {}).get("fingerprint"),
              "exporter": done.get("exporter"), "opset": done.get("opset"),
              "LoRAs fused": [f"{x.get('name')}:{x.get('scale'):g} (sha256 {str(x.get('sha256'))[:12]})"
                              for x in (done.get("lora_fused") or {}).get("fused", [])]}
    ours = {"weights (source fingerprint)": fingerprint, "exporter": options.exporter, "opset": options.opset,
            "LoRAs fused": [f"{d['name']}:{d['scale']:g} (sha256 {str(d['sha256'])[:12]})"
                            for d in (x.describe() for x in _read_loras(src, options.loras))]
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


def _add_sizes(src: Source, comp: str, comp_dir: Path, sizes: list[Size], factor: int, options: ConvertOptions,
               fingerprint: str) -> list[ComponentResult]:
    """``--add``: convert the sizes ``comp_dir`` lacks beside the ones it has; only their files are written
    (each atomically), then ``sizes.json``. The shared data files are read, never written."""
    import shutil

    for leftover in [*comp_dir.glob("*.partial"), *(comp_dir / "dd").glob("*.partial")]:
        log.info("removing %s, left by an add that did not finish", leftover)
        shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink(missing_ok=True)
    have = {f.size for f in sizes_of(comp_dir)}
    new = [s for s in sizes if s not in have]
    if comp not in SIZED or not new:
        log.info("[%s] %s: nothing to add (%s)", comp, comp_dir,
                 "it does not depend on the size" if comp not in SIZED else
                 "it has " + ", ".join(str(s) for s in sizes))
        return []
    results = []
    job = _Job(comp, module_of(comp), new[0], factor, options)
    for size in new:
        result, stats = _convert_size(src, replace(job, res=size), comp_dir, fingerprint)
        result.path = comp_dir / SizeFiles(size, False).model
        results.append(result)
        _finish_sizes(comp_dir, comp, {size: stats})
    return results


def _convert_size(src: Source, job: _Job, comp_dir: Path, fingerprint: str
                  ) -> tuple[ComponentResult, dict[str, Any]]:
    """Convert ``job`` (one more size of a component whose primary is in ``comp_dir``): export it in a scratch
    folder beside it and write its fp32 graph into ``comp_dir`` pointing at the primary's data file
    (``shared.write_sized``); its dispatch model is the primary's re-derived for its shapes
    (``sdnpu.passes.specialize``, written by ``shared.write_proto``), or, where that is refused, compiled in
    full in the scratch folder and written like the fp32 graph. Its reports and records get their size's
    names."""
    import json
    import shutil

    import onnx

    from sdnpu.convert.compile import REPLACED, FidelityCheck, plan_specialization, write_specialized
    from sdnpu.passes.specialize import CannotSpecialize

    comp, size = job.component, job.res
    files = SizeFiles(size, False)
    scratch = comp_dir / f".size-{size}.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        log.info("[%s] size %s (sharing the weights of %s)", comp, size, comp_dir)
        path = str(scratch / MODEL_FILE)
        if module_bytes(src, job.key) > ISOLATE_BYTES:
            torch_stage = _torch_stage_in_child(src, job, path)
        else:
            torch_stage = _torch_stage(src, job, path, [])
        release_memory()
        dd_primary = comp_dir / "dd" / REPLACED
        reuse = job.options.compile and dd_primary.is_file()
        kept: dict[str, Any] = {}
        result = _export_component(src, job, torch_stage, scratch, fingerprint, compile=not reuse, keep=kept)
        cache = shared.read_digest_cache(comp_dir)
        cached = json.dumps(cache, sort_keys=True)
        plan, started, planned = None, time.perf_counter(), 0.0
        if reuse:
            if shared.make_shareable(dd_primary):
                cache.pop(f"dd/{REPLACED}.data", None)
            try:
                plan = plan_specialization(dd_primary, scratch / MODEL_FILE, job.options.compile_options.target)
                planned = time.perf_counter() - started  # the compile's first part; the graph's write is later
            except CannotSpecialize as e:
                log.warning("[%s] %s: the dispatch model of %s cannot be re-derived for this size (%s); compiling "
                            "it in full", comp, size, comp_dir, e)
                with step(log, f"[{comp}] compile stage") as t:
                    result.report = _compile_stage(src, job, scratch, fingerprint, kept["feeds"], kept["actual"],
                                                   kept["lora"])["summary"]
                _place_prologue(scratch / "dd" / REPLACED, comp_dir / "dd", size)
                result.seconds["compile"] = round(t.seconds, 2)
        graphs = [(MODEL_FILE, files.model)]
        if job.options.compile and plan is None:
            graphs.append((f"dd/{REPLACED}", files.dispatch))
        stats: dict[str, Any] = {}
        with step(log, f"[{comp}] {size}: writing its graphs over the shared weights") as t:
            for primary, name in graphs:
                if shared.make_shareable(comp_dir / primary):
                    cache.pop(primary + ".data", None)
                index = shared.digests(comp_dir / primary, cache.setdefault(primary + ".data", {}))
                s = shared.write_sized(scratch / primary, comp_dir / name, index, Path(primary).name + ".data")
                stats["model" if primary == MODEL_FILE else "dispatch"] = s.to_json()
                log.info("[%s] %s: %s -> %d tensors (%s) in the shared file, %d (%s) its own, graph %s", comp,
                         size, name, s.shared, _human(s.shared_bytes), s.own, _human(s.own_bytes),
                         _human(s.graph_bytes))
            if json.dumps(cache, sort_keys=True) != cached:
                shared.write_digest_cache(comp_dir, cache)
        result.seconds["share"] = round(t.seconds, 2)
        if plan is not None:
            with step(log, f"[{comp}] {size}: writing {files.dispatch}, re-derived from the primary's "
                           f"({plan.reshaped} nodes re-shaped, {len(plan.new_masks)} masks made)") as t:
                check = FidelityCheck(kept["feeds"], reference=kept["actual"]) if job.options.check else None
                report, s = write_specialized(plan, dd_primary, scratch / MODEL_FILE, comp_dir / files.dispatch,
                                              scratch / "dd", _compile_info(src, job, fingerprint, kept["lora"]),
                                              job.options.compile_options, check, planned)
            stats["dispatch"] = s.to_json()
            result.report = report["summary"]
            result.seconds["compile"] = round(planned + t.seconds, 2)
            log.info("[%s] %s: offload rate %.2f%% (%d dispatch ops, %d CPU nodes)", comp, size,
                     100 * result.report["offload_rate"], result.report["offloaded_nodes"],
                     result.report["cpu_nodes"])
        elif job.options.compile:
            with step(log, f"[{comp}] {size}: validating {files.dispatch} (onnx.checker, full check)"):
                onnx.checker.check_model(str(comp_dir / files.dispatch), full_check=True)
        plain = SizeFiles(size, True)
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
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return result, stats


def _finish_sizes(comp_dir: Path, comp: str, added: dict[Size, dict[str, Any]]) -> None:
    """``sizes.json`` for what ``comp_dir`` holds: its sizes so far (the primary first), then ``added`` (size
    -> what its graphs share), and the sizes table of the primary's report. Written after the sizes' own
    files: a size is listed only once its graphs are whole."""
    from sdnpu.reports import report as reports

    manifest = read_manifest(comp_dir)
    stats: dict[str, Any] = {e["size"]: e.get("shared") for e in (manifest or {}).get("sizes", [])}
    listed = sizes_of(comp_dir)
    for size, value in added.items():
        stats[str(size)] = value
        if size not in {f.size for f in listed}:
            listed.append(SizeFiles(size, False))
    write_manifest(comp_dir, comp, listed, stats)
    if (comp_dir / "dd" / "report.json").is_file():
        reports.write_sizes(comp_dir, read_manifest(comp_dir) or {})


def _human(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


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


# A module whose fp32 weights alone take more than this share of the available memory is refused before any
# export: the torch stage holds them beside PyTorch's activations and the exporter's own tensors (the SD 3.5
# transformer, 9.0 GB of weights, peaked at 21.4 GB over its whole conversion). T5 (SD 3.5's T5-XXL: 19.0 GB)
# goes block by block instead (BLOCKWISE_SHARE).
MODULE_SHARE = 0.8


# A module that can convert block by block does so where its fp32 weights exceed this share of the available
# memory: whole, its export holds the weights, PyTorch's run, the exporter's copies and then onnxruntime's copy
# (the SD 3.5 transformer peaked at 2.4x its weights), and block by block costs only time.
BLOCKWISE_SHARE = 0.5


def _fits(need: int, share: float) -> bool:
    avail = available_bytes()
    return avail is None or need <= share * avail


def _check_module_fits(key: str, need: int, comps: list[str]) -> None:
    """Refuse module ``key`` (``need`` bytes of fp32 weights) where it cannot fit (``MODULE_SHARE``)."""
    if _fits(need, MODULE_SHARE):
        return
    avail = available_bytes()
    assert avail is not None
    names = [c for c in comps if module_of(c) == key]
    others = [c for c in comps if module_of(c) != key]
    hint = f"convert the others: --model {','.join(others)}" if others else "convert it on a machine with more memory"
    raise SdnpuError(f"{', '.join(names)} cannot be converted here: the {key} module's fp32 weights alone are "
                     f"{_human(need)} and this machine has {_human(avail)} available (its export holds them beside "
                     "PyTorch's activations and the exporter's own copies)", hint=hint)


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
    from sdnpu.convert.wrappers import build_wrapper  # imports torch: only the torch stage does

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
                      fingerprint: str, compile: bool = True, keep: dict[str, Any] | None = None) -> ComponentResult:
    """Check the exported graph in ``stage`` and, with ``compile`` (and the job's options), compile it into
    ``stage/dd``; ``keep`` (when given) receives what a later compile of the same graph needs."""
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
    if keep is not None:
        keep.update(feeds=feeds, actual=actual, lora=torch_stage.lora)
    if options.compile and compile:
        with step(log, f"[{comp}] compile stage") as t:
            summary = _compile_stage(src, job, stage, fingerprint, feeds, actual, torch_stage.lora)["summary"]
        seconds["compile"] = round(t.seconds, 2)

    result = ComponentResult(component=comp, path=path, nodes=len(graph.graph.node), parameters=n_params,
                             seconds=seconds, peak_rss_bytes=max(peak_rss_bytes(), torch_stage.peak_rss_bytes),
                             check=check_data, report=summary,
                             size=str(res) if comp in SIZED else "")
    _write_records(src, job, stage, fingerprint, result, torch_stage.sources, torch_stage.lora)
    return result


def blockwise_result(src: Source, job: _Job, stage: Path, fingerprint: str, n_params: int,
                     seconds: dict[str, float], check: dict[str, Any] | None, summary: dict[str, Any] | None,
                     nodes: int, sources: dict[str, Any]) -> ComponentResult:
    """The records of a component converted block by block (``sdnpu.convert.blockwise``)."""
    result = ComponentResult(component=job.component, path=stage / MODEL_FILE, nodes=nodes, parameters=n_params,
                             seconds=seconds, peak_rss_bytes=peak_rss_bytes(), check=check, report=summary)
    _write_records(src, job, stage, fingerprint, result, sources, None, blockwise=True)
    return result


def _write_records(src: Source, job: _Job, stage: Path, fingerprint: str, result: ComponentResult,
                   sources: dict[str, Any], lora: dict[str, Any] | None, blockwise: bool = False) -> None:
    """config.json, parameters.json and export.json beside the component's graph."""
    comp, res, options = job.component, job.res, job.options
    sig = job.signature(src.module_config(comp))
    src_config = src.module_dir(comp) / "config.json"
    (stage / "config.json").write_bytes(src_config.read_bytes())
    atomic_write_json(stage / PARAMETERS_FILE, sources)
    atomic_write_json(stage / "export.json", {
        "component": comp,
        "source": {"name": src.name, "kind": src.kind, "path": str(src.root), "fingerprint": fingerprint},
        "module_class": src.classes[module_of(comp)],
        "exporter": options.exporter,
        "opset": options.opset,
        **_resolution(res),
        "inputs": [s.to_json() for s in sig.inputs],
        "outputs": list(sig.outputs),
        "nodes": result.nodes,
        "parameters": result.parameters,
        "check": result.check,
        "lora_fused": lora,
        "blockwise": blockwise,
        "seconds": result.seconds,
        "peak_rss_bytes": result.peak_rss_bytes,
        "tool": {"sdnpu": __version__, "python": platform.python_version(), **_versions()},
    })


def _compile_info(src: Source, job: _Job, fingerprint: str, lora: dict[str, Any] | None) -> dict[str, Any]:
    info = {"component": job.component, "source": {"name": src.name, "kind": src.kind, "fingerprint": fingerprint},
            **_resolution(job.res)}
    if lora:
        info["lora_fused"] = lora
    return info


def _place_prologue(compiled: Path, dd_dir: Path, size: Size) -> None:
    """A size compiled in full beside the primary (``compiled``, in the scratch folder) reads its step prologue
    (``sdnpu.formats.prologue``) from the component's ``dd/``: the primary's where the two compute the same (the
    same digest: one prologue serves every size), else its own copy under the size's name, which its model
    then names."""
    import onnx

    model = onnx.load(str(compiled), load_external_data=False)
    spec = prologue.of_proto(model)
    if spec is None:
        return
    primary = dd_dir / prologue.FILE
    theirs = prologue.of_proto(onnx.load(str(primary))) if primary.is_file() else None
    if theirs is not None and theirs.digest == spec.digest:
        return
    own = dataclasses.replace(spec, file=f"prologue.{size}.onnx")
    atomic_write_bytes(dd_dir / own.file, spec.path(compiled).read_bytes())
    for p in model.metadata_props:
        if p.key == prologue.KEY:
            p.value = own.encode()
    onnx.save(model, str(compiled))


def _compile_stage(src: Source, job: _Job, stage: Path, fingerprint: str, feeds: dict[str, Any],
                   actual: dict[str, Any] | None, lora: dict[str, Any] | None) -> dict[str, Any]:
    """Compile ``stage/model.onnx`` into ``stage/dd`` (with the fidelity run when the job checks). Returns
    the report."""
    from sdnpu.convert.compile import FidelityCheck, compile_into, keep_outputs

    comp, options = job.component, job.options
    config = src.module_config(comp)
    keep = keep_outputs(options.outputs, list(job.signature(config).outputs), comp, config,
                        "text_encoder_2" in src.modules)
    check = FidelityCheck(feeds, reference=actual) if options.check else None
    compile_options = dataclasses.replace(options.compile_options, handoff=handoff_values(comp, config),
                                          prologue=prologue_inputs(comp, config))
    return compile_into(stage / MODEL_FILE, stage / "dd", _compile_info(src, job, fingerprint, lora),
                        compile_options, outputs=keep, check=check)


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
