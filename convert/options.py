"""What a conversion is asked for and what it gives back: ``ConvertOptions`` (validated when made, before
anything is loaded), ``ComponentResult`` for each graph written and ``ConvertResult`` for the run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sdnpu.convert.compile import OUTPUT_CHOICES
from sdnpu.convert.export import DEFAULT_OPSET, Exporter
from sdnpu.convert.sources import Source
from sdnpu.errors import SdnpuError
from sdnpu.imagesize import Size, parse_sizes
from sdnpu.lora.adapters import LoraSpec
from sdnpu.ops.target import DEFAULT_TARGET
from sdnpu.signatures import check_batch
from sdnpu.passes.pipeline import CompileOptions


def parse_batches(value: int | str | Sequence[int]) -> tuple[int, ...]:
    """``--batch``: one batch or a comma-separated list (the first the primary), each checked, repeats dropped."""
    items: list[Any]
    if isinstance(value, str):
        items = [x.strip() for x in value.split(",") if x.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        items = [value]
    batches: list[int] = []
    for item in items:
        try:
            b = int(item) if isinstance(item, str) else item
        except ValueError:
            b = item
        if check_batch(b) not in batches:  # type: ignore[arg-type]
            batches.append(b)  # type: ignore[arg-type]
    if not batches:
        raise SdnpuError("no batch given", hint="BATCH is 1 (guidance-free), 2 (guidance) or a list: 1,2")
    return tuple(batches)


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
    or bfp16 (amd-xdna2), fp16 (qnn-htp; "" the target's first); ``htp_arch``: qnn-htp's HTP generation; ``htp_optimization``: QNN's
    graph finalization mode; ``context_gb``: its weights per QNN context;
    ``loras``: LoRAs fused into the UNet and text encoders before export; ``blockwise``: the modules that can,
    block by block even where they fit; ``dispatch_only``: the block-by-block ones keep their dispatch model only
    (``sdnpu.formats.reference``); ``batch``: the
    denoiser's batches (an int, "1,2" or a sequence; the first the primary's; None: the source's default,
    ``sdnpu.formats.generation``: 2 where its pipeline uses guidance, 1 where it is guidance-free)."""

    res: Size | int | str | Sequence[Size | int | str] | None = None
    exporter: str = "dynamo"
    opset: int = DEFAULT_OPSET
    check: bool = True
    compile: bool = True
    outputs: str = "pipeline"
    target: str = DEFAULT_TARGET
    precision: str = ""  # "": the target's first (bf16 for amd-xdna2, fp16 for qnn-htp)
    htp_arch: int | str | None = None  # qnn-htp: the HTP generation (None: v73)
    htp_optimization: int | str | None = None  # qnn-htp: QNN's graph finalization mode (None: QNN's default)
    context_gb: float | None = None  # qnn-htp: fp16 weights per QNN context (None: the target's, 2 GB)
    loras: tuple[LoraSpec, ...] = ()  # diffusers' fuse_lora, before export
    add: bool = False
    blockwise: bool = False  # T5 and Flux's transformer block by block even where they fit (they do where not)
    dispatch_only: bool = False  # block by block: keep the dispatch model only (no fp32 graph; a third of the disk)
    batch: int | str | Sequence[int] | None = None

    def __post_init__(self) -> None:
        self.export_with  # noqa: B018 -- validates exporter and opset
        if self.outputs not in OUTPUT_CHOICES:
            raise SdnpuError(f"unknown --outputs {self.outputs!r}", hint=f"choose one of: {', '.join(OUTPUT_CHOICES)}")
        if self.res is not None:
            object.__setattr__(self, "res", tuple(parse_sizes(self.res)))  # type: ignore[arg-type]
            for size in self.res:  # type: ignore[union-attr]
                if min(size) <= 0:
                    raise SdnpuError(f"size {size} is not a positive number of pixels",
                                     hint="RES is WxH in pixels (1152x896), or one number for a square (1024)")
        if self.batch is not None:
            object.__setattr__(self, "batch", parse_batches(self.batch))
        compile_options = self.compile_options  # validates target, precision and the HTP generation
        target = compile_options.target
        object.__setattr__(self, "precision", compile_options.precision)  # "" -> the target's own
        if target.kind == "standard" and self.compile and (
                len(self.res or ()) > 1 or len(self.batch or ()) > 1 or self.add):  # type: ignore[arg-type]
            raise SdnpuError(f"--target {target.name} converts one size and one batch per folder for now",
                             hint="give one RES and one BATCH (and no --add); convert other sizes into other folders")
        object.__setattr__(self, "loras", tuple(LoraSpec.parse(x) if isinstance(x, str) else x for x in self.loras))
        if self.dispatch_only and (not self.compile or target.kind == "standard" or self.add):
            why = ("keeps the dispatch model in place of the fp32 graph: it needs the compile" if not self.compile
                   else f"is for AMD's dispatch models; --target {target.name} compiles from the fp32 graph"
                   if target.kind == "standard" else "adds no sizes: the sizes --add writes are derived from the "
                   "fp32 graph")
            raise SdnpuError(f"--dispatch-only {why}", hint="drop --dispatch-only" if not self.add else
                             "convert the sizes you need in one run: --res A,B")

    @property
    def batches(self) -> tuple[int, ...] | None:
        return self.batch  # type: ignore[return-value]  # parsed in __post_init__

    @property
    def compile_options(self) -> CompileOptions:
        return CompileOptions.named(self.target, self.precision, self.htp_arch, self.context_gb,
                                    self.htp_optimization)

    @property
    def export_with(self) -> Exporter:
        return Exporter(self.exporter, self.opset)


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
    batch: int | None = None  # the denoiser's batch (None: the component takes none)

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
    batches: list[int] = field(default_factory=list)  # the denoiser's batches, the primary's first
