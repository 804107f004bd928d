"""What a pass returns, how the declared pipeline (``sdnpu.passes.pipeline``) is run, and its records."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import onnx_ir as ir

from sdnpu.errors import SdnpuError

if TYPE_CHECKING:  # partition's result type: partition builds on this module
    from sdnpu.passes.partition import Region

log = logging.getLogger(__name__)


@dataclass
class PassResult:
    """What a pass did: whether it changed the model, its counts (the report's pass records); what one pass hands
    on: ``regions`` (partition: the final graph's NPU regions), ``prologue`` (prologue: the model it cut out, for
    the compile to write beside the dispatch model)."""

    modified: bool
    counts: dict[str, int] = field(default_factory=dict)
    regions: list[Region] | None = None
    prologue: ir.Model | None = None


PassFn = Callable[[ir.Model], PassResult]


@dataclass
class PassRecord:
    name: str
    result: PassResult
    seconds: float


def run_passes(model: ir.Model, passes: Sequence[tuple[str, PassFn]],
               after_each: Callable[[str, ir.Model], None] | None = None) -> list[PassRecord]:
    """Run ``passes`` in order. A failing pass is named together with the passes that ran before it;
    ``after_each`` (tests: checker + onnxruntime comparison) runs after every pass."""
    records: list[PassRecord] = []
    for name, fn in passes:
        start = time.perf_counter()
        try:
            result = fn(model)
        except SdnpuError:
            raise
        except Exception as e:
            before = ", ".join(r.name for r in records) or "none"
            raise RuntimeError(f"pass {name!r} failed (after: {before}): {type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start
        records.append(PassRecord(name, result, seconds))
        log.info("pass %-12s %5.1f s  %s", name, seconds,
                 ", ".join(f"{k} {v}" for k, v in result.counts.items() if v) or "no change")
        if after_each is not None:
            after_each(name, model)
    return records


def records_json(records: list[PassRecord]) -> list[dict[str, object]]:
    """The pass records as plain data (the report stores them)."""
    out: list[dict[str, object]] = []
    for r in records:
        item: dict[str, object] = {"name": r.name, "seconds": round(r.seconds, 3), "counts": dict(r.result.counts)}
        if r.result.regions is not None:
            item["regions"] = [asdict(reg) for reg in r.result.regions]
        out.append(item)
    return out
