"""The offload compiler: one declared pipeline, read top to bottom.

    canonicalize  one spelling of every pattern, whatever the exporter wrote
    fuse          op families -> dispatch ops (passes/fuse.py orders the rules)
    layout        NHWC between dispatch ops; needs the fused ops (it cancels their boundary Transposes)
    glue          remaining element-wise / data-movement ops -> dispatch ops; after layout, which pushes
                  Transposes through the plain ONNX forms
    precision     bf16 weights and activations, CastAvx at CPU<->NPU edges; needs the final set of
                  dispatch ops (it decides where the edges are)
    cleanup       cast pairs, dead nodes, unused weights, AMD attributes, reference functions
    partition     NPU regions and the reason for every CPU node; last, it describes the final graph

``load`` leaves an ONNX file's weights on disk (onnx_ir reads external data lazily); the pipeline runs on
it; ``save`` writes the dispatch model. Derived weights (transposed, bf16) are computed one at a time while
saving, so a compile holds no full second copy of the weights (sdnpu.convert.compile drives this).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx_ir as ir

from sdnpu.errors import SdnpuError
from sdnpu.passes.canonicalize import canonicalize
from sdnpu.passes.cleanup import cleanup
from sdnpu.passes.fuse import fuse
from sdnpu.passes.glue import lower_glue
from sdnpu.passes.layout import layout
from sdnpu.passes.manager import PassFn, PassRecord, PassResult, run_passes
from sdnpu.passes.partition import partition
from sdnpu.passes.precision import precision

log = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31 - 2**26


def pipeline(precision_mode: str = "bf16") -> list[tuple[str, PassFn]]:
    declined: dict[str, tuple[str, str]] = {}

    def fuse_pass(model: ir.Model) -> PassResult:
        result = fuse(model)
        declined.update(result.details.get("declined", {}))  # type: ignore[arg-type]
        return result

    def glue_pass(model: ir.Model) -> PassResult:
        result = lower_glue(model)
        declined.update(result.details.get("declined", {}))  # type: ignore[arg-type]
        return result

    return [
        ("canonicalize", canonicalize),
        ("fuse", fuse_pass),
        ("layout", layout),
        ("glue", glue_pass),
        ("precision", lambda m: precision(m, precision_mode)),
        ("cleanup", cleanup),
        ("partition", lambda m: partition(m, declined)),
    ]


def load(path: Path) -> ir.Model:
    try:
        return ir.load(path)
    except FileNotFoundError as e:
        raise SdnpuError(f"{path} not found") from e
    except Exception as e:  # protobuf's DecodeError and friends
        raise SdnpuError(f"{path} is not a readable ONNX model: {type(e).__name__}: {e}",
                         hint="re-export it; a truncated file or missing external data gives this") from e


def save(model: ir.Model, path: Path) -> None:
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if total > PROTOBUF_LIMIT:
        ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
    else:
        ir.save(model, path)


def compile_model(model: ir.Model, after_each=None, precision: str = "bf16") -> list[PassRecord]:  # type: ignore
    return run_passes(model, pipeline(precision), after_each)


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
