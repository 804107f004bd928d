"""The offload compiler: one declared pipeline, read top to bottom.

    canonicalize  one spelling of every pattern, whatever the exporter wrote
    fuse          the big op families -> the target's dispatch ops (passes/fuse.py orders the rules)
    layout        NHWC between dispatch ops; needs the fused ops (it cancels their boundary Transposes)
    glue          the element-wise ops between them -> dispatch ops; after layout, which pushes Transposes
                  through their plain ONNX forms
    views         Reshapes in front of dispatch ops absorbed into them; after glue (every reader is final)
    precision     bf16 activations, constants as the table stores them, CastAvx at CPU<->NPU edges; needs the
                  final set of dispatch ops (it decides where the edges are)
    handoff       the graph inputs/outputs named in ``CompileOptions.handoff`` (values another dispatch model
                  writes or reads) keep the NPU's form: their edge Transposes and CastAvx go; after
                  precision; only where asked
    cleanup       cast pairs, dead nodes, unused weights, the table check, reference functions
    prologue      the CPU work on the graph inputs named in ``CompileOptions.prologue`` (a step's inputs that
                  another dispatch model reads too) moves into a model of its own, run once for both; after
                  cleanup (the final CPU nodes); only where asked
    partition     NPU regions and the reason for every CPU node; last, it describes the final graph

Every pass after canonicalize reads the target (``CompileOptions.target``): its table says what a dispatch
op is. ``load`` leaves an ONNX file's weights on disk (onnx_ir reads external data lazily); the pipeline runs
on it; ``save`` writes the dispatch model. Derived weights (transposed, bf16) are computed one at a time
while saving, so a compile holds no full second copy of the weights (sdnpu.convert.compile drives this).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import onnx_ir as ir

from sdnpu.errors import SdnpuError
from sdnpu.ops.target import DEFAULT_TARGET, Target, get_target
from sdnpu.passes.canonicalize import canonicalize
from sdnpu.passes.cleanup import cleanup
from sdnpu.passes.fuse import fuse
from sdnpu.passes.glue import lower_glue
from sdnpu.passes.handoff import handoff_pass
from sdnpu.passes.layout import layout
from sdnpu.passes.manager import PassFn, PassRecord, run_passes
from sdnpu.passes.partition import partition
from sdnpu.passes.precision import PRECISIONS, precision
from sdnpu.passes.prologue import prologue_pass
from sdnpu.passes.views import absorb_views

log = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31 - 2**26
# Test/debug knob: weights go to external data when they total more than this many bytes (default: the
# protobuf limit, so only full-size models do). SDNPU_EXTERNAL_DATA_ABOVE=0 sends a tiny model's weights
# there too, which is how the tests exercise external data (and a kill during its write) in seconds.
EXTERNAL_DATA_ENV = "SDNPU_EXTERNAL_DATA_ABOVE"


@dataclass(frozen=True)
class CompileOptions:
    """What a compile is for: the target and the precision (validated once, here); ``handoff``: graph inputs
    and outputs that another dispatch model writes or reads, kept bf16 in the NPU's layout
    (``sdnpu.formats.handoff``); ``prologue``: graph inputs whose CPU work goes into the step prologue that
    another dispatch model shares (``sdnpu.formats.prologue``)."""

    target: Target = field(default_factory=get_target)
    precision: str = "bf16"
    handoff: frozenset[str] = frozenset()
    prologue: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise SdnpuError(f"unknown precision {self.precision!r}", hint=f"choose one of: {', '.join(PRECISIONS)}")

    @classmethod
    def named(cls, target: str = DEFAULT_TARGET, precision: str = "bf16") -> CompileOptions:
        return cls(get_target(target), precision)


def pipeline(options: CompileOptions) -> list[tuple[str, PassFn]]:
    t = options.target
    return [
        ("canonicalize", canonicalize),
        ("fuse", lambda m: fuse(m, t)),
        ("layout", layout),
        ("glue", lambda m: lower_glue(m, t)),
        ("views", lambda m: absorb_views(m, t)),
        ("precision", lambda m: precision(m, t, options.precision)),
        *([("handoff", lambda m: handoff_pass(m, t, options.handoff))] if options.handoff else []),
        ("cleanup", lambda m: cleanup(m, t)),
        *([("prologue", lambda m: prologue_pass(m, t, options.prologue))] if options.prologue else []),
        ("partition", lambda m: partition(m, t)),
    ]


def unreadable(path: Path, err: Exception) -> SdnpuError:
    """The error for a file that onnx cannot parse: truncated, or not ONNX at all."""
    return SdnpuError(f"{path} is not a readable ONNX model: {type(err).__name__}: {err}",
                      hint="re-export it; a truncated file or missing external data gives this")


def load(path: Path) -> ir.Model:
    try:
        model = ir.load(path)
    except FileNotFoundError as e:
        raise SdnpuError(f"{path} not found") from e
    except Exception as e:  # protobuf's DecodeError and friends
        raise unreadable(path, e) from e
    _check_external_data(model, path)
    return model


def _check_external_data(model: ir.Model, path: Path) -> None:
    """External data is read lazily, deep inside the compile: name a missing or short file now."""
    sizes: dict[str, int] = {}
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            data = str(tensor.path)
            if data not in sizes:
                sizes[data] = os.path.getsize(data) if os.path.isfile(data) else -1
            if sizes[data] < 0:
                raise SdnpuError(f"{path} keeps its weights in {tensor.location}, which is missing ({data})",
                                 hint=f"copy {tensor.location} beside {path.name}: the two belong together")
            end = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
            if sizes[data] < end:
                raise SdnpuError(f"{data} is truncated: {sizes[data]:,} bytes, {path.name} needs {end:,}",
                                 hint="the copy is incomplete: copy it again, or re-export the model")


def save(model: ir.Model, path: Path) -> None:
    """Write ``model`` to ``path``; its weights go to ``path.data`` past the protobuf limit, or where some are
    still the source's external data (a weight no pass changed, e.g. the text encoders' token table that
    stays with its CPU Gather): those are copied into our own file, never referenced in the source's."""
    values = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    total = sum(t.nbytes for t in values)
    external = any(isinstance(t, ir.ExternalTensor) for t in values)
    try:
        if external or total > int(os.environ.get(EXTERNAL_DATA_ENV, PROTOBUF_LIMIT)):
            ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
        else:
            ir.save(model, path)
    except OSError as e:
        # numpy's tofile reports a short write as "N requested and M written", without an errno
        if e.errno is None and shutil.disk_usage(path.parent).free < total:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        if e.errno is not None and e.filename is None:  # a failed write names no file: name the model
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise


def compile_model(model: ir.Model, options: CompileOptions | None = None,
                  after_each: Callable[[str, ir.Model], None] | None = None) -> list[PassRecord]:
    return run_passes(model, pipeline(options or CompileOptions()), after_each)


def records_json(records: list[PassRecord]) -> list[dict[str, object]]:
    """The pass records as plain data (the report stores them)."""
    from dataclasses import asdict

    out: list[dict[str, object]] = []
    for r in records:
        item: dict[str, object] = {"name": r.name, "seconds": round(r.seconds, 3), "counts": dict(r.result.counts)}
        if "regions" in r.result.details:
            item["regions"] = [asdict(reg) for reg in r.result.details["regions"]]  # type: ignore[union-attr]
        out.append(item)
    return out
