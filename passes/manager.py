"""What a pass returns, how the declared pipeline (``sdnpu.passes.pipeline``) is run, and its records."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
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


@dataclass(frozen=True)
class Group:
    """Passes under one name, run in order; their records are named ``<group>/<pass>``. With ``rounds`` above
    one it is a fixpoint loop: the steps run again, in order, until a round in which the step named ``until``
    changed nothing (or, where ``until`` names several, none of them did), at most ``rounds`` times; a round's
    records are named ``<group>[<round>]/<pass>``, and ``pass_names`` shows the bound
    (``<group>[<=rounds]/<pass>``)."""

    name: str
    steps: Sequence[Entry]
    rounds: int = 1
    until: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        names = [entry_name(s) for s in self.steps]
        missing = [u for u in self.until_steps if u not in names]
        if self.rounds > 1 and (missing or not self.until_steps):
            raise ValueError(f"group {self.name!r}: until={self.until!r} names "
                             f"{', '.join(map(repr, missing)) or 'nothing'}, none of its steps {names}")
        if self.rounds < 1:
            raise ValueError(f"group {self.name!r}: rounds must be at least 1, not {self.rounds}")

    @property
    def until_steps(self) -> tuple[str, ...]:
        """The steps whose change keeps the loop going (``until`` as a tuple)."""
        return (self.until,) if isinstance(self.until, str) else tuple(self.until)


Entry = tuple[str, PassFn] | Group  # a pass, or a group of them


def entry_name(entry: Entry) -> str:
    """The name of a pass, or of a group."""
    return entry.name if isinstance(entry, Group) else entry[0]


def pass_list_names(passes: Sequence[Entry], prefix: str = "") -> Iterator[str]:
    """Every step of ``passes`` in the order it runs, a repeated group's steps once under its bound."""
    for entry in passes:
        if isinstance(entry, Group):
            label = f"{entry.name}[<={entry.rounds}]" if entry.rounds > 1 else entry.name
            yield from pass_list_names(entry.steps, f"{prefix}{label}/")
        else:
            yield f"{prefix}{entry[0]}"


@dataclass
class PassRecord:
    name: str
    result: PassResult
    seconds: float


def run_passes(model: ir.Model, passes: Sequence[Entry],
               after_each: Callable[[str, ir.Model], None] | None = None) -> list[PassRecord]:
    """Run ``passes`` in order, each step of a group timed and recorded on its own (``Group``). A failing step
    is named together with the passes that ran before it; ``after_each`` (tests: checker + onnxruntime
    comparison) runs after every step, with the step's record name."""
    records: list[PassRecord] = []
    _run(model, passes, "", records, after_each)
    return records


def _run(model: ir.Model, passes: Sequence[Entry], prefix: str, records: list[PassRecord],
         after_each: Callable[[str, ir.Model], None] | None) -> dict[str, PassResult]:
    """Run one level of ``passes``; returns each step's (and group's: whether any of its steps changed the
    model) result by its own name, the last where a name repeats."""
    results: dict[str, PassResult] = {}
    for entry in passes:
        if isinstance(entry, Group):
            changed = False
            for round_ in range(1, entry.rounds + 1):
                label = f"{entry.name}[{round_}]" if entry.rounds > 1 else entry.name
                inner = _run(model, entry.steps, f"{prefix}{label}/", records, after_each)
                changed |= any(r.modified for r in inner.values())
                if entry.rounds > 1 and not any(inner[u].modified for u in entry.until_steps):
                    break
            results[entry.name] = PassResult(modified=changed)
            continue
        name, fn = f"{prefix}{entry[0]}", entry[1]
        start = time.perf_counter()
        try:
            result = fn(model)
        except SdnpuError:
            raise
        except Exception as e:
            raise RuntimeError(f"pass {name!r} failed (after: {_before(records)}): {type(e).__name__}: {e}") from e
        seconds = time.perf_counter() - start
        records.append(PassRecord(name, result, seconds))
        results[entry[0]] = result
        log.info("pass %-12s %5.1f s  %s", name, seconds,
                 ", ".join(f"{k} {v}" for k, v in result.counts.items() if v) or "no change")
        if after_each is not None:
            after_each(name, model)
    return results


def _before(records: list[PassRecord]) -> str:
    """The passes that ran, a group's steps under the group's name, and the group's last step."""
    if not records:
        return "none"
    tops = list(dict.fromkeys(r.name.split("/")[0] for r in records))
    last = records[-1].name
    return ", ".join(tops) + (f" (its last step: {last})" if "/" in last else "")


def records_json(records: list[PassRecord]) -> list[dict[str, object]]:
    """The pass records as plain data (the report stores them)."""
    out: list[dict[str, object]] = []
    for r in records:
        item: dict[str, object] = {"name": r.name, "seconds": round(r.seconds, 3), "counts": dict(r.result.counts)}
        if r.result.regions is not None:
            item["regions"] = [asdict(reg) for reg in r.result.regions]
        out.append(item)
    return out
