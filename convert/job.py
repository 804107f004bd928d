"""One component's conversion as every part of the stage reads it (``Job``: its spec, size, options and origin;
the torch side may run it in a worker process), and the records it leaves beside the graph: ``config.json``,
``parameters.json`` and ``export.json`` (``write_records``), and what the compile report says of the job
(``compile_info``)."""

from __future__ import annotations

import platform
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx

from sdnpu import __version__
from sdnpu.convert.options import ComponentResult, ConvertOptions
from sdnpu.convert.sources import Source
from sdnpu.fileio import atomic_write_json
from sdnpu.formats import reference
from sdnpu.formats.parameters import FILE as PARAMETERS_FILE
from sdnpu.formats.sizes import Variant
from sdnpu.imagesize import Size
from sdnpu.signatures import Signature
from sdnpu.specs import ComponentSpec

MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class Origin:
    """Where a job's module comes from, as its records name it."""

    name: str
    kind: str
    root: Path
    fingerprint: str  # of what defines the weights (``Source.fingerprint``)
    module_class: str
    config_file: Path  # the module's config.json, copied beside the graph

    @classmethod
    def of(cls, src: Source, spec: ComponentSpec, fingerprint: str) -> Origin:
        return cls(src.name, src.kind, src.root, fingerprint, src.classes[spec.module],
                   src.module_dir(spec.name) / "config.json")


@dataclass(frozen=True)
class Job:
    """One component's conversion at one size and, for a denoiser, one batch."""

    spec: ComponentSpec
    res: Size
    options: ConvertOptions
    origin: Origin
    batch: int | None = None  # the denoiser's (None: the component takes none)

    @property
    def component(self) -> str:
        return self.spec.name

    @property
    def key(self) -> str:
        """Its diffusers module ("vae" for both VAE halves)."""
        return self.spec.module

    def signature(self) -> Signature:
        return self.spec.signature(self.res, self.batch)

    def sample_inputs(self) -> dict[str, Any]:
        return self.spec.sample_inputs(self.res, batch=self.batch)

    @property
    def variant(self) -> Variant:
        return Variant(self.res, self.batch)

    def at(self, variant: Variant) -> Job:
        return replace(self, res=variant.size, batch=variant.batch)


def resolution(res: Size, batch: int | None = None) -> dict[str, Any]:
    """How export.json and the report name the size: ``resolution`` the side of a square (None otherwise, as
    before non-square sizes), ``size`` always; ``batch``, the denoiser's, where the component takes one."""
    return {"resolution": res.width if res.square else None, "size": res.to_json(),
            **({"batch": batch} if batch is not None else {})}


def compile_info(job: Job, lora: dict[str, Any] | None) -> dict[str, Any]:
    """What the component's report records of the job."""
    o = job.origin
    info = {"component": job.component, "source": {"name": o.name, "kind": o.kind, "fingerprint": o.fingerprint},
            **resolution(job.res, job.batch)}
    if lora:
        info["lora_fused"] = lora
    return info


def write_records(job: Job, stage: Path, result: ComponentResult, sources: dict[str, Any],
                  lora: dict[str, Any] | None = None, blockwise: bool = False, dispatch_only: bool = False) -> None:
    """config.json, parameters.json (``sources``) and export.json beside the component's graph in ``stage``
    (``dispatch_only``: no fp32 graph was kept, ``sdnpu.formats.reference``)."""
    o, options = job.origin, job.options
    sig = job.signature()
    (stage / "config.json").write_bytes(o.config_file.read_bytes())
    atomic_write_json(stage / PARAMETERS_FILE, sources)
    atomic_write_json(stage / "export.json", {
        "component": job.component,
        "source": {"name": o.name, "kind": o.kind, "path": str(o.root), "fingerprint": o.fingerprint},
        "module_class": o.module_class,
        "exporter": options.exporter,
        "opset": options.opset,
        **resolution(job.res, job.batch),
        "inputs": [s.to_json() for s in sig.inputs],
        "outputs": list(sig.outputs),
        "nodes": result.nodes,
        "parameters": result.parameters,
        "check": result.check,
        "lora_fused": lora,
        "blockwise": blockwise,
        **({reference.KEY: True} if dispatch_only else {}),
        "seconds": result.seconds,
        "peak_rss_bytes": result.peak_rss_bytes,
        "tool": {"sdnpu": __version__, "python": platform.python_version(), **_versions()},
    })


def _versions() -> dict[str, str]:
    import onnxruntime  # onnxruntime at first use: the CLI starts without it (20-30 ms)
    import torch  # torch at first use: the CLI starts without it (about 1 s)

    return {"torch": torch.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}
