"""The offload compiler: one declared pipeline, read top to bottom. ``pipeline`` below is the list, the only
one: the compile stage's log line and the report's pass records are read from it.

    canonicalize  one spelling of every pattern, whatever the exporter wrote
    joint         SD3's joint attention in the form SDMHA takes (passes/joint.py); after canonicalize (one
                  spelling of the norms and the head splits), before fuse (the attention rule reads its form)
    fuse          the big op families -> the target's dispatch ops (passes/fuse.py orders the rules)
    layout        NHWC between dispatch ops; needs the fused ops (it cancels their boundary Transposes)
    glue          the element-wise ops between them -> dispatch ops; after layout, which pushes Transposes
                  through their plain ONNX forms
    views         Reshapes in front of dispatch ops absorbed into them; after glue (every reader is final)
    parallel      linear layers of one input each followed by the same op the registry lacks (Z-Image's tanh
                  gates) -> one layer, one op, one Split (passes/parallel.py); after views, before precision
    precision     bf16 activations, constants as the table stores them, CastAvx at CPU<->NPU edges; needs the
                  final set of dispatch ops (it decides where the edges are)
    cuts          the Slices and Splits left on the CPU, one Split per value and axis (passes/cuts.py); after
                  precision (the parts are bf16 bits between dispatch ops), before cleanup
    handoff       the graph inputs/outputs named in ``CompileOptions.handoff`` (values another dispatch model
                  writes or reads) keep the NPU's form: their edge Transposes and CastAvx go; after
                  precision; only where asked
    cleanup       cast pairs, dead nodes, unused weights, the table check, reference functions
    prologue      the CPU work on the graph inputs named in ``CompileOptions.prologue`` (a step's inputs that
                  another dispatch model reads too) moves into a model of its own, run once for both; after
                  cleanup (the final CPU nodes); only where asked
    partition     NPU regions and the reason for every CPU node; last, it describes the final graph

Every pass after joint reads the target (``CompileOptions.target``): its table says what a dispatch op is.
``sdnpu.passes.modelfile`` loads a model with its weights left on disk and saves the dispatch model;
``sdnpu.convert.compile`` drives a compile from file to report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import onnx_ir as ir
import onnx_ir.passes.common as common

from sdnpu.errors import SdnpuError
from sdnpu.ops.target import DEFAULT_TARGET, Target, get_target
from sdnpu.passes.canonicalize import canonicalize
from sdnpu.passes.cleanup import cleanup
from sdnpu.passes.cuts import gather_cuts
from sdnpu.passes.fuse import fuse
from sdnpu.passes.glue import lower_glue
from sdnpu.passes.handoff import handoff_pass
from sdnpu.passes.joint import joint_attention
from sdnpu.passes.layout import layout
from sdnpu.passes.parallel import join_parallel
from sdnpu.passes.manager import PassFn, PassRecord, PassResult, run_passes
from sdnpu.passes.partition import partition
from sdnpu.passes.precision import PRECISIONS, precision
from sdnpu.passes.prologue import prologue_pass
from sdnpu.passes.views import absorb_views

__all__ = ["CompileOptions", "compile_model", "joint", "pass_names", "pipeline"]

Shapes = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class CompileOptions:
    """What a compile is for: the target and the precision (validated once, here); ``handoff``: graph inputs
    and outputs that another dispatch model writes or reads, kept bf16 in the NPU's layout
    (``sdnpu.formats.handoff``); ``prologue``: graph inputs whose CPU work goes into the step prologue that
    another dispatch model shares (``sdnpu.formats.prologue``); ``shapes``: static shapes for graph inputs
    with dynamic axes, by name (a mapping is taken too)."""

    target: Target = field(default_factory=get_target)
    precision: str = "bf16"
    handoff: frozenset[str] = frozenset()
    prologue: frozenset[str] = frozenset()
    shapes: Shapes = ()

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise SdnpuError(f"unknown precision {self.precision!r}", hint=f"choose one of: {', '.join(PRECISIONS)}")
        if isinstance(self.shapes, Mapping):
            object.__setattr__(self, "shapes", tuple(sorted((k, tuple(int(d) for d in v))
                                                            for k, v in self.shapes.items())))

    @classmethod
    def named(cls, target: str = DEFAULT_TARGET, precision: str = "bf16") -> CompileOptions:
        return cls(get_target(target), precision)

    @property
    def input_shapes(self) -> dict[str, list[int]]:
        """``shapes`` as ``{input: [dims]}``."""
        return {k: list(v) for k, v in self.shapes}


def joint(model: ir.Model) -> PassResult:
    """SD3's MMDiT attention in SDMHA's form (``sdnpu.passes.joint``: one attention per query part, the head
    Transposes below the per-head norms); a graph without joint attention is left as it is."""
    counts = joint_attention(model.graph)
    common.RemoveUnusedNodesPass()(model)
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))


def pipeline(options: CompileOptions) -> list[tuple[str, PassFn]]:
    t = options.target
    return [
        ("canonicalize", canonicalize),
        ("joint", joint),
        ("fuse", lambda m: fuse(m, t)),
        ("layout", layout),
        ("glue", lambda m: lower_glue(m, t)),
        ("views", lambda m: absorb_views(m, t)),
        ("parallel", lambda m: join_parallel(m, t)),
        ("precision", lambda m: precision(m, t, options.precision)),
        ("cuts", lambda m: gather_cuts(m, t)),
        *([("handoff", lambda m: handoff_pass(m, t, options.handoff))] if options.handoff else []),
        ("cleanup", lambda m: cleanup(m, t)),
        *([("prologue", lambda m: prologue_pass(m, t, options.prologue))] if options.prologue else []),
        ("partition", lambda m: partition(m, t)),
    ]


def pass_names(options: CompileOptions) -> list[str]:
    """The passes a compile with ``options`` runs, in order."""
    return [name for name, _ in pipeline(options)]


def compile_model(model: ir.Model, options: CompileOptions | None = None,
                  after_each: Callable[[str, ir.Model], None] | None = None) -> list[PassRecord]:
    return run_passes(model, pipeline(options or CompileOptions()), after_each)
