"""``convert()``: resolve the source, then export and check each component into ``OUT/<component>/``.

Each component folder is built complete in a staging folder and swapped into place only when export and
check both succeeded (``sdnpu.fileio.staged_dir``), so a failed or interrupted run leaves the previous
output as it was. One module is in memory at a time (the VAE once for encoder and decoder), and the torch
module is dropped before onnxruntime loads the graph: at full SDXL size the two would not fit together.

The parts of the stage: ``options`` (what is asked, what comes back), ``job`` (one component's conversion and
its records), ``budget`` (memory: workers, block by block, refusals), ``torch_stage`` (the torch side),
``stages`` (check, compile, records), ``sized`` (more sizes over one copy of the weights), ``blockwise``.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sdnpu import families
from sdnpu.components import COMPONENTS, SIZED, module_of
from sdnpu.convert import blockwise, budget, sized
from sdnpu.convert.job import MODEL_FILE, Job, Origin
from sdnpu.convert.options import ComponentResult, ConvertOptions, ConvertResult
from sdnpu.convert.sources import Source, resolve_source
from sdnpu.convert.stages import export_component
from sdnpu.convert.torch_stage import load, read_loras, run_torch_stage, run_torch_stage_in_worker
from sdnpu.errors import SdnpuError
from sdnpu.fileio import recover_staging, staged_dir
from sdnpu.formats.sizes import Variant, sizes_of
from sdnpu.imagesize import Size
from sdnpu.signatures import batched
from sdnpu.progress import release_memory
from sdnpu.specs import PipelineConfig

__all__ = ["ComponentResult", "ConvertOptions", "ConvertResult", "convert", "default_resolution",
           "parse_components"]

log = logging.getLogger(__name__)


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
    """The resolution ``source`` was trained at (``sdnpu.specs.PipelineConfig.default_resolution``)."""
    return source.pipeline_config().default_resolution()


@dataclass
class _Run:
    """A conversion, checked and planned before anything is exported."""

    src: Source
    comps: list[str]
    sizes: list[Size]  # the first is the primary
    batches: list[int]  # the denoiser's, the first the primary's
    out: Path
    options: ConvertOptions
    config: PipelineConfig
    budget: budget.Budget
    fingerprint: str

    def job(self, comp: str, variant: Variant) -> Job:
        spec = self.config.spec(comp)
        return Job(spec, variant.size, self.options, Origin.of(self.src, spec, self.fingerprint), variant.batch)

    def variants(self, comp: str) -> list[Variant]:
        """What ``comp`` is converted at, the primary first: every size and batch for a denoiser, every size for
        the VAEs, the primary size for the text encoders."""
        if batched(comp):
            return [Variant(s, b) for s in self.sizes for b in self.batches]
        return [Variant(s) for s in (self.sizes if comp in SIZED else self.sizes[:1])]


def _prepare(source: str | Path, components: str | Sequence[str], out: str | Path | None,
             options: ConvertOptions) -> _Run:
    """Resolve the source and the components, check the sizes, the memory, the output folder and (with
    ``--add`` or ``--lora``) the folder and the LoRA files: every refusal before any export."""
    src = resolve_source(source)
    comps = parse_components(components, src)
    config = src.pipeline_config()
    sizes = list(options.res or [Size.of(config.default_resolution())])  # type: ignore[arg-type]
    for size in sizes:
        config.check_resolution(size, comps)
    out_dir = Path(out) if out is not None else Path("models") / src.name
    batches = list(options.batches or _folder_batches(out_dir, comps, options.add) or [src.generation().batch])
    family = families.named(config.family)
    if options.loras and not family.lora:
        raise SdnpuError(f"{src.name} is {family.a_pipeline}: sdnpu fuses LoRAs into UNets and CLIP encoders (SDXL, "
                         "SD 1.x) and Flux.1's transformer and CLIP-L only", hint="convert it without --lora")
    src.check_pipeline_files()
    plan = budget.plan(src, comps, options)
    blocked = [c for c in comps if module_of(c) in plan.by_block and c in family.lora]
    if options.loras and blocked:
        raise SdnpuError(f"--lora: {', '.join(blocked)} converts block by block, where sdnpu does not fuse LoRAs "
                         "before export", hint="convert without --lora, then apply them to the converted folder: "
                         "sdnpu lora apply MODELS --lora FILE")
    if options.add and not out_dir.is_dir():
        raise SdnpuError(f"--add: {out_dir} holds no conversion to add sizes to",
                         hint="convert it first without --add (the first size given is the primary)")
    if not options.add:  # added sizes and batches share the primary's weights
        budget.check_disk(plan, comps, out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    recover_staging(out_dir)
    try:  # a read-only or forbidden --out fails now, not after loading the module
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(out_dir)) from e
    denoisers = [c for c in comps if batched(c)]
    log.info("converting %s (%s: %s) -> %s at %s px%s: %s", src.name, src.kind, src.root, out_dir,
             ", ".join(str(s) for s in sizes), f", the {'/'.join(denoisers)} at batch "
             f"{', '.join(map(str, batches))}" if denoisers else "", ", ".join(comps))
    run = _Run(src, comps, sizes, batches, out_dir, options, config, plan, src.fingerprint())
    if options.loras:  # a bad LoRA file fails now, before any export
        read_loras(src, options.loras)
    if options.add:
        for comp in comps:  # every refusal before any export
            sized.check_addable(src, run.job(comp, run.variants(comp)[0]), out_dir / comp)
    return run


def _folder_batches(out_dir: Path, comps: list[str], add: bool) -> list[int]:
    """``--add`` without ``--batch``: the batches the folder's denoiser has, the primary's first (new sizes get
    each of them)."""
    if not add:
        return []
    for comp in comps:
        if batched(comp):
            found = [f.batch for f in sizes_of(out_dir / comp) if f.batch is not None]
            return list(dict.fromkeys(found))
    return []


class _ModuleCache:
    """The module loaded for one component, kept for the next where both come from it (the VAE's halves)."""

    def __init__(self) -> None:
        self.held: tuple[str, Any] | None = None

    def take(self, src: Source, comp: str, reused_next: bool) -> list[Any]:
        """A holder with ``comp``'s module and its load time (the torch stage takes it out, so it holds the last
        reference); ``reused_next``: the next component reads the same module."""
        key = module_of(comp)
        if self.held is None or self.held[0] != key:
            self.held = None
            release_memory()
            self.held = (key, load(src, comp, key))
        holder = [self.held[1]]
        self.held = (key, (self.held[1][0], 0.0)) if reused_next else None  # a second component loaded nothing
        return holder


def _convert_component(run: _Run, comp: str, modules: _ModuleCache, reused_next: bool) -> list[ComponentResult]:
    """One component at every size (and, a denoiser, every batch) it takes (the text encoders at the primary
    only)."""
    variants = run.variants(comp)
    job = run.job(comp, variants[0])
    if run.options.add:
        return sized.add_sizes(run.src, job, run.out / comp, variants)
    if job.key in run.budget.by_block:
        with staged_dir(run.out / comp) as stage:
            result = blockwise.convert_blockwise(run.src, job, stage)
        result.path = run.out / comp / MODEL_FILE
        return [result]
    isolate = run.budget.isolate(job.key)
    holder = [] if isolate else modules.take(run.src, comp, reused_next)
    with staged_dir(run.out / comp) as stage:
        path = str(stage / MODEL_FILE)
        torch_stage = (run_torch_stage_in_worker(run.src, job, path) if isolate
                       else run_torch_stage(run.src, job, path, holder))
        release_memory()  # the torch weights go before onnxruntime loads the graph's copy
        result = export_component(job, torch_stage, stage)
        result.path = run.out / comp / MODEL_FILE
        extra: list[ComponentResult] = []
        added: dict[Variant, dict[str, Any]] = {}
        for variant in variants[1:]:
            r, added[variant] = sized.convert_size(run.src, job.at(variant), stage)
            r.path = run.out / comp / sized.files_of(stage, variant).model
            extra.append(r)
        if comp in SIZED:
            sized.finish_sizes(stage, comp, added)
    return [result, *extra]


def convert(source: str | Path, components: str | Sequence[str] = "all", out: str | Path | None = None,
            options: ConvertOptions | None = None, **settings: Any) -> ConvertResult:
    """Export ``components`` of ``source`` to ``out`` (default ``models/<source name>``) and, unless
    ``options.compile`` is off, compile each into ``<component>/dd/`` (dispatch model and offload report).
    ``settings`` are ``ConvertOptions`` fields, applied over ``options``: ``convert("tiny-sdxl", res=256)``."""
    options = replace(options, **settings) if options is not None else ConvertOptions(**settings)
    run = _prepare(source, components, out, options)
    results: list[ComponentResult] = []
    modules = _ModuleCache()
    for i, comp in enumerate(run.comps):
        reused_next = i + 1 < len(run.comps) and module_of(run.comps[i + 1]) == module_of(comp)
        results += _convert_component(run, comp, modules, reused_next)
    written = [] if options.add else run.src.write_pipeline_files(run.out)
    return ConvertResult(source=run.src, out=run.out, resolution=run.sizes[0], components=results,
                         pipeline_files=written, sizes=run.sizes, batches=run.batches)
