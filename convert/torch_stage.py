"""The torch side of a component's conversion, the one place that builds torch modules: load the module (or
draw a preset's seeded weights), fuse LoRAs into it, wrap it (``sdnpu.convert.wrappers``), run PyTorch on the
seeded inputs and export the graph. Every torch object lives and dies in here; a large module's stage runs in
a worker process of its own (``run_torch_stage_in_worker``), whose result (PyTorch's outputs, small) comes back
by pipe."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdnpu import families
from sdnpu.convert.export import export_module, torch_outputs
from sdnpu.convert.job import Job
from sdnpu.convert.parameters import map_parameters
from sdnpu.convert.sources import Source, resolve_source
from sdnpu.errors import SdnpuError, storage_error
from sdnpu.lora.adapters import LoraFile, LoraSpec, fuse_into, read_lora
from sdnpu.progress import peak_rss_bytes, step
from sdnpu.worker import run_in_worker

log = logging.getLogger(__name__)


@dataclass
class TorchStage:
    """What the torch side hands over: PyTorch's outputs on the seeded inputs, the size, the times."""

    reference: list[Any] | None
    parameters: int
    seconds: dict[str, float]
    peak_rss_bytes: int  # of the process that ran it
    sources: dict[str, Any]  # parameters.json: the parameter each constant of the graph holds
    lora: dict[str, Any] | None = None  # the LoRAs fused before export


def load(src: Source, comp: str, key: str) -> tuple[Any, float]:
    """The module and the seconds it took to load (for export.json)."""
    what = "drawing seeded weights for" if src.kind == "preset" else "loading"
    with step(log, f"[{comp}] {what} {src.classes[key]} ({src.name})") as t:
        module = src.load_module(key)
    return module, t.seconds


def read_loras(src: Source, specs: Sequence[LoraSpec]) -> list[LoraFile]:
    unet_config = src.module_config("unet") if "unet" in src.modules else None
    return [read_lora(spec, families.named(src.pipeline_config().family).name, unet_config) for spec in specs]


def _fuse_loras(src: Source, job: Job, module: Any) -> dict[str, Any] | None:
    """``sdnpu convert --lora``: the LoRAs fused into ``module`` by diffusers; what export.json records."""
    if not job.options.loras or job.component not in families.named(job.spec.family).lora:
        return None
    loras = read_loras(src, job.options.loras)
    with step(log, f"[{job.component}] fusing {len(loras)} LoRA(s) into the module (diffusers' fuse_lora)"):
        modules = fuse_into(module, job.component, loras, families.named(job.spec.family).name)
    return {"fused": [lora.describe() for lora in loras], "modules": modules}


def _export(job: Job, wrapper: Any, feeds: dict[str, Any], path: Path) -> None:
    """Export ``wrapper`` on ``feeds`` to ``path``; an exporter's failure is one line naming it."""
    exporter = job.options.export_with
    sig = job.signature()
    try:
        export_module(wrapper, tuple(_as_torch(feeds)), [s.name for s in sig.inputs], list(sig.outputs), path,
                      exporter=exporter)
    except SdnpuError:
        raise
    except Exception as e:  # the exporters raise many types; name the component and the exporter
        if isinstance(e, OSError) and (err := storage_error(e)) is not None:
            raise err from e  # a full or read-only disk while saving is not the exporter's fault
        raise SdnpuError(f"torch's {exporter.name} exporter failed on {job.component}: {type(e).__name__}: {e}",
                         hint="try --exporter torchscript" if exporter.name == "dynamo" else None) from e


def run_torch_stage(src: Source, job: Job, path: str, holder: list[Any]) -> TorchStage:
    """Load (unless ``holder`` has the module), run PyTorch on the seeded inputs, export."""
    from sdnpu.convert.wrappers import build_wrapper  # imports torch: only the torch stage does

    comp = job.component
    module, load_s = holder.pop() if holder else load(src, comp, job.key)
    seconds = {"load": round(load_s, 2)}
    lora = _fuse_loras(src, job, module)
    factor = job.spec.vae_factor
    wrapper = build_wrapper(comp, module, job.spec.config, latent=(job.res.height // factor, job.res.width // factor))
    del module
    n_params = sum(p.numel() for p in wrapper.parameters())
    feeds = job.sample_inputs()
    reference = None
    if job.options.check:
        with step(log, f"[{comp}] running PyTorch on seeded inputs") as t:
            reference = torch_outputs(wrapper, feeds)
        seconds["torch_run"] = round(t.seconds, 2)
    exporter = job.options.export_with
    with step(log, f"[{comp}] exporting with torch's {exporter.name} exporter (opset {exporter.opset})") as t:
        _export(job, wrapper, feeds, Path(path))
    seconds["export"] = round(t.seconds, 2)
    with step(log, f"[{comp}] matching the graph's constants to the module's parameters") as t:
        sources = map_parameters(wrapper, Path(path))
    seconds["parameters"] = round(t.seconds, 2)
    log.info("[%s] %d of the graph's constants are module parameters (%d ambiguous)", comp,
             len(sources["initializers"]), sources["ambiguous"])
    return TorchStage(reference, n_params, seconds, peak_rss_bytes(), sources, lora)


def run_torch_stage_in_worker(src: Source, job: Job, path: str) -> TorchStage:
    """``run_torch_stage`` in a worker process (``sdnpu.worker``)."""
    log.info("[%s] exporting in a worker process (%s)", job.component, "weights above 1 GiB")
    source = src.name if src.kind == "preset" else str(src.root)
    return run_in_worker(_torch_stage_from, source, job, path, what=f"exporting {job.component}")  # type: ignore[no-any-return]


def _torch_stage_from(source: str, job: Job, path: str) -> TorchStage:
    return run_torch_stage(resolve_source(source), job, path, [])


def _as_torch(feeds: dict[str, Any]) -> list[Any]:
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    return [torch.from_numpy(v) for v in feeds.values()]
