"""The offload compiler: one declared pipeline, read top to bottom. ``pipeline`` below is the list, the only
one: the compile stage's log line and the report's pass records are read from it.

    canonical     one spelling of every pattern, whatever the exporter wrote: a group of steps (``CANONICAL``
                  below, each timed and recorded as ``canonical/<step>``; passes/canonical/ holds them)
    joint         SD3's joint attention in the form SDMHA takes (passes/joint.py); after canonical (one
                  spelling of the norms and the head splits), before fuse (the attention rule reads its form)
    fuse          the big op families -> the target's dispatch ops (passes/fuse.py orders the rules)
    layout        NHWC between dispatch ops; needs the fused ops (it cancels their boundary Transposes)
    glue          the element-wise ops between them -> dispatch ops; after layout, which pushes Transposes
                  through their plain ONNX forms
    views         Reshapes in front of dispatch ops absorbed into them; after glue (every reader is final)
    frames        a video transformer's token transposes between frames and pixels absorbed: its token-wise ops
                  read the spatial order, its attentions over frames take the pixels as heads
                  (passes/frames.py); after views (it reads the ops' views), before precision
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

A *standard* target (``qnn-htp``: Qualcomm's HTP, which takes standard ONNX ops) has a list of its own,
``standard_pipeline``: its NPU compiles the graph itself, so the passes only bring the graph to the forms it
takes and computes right, then say what it takes:

    prepare       shapes and types inferred for every value, every node named (the table's limits read them)
    htp_f32       float64 inside the graph -> float32 (QNN maps no float64; Flux.1's rotary tables)
    htp_fp16      fp16's range guarded: attention masks' "minus infinity" -> -1e4, and values the fp32 check run
                  found near 65504 scaled into the norms that read them (``CompileOptions.fp16_risks``)
    htp_norms     a broadcast Add / Mul feeding a LayerNormalization in a form QNN's HTP compiles right (its
                  fault on SD3's patch embedding: passes/htp/norms.py)
    htp_recip     x * (1 / d) as x / d: QNN's fused RmsNorm fails on the exported RMS norm (T5, Flux's q/k norms)
    htp_angles    Sin / Cos of x * W (the sinusoidal embeddings) with the angle reduced exactly: the HTP's fp16
                  angle and its Sin / Cos drift past a few hundred radians
    htp_ranks     nodes the table refuses for their rank or type in a form it takes, the same values: a nearest
                  upsampling spelled as rank-6/8 movements (Wan 2.2) as a Resize, a rank-5 reduction (ReduceL2)
                  over a lower-rank view, a Gather of rank-6 data (HiDream's rotary) over a rank-3 view, a bool
                  GatherND (Qwen2's padding mask) on int32, an outer-product Einsum (Flux.1's TorchScript
                  rotary) as a MatMul; and a GatherND of slices of two or more axes (a 3-D VAE's nearest-exact
                  upsampling), which QNN computes wrong, over a view of one (passes/htp/ranks.py)
    htp_rank6     DiT's rank-6 unpatchify as DepthToSpace, any other rank-6 permutation as rank-4 steps (QNN has
                  no rank-6 Reshape or Transpose)
    htp_tokens    an attention over a token count not a multiple of 64 (SD 3.5's 4429) padded to one, the padded
                  keys masked: QNN compiles it in seconds, not many minutes and gigabytes; exact
    htp_heads     an attention whose scores pass 1 GiB in groups of its heads (QNN's compile of SD 3.5's 3.5 GB
                  scores did not fit this machine, nor would they the HTP's address space); exact
    partition     the NPU's regions and the reason for every node its table refuses (what QNN's own compiler
                  then says is the backend's: ``sdnpu.backends``)
``sdnpu.passes.modelfile`` loads a model with its weights left on disk and saves the dispatch model;
``sdnpu.convert.compile`` drives a compile from file to report.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
import onnx_ir.passes.common as common

from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import TARGET_KEY
from sdnpu.ops import qnn_htp
from sdnpu.ops.target import DEFAULT_TARGET, DispatchTarget, Target, get_target
from sdnpu.passes.canonical import (activations, constants, convs, heads, loops, movement, noops, rotary,
                                     sinusoids, tables)
from sdnpu.passes.canonical.driver import sweep
from sdnpu.passes.cleanup import clean_up
from sdnpu.passes.cuts import gather_cuts
from sdnpu.passes.frames import absorb_frame_transposes
from sdnpu.passes.fuse import fuse
from sdnpu.passes.glue import lower_glue
from sdnpu.passes.handoff import drop_handoff_edges
from sdnpu.passes.htp import common as htp_common
from sdnpu.passes.htp import (demote_float64, divide_reciprocal_products, group_attention_heads, guard_fp16_range,
                              lower_pixel_shuffles, lower_rank6_movements, pad_attention_tokens, reduce_angles_exactly,
                              rewrite_broadcast_into_layernorm)
from sdnpu.passes.htp.ranks import (gather_bool_as_int32, gather_nd_flat_slices, lower_gathers, lower_reductions,
                                   lower_refused_einsums)
from sdnpu.passes.joint import split_joint_attention
from sdnpu.passes.layout import lay_out_nhwc
from sdnpu.passes.parallel import join_parallel
from sdnpu.passes.manager import Entry, Group, PassFn, PassRecord, PassResult, entry_name, pass_list_names, run_passes
from sdnpu.passes.partition import partition
from sdnpu.passes.precision import set_precision
from sdnpu.passes.prologue import cut_prologue
from sdnpu.passes.views import absorb_views

log = logging.getLogger(__name__)

__all__ = ["CANONICAL", "TABLES", "CompileOptions", "canonicalize", "compile_model", "pass_names", "pipeline",
           "standard_pipeline"]

Shapes = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class CompileOptions:
    """What a compile is for: the target and the precision (validated once, here); ``handoff``: graph inputs
    and outputs that another dispatch model writes or reads, kept bf16 in the NPU's layout
    (``sdnpu.formats.handoff``); ``prologue``: graph inputs whose CPU work goes into the step prologue that
    another dispatch model shares (``sdnpu.formats.prologue``); ``shapes``: static shapes for graph inputs
    with dynamic axes, by name (a mapping is taken too)."""

    target: Target = field(default_factory=get_target)
    precision: str = ""  # "": the target's first (bf16 for amd-xdna2, fp16 for qnn-htp)
    handoff: frozenset[str] = frozenset()
    prologue: frozenset[str] = frozenset()
    shapes: Shapes = ()
    htp_arch: int | None = None  # qnn-htp: the HTP generation (69, 73, 75, 79, 81; None: 73, Snapdragon X Elite)
    htp_optimization: int | None = None  # qnn-htp: QNN's graph finalization mode (1, 2, 3; None: QNN's default)
    fp16_risks: tuple[tuple[str, float], ...] = ()  # values near fp16's limit in the fp32 run: (name, max |x|)
    unit_gb: float | None = None  # a standard target's weights per compiled unit (GB); None: the target's own

    def __post_init__(self) -> None:
        if not self.precision:
            object.__setattr__(self, "precision", self.target.precisions[0])
        if self.precision not in self.target.precisions:
            raise SdnpuError(f"target {self.target.name} has no precision {self.precision!r}",
                             hint=f"choose one of: {', '.join(self.target.precisions)}")
        if self.htp_arch is not None:
            if self.target.name != qnn_htp.NAME:
                raise SdnpuError(f"--htp-arch is for --target {qnn_htp.NAME}, not {self.target.name}")
            object.__setattr__(self, "htp_arch", qnn_htp.arch(self.htp_arch).arch)
        if self.htp_optimization is not None:
            if self.target.name != qnn_htp.NAME:
                raise SdnpuError(f"--htp-optimization is for --target {qnn_htp.NAME}, not {self.target.name}")
            object.__setattr__(self, "htp_optimization", qnn_htp.arch(None, self.htp_optimization).optimization)
        if self.unit_gb is not None:
            if getattr(self.target, "unit_gb", None) is None:
                raise SdnpuError(f"--context-gb is for --target {qnn_htp.NAME}, not {self.target.name}")
            if not self.unit_gb > 0:
                raise SdnpuError(f"--context-gb must be more than 0, not {self.unit_gb}")
        if isinstance(self.shapes, Mapping):
            object.__setattr__(self, "shapes", tuple(sorted((k, tuple(int(d) for d in v))
                                                            for k, v in self.shapes.items())))

    @classmethod
    def named(cls, target: str = DEFAULT_TARGET, precision: str | None = None, htp_arch: int | str | None = None,
              unit_gb: float | None = None, htp_optimization: int | str | None = None) -> CompileOptions:
        return cls(get_target(target), precision or "", htp_arch=htp_arch,  # type: ignore[arg-type]
                   unit_gb=unit_gb, htp_optimization=htp_optimization)  # type: ignore[arg-type]

    @property
    def input_shapes(self) -> dict[str, list[int]]:
        """``shapes`` as ``{input: [dims]}``."""
        return {k: list(v) for k, v in self.shapes}


# The tables' steps (passes/canonical/tables.py): the CPU work on the graph's inputs alone, in as few nodes as it
# takes. Each step reads the edge region afresh.
TABLES = Group("tables", [
    Group("rounds", [  # again until a round changes neither: sinking one Concat's unary ops can leave two
        ("sink_unary", tables.sink_unary_ops),  # nodes the same, and a repeat gone can free a chain to sink
        ("once", tables.compute_repeats_once),
        ("sweep", sweep),
    ], rounds=16, until=("sink_unary", "once")),
    ("chains", tables.collapse_table_chains),
    ("sweep", sweep),
    ("once", tables.compute_repeats_once),  # what collapsed chains compute twice, once (the rounds left none else)
    ("sweep", sweep),
    ("float32", tables.demote_float64_tables),
    ("sweep", sweep),
])

# The canonical steps, in the order they run (the order constraints beside them). Each is a pass of its own:
# timed and recorded as ``canonical/<step>``; the fixpoint loops are groups with their bound.
CANONICAL = Group("canonical", [
    ("opset", constants.raise_opset),  # first: the converter may write a new graph; notes its outputs for finish
    ("constants", constants.lift_constants),
    ("shapes", constants.infer_shapes),  # TorchScript's graphs carry no intermediate shapes; the folder needs them
    ("fold", constants.fold_constants),
    ("shapes", constants.infer_shapes),
    ("where_rows", noops.rewrite_where_as_arithmetic),  # before the small folder, which folds its fill * mask
    ("bool_where", noops.rewrite_bool_where),  # onnxruntime runs no boolean Where
    Group("fold_rounds", [  # folding one node can make the next one's inputs constant, or its shapes known
        ("shapes", constants.infer_shapes),
        ("fold_small", constants.fold_small),
    ], rounds=10, until="fold_small"),
    ("identities", noops.drop_identities),
    ("names", constants.name_nodes),  # every node named: CPU reasons and regions refer to nodes by name
    ("shapes", constants.infer_shapes),
    ("to_reshape", movement.reshape_squeezes),
    ("perm", movement.write_out_perms),
    ("neutral", noops.drop_neutral),
    ("casts", noops.drop_noop_casts),
    ("expands", noops.drop_noop_expands),
    ("sink_expands", noops.sink_expands),  # before broadcast_expands, which then drops them where they end
    ("broadcast_expands", noops.drop_broadcast_expands),
    ("moves", noops.drop_noop_moves),  # where_rows leaves it the masks that pick one side everywhere
    ("softmax_guards", noops.drop_softmax_guards),
    ("tiles", movement.concat_tiles),
    ("concat_parts", movement.select_concat_parts),  # a Gather of one Concat operand (SVD's frame-0 context)
    ("reciprocals", activations.use_reciprocals),
    ("erf_gelu", activations.collapse_erf_gelu),
    ("tanh_gelu", activations.collapse_tanh_gelu),
    ("pad_conv", movement.merge_pad_into_conv),
    ("conv_views", convs.view_convs_as_2d),  # after pad_conv: a causal Conv3d's frame padding is its own
    ("gathers", movement.resize_nearest_gathers),
    ("repeated_pixels", movement.resize_repeated_pixels),
    ("einsum", movement.lower_einsum),
    ("assembled", loops.concat_assembled_values),  # per-item loops written out, as the batched movement they are
    ("stacked", loops.batch_stacked_chains),
    ("sweep", sweep),
    ("scatter_phases", movement.interleave_row_scatters),  # before scatter_rows: a chain whole, not its first block
    ("scatter_rows", movement.concat_row_scatters),
    ("unflip", sinusoids.unflip_concat),  # before sincos, which then reads Concat(Cos, Sin) as it is
    ("sincos", sinusoids.merge_sinusoids),
    ("column_chains", sinusoids.merge_column_chains),  # after sincos, whose one-Sin chains it merges
    ("broadcasts", movement.merge_broadcast_chains),
    ("sweep", sweep),  # the sinusoids' old halves still read the timestep's Expand
    ("expand_consts", movement.fold_expands_into_constants),  # after broadcasts: one Expand of the timestep
    ("sweep", sweep),
    TABLES,  # the CPU work on the inputs alone, in as few nodes as it takes
    ("broadcast_expands", noops.drop_broadcast_expands),  # the repeats the tables write as an Expand
    ("rotary", rotary.write_rotations_as_matmuls),  # after tables: the edge region it leaves alone is the tables' form
    ("heads", heads.sink_head_transposes),  # after rotary, whose MatMul it moves the head Transpose past
    ("head_repeats", movement.concat_head_repeats),  # after heads, which brings the repeat to [B, S, Hkv, 1, D]
    ("sweep", sweep),
    Group("crop_rounds", [  # again until a round crops nothing: a crop can make another node's input constant
        ("crop", constants.crop_constants),
        ("sweep", sweep),
    ], rounds=8, until="crop"),
    ("finish", constants.finish_canonical_form),  # last: the output names, the crops' record, unused nodes and weights
])


def canonicalize(model: ir.Model) -> PassResult:
    """The canonical steps alone (``CANONICAL``), their counts summed (for tests and tools that start from the
    canonical form; a compile runs them as part of ``pipeline``)."""
    records = run_passes(model, [CANONICAL])
    counts: dict[str, int] = {}
    for r in records:
        for k, v in r.result.counts.items():
            counts[k] = counts.get(k, 0) + v
    return PassResult(modified=any(r.result.modified for r in records), counts=counts)


def prepare(model: ir.Model, target: Target) -> PassResult:
    """Constant nodes as initializers (onnxruntime makes them so before QNN sees the graph), shapes and types for
    every value, every node named (the standard target's limits read them), the target recorded."""
    lifted = common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model).modified
    common.ShapeInferencePass(strict_mode=False)(model)
    filled = _filled_constants(model)
    rounds = 0
    # shape arithmetic folded (TorchScript's Slice bounds, a Shape of a Reshape's output), as onnxruntime folds it
    # before QNN sees it; again after shape inference, which a fold's constants let see further (CogView4's
    # TorchScript unpatchify: a Reshape to a folded shape, then a Shape of its Transpose, then a Reshape to that)
    while rounds < _FOLD_ROUNDS:
        with np.errstate(all="ignore"):
            try:
                folded = onnxscript.optimizer.fold_constants(model).modified
            except Exception as e:  # an op its folder cannot evaluate: the graph goes on as it is
                log.warning("onnxscript's constant folder stopped (%s: %s)", type(e).__name__, str(e)[:200])
                folded = False
        if not folded:
            break
        rounds += 1
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
        common.ShapeInferencePass(strict_mode=False)(model)
    named = common.NameFixPass()(model).modified
    model.metadata_props[TARGET_KEY] = target.name
    filled += _filled_constants(model)  # shapes the folds made constant
    return PassResult(modified=named or lifted or bool(rounds) or bool(filled), counts={
        "nodes and values named": int(named), "Constant nodes -> initializers": int(lifted),
        "constant folding rounds": rounds, "ConstantOfShape of a constant shape -> initializer": filled})


_FOLD_ROUNDS = 4  # each round a fold, then shape inference; graphs seen need two
_FILL_LIMIT = 1 << 24  # bytes: a ConstantOfShape up to this size becomes the initializer it makes


def _filled_constants(model: ir.Model) -> int:
    """``ConstantOfShape`` of a constant shape as the initializer it makes, up to ``_FILL_LIMIT``: onnxruntime
    folds it before QNN sees the graph, onnxscript's folder leaves it (it does not materialize fills; the
    expanded LayerNorm of ONNX's function bodies counts its reduced axes so). Returns how many."""
    graph, done = model.graph, 0
    for node in list(graph):
        if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        shape = node.inputs[0].const_value if node.inputs[0] is not None else None
        if shape is None or node.outputs[0].is_graph_output():  # the graph's own output keeps its node
            continue
        dims = [int(d) for d in np.asarray(shape.numpy()).reshape(-1)]
        attr = node.attributes.get("value")
        fill = np.asarray(attr.as_tensor().numpy()).reshape(-1) if attr is not None else np.zeros(1, np.float32)
        if min(dims, default=1) < 0 or int(np.prod(dims, dtype=np.int64)) * fill.itemsize > _FILL_LIMIT:
            continue
        value = np.full(dims, fill[0], dtype=fill.dtype)
        out = node.outputs[0]
        const = htp_common.constant(graph, value, out.name or "filled")
        out.replace_all_uses_with(const)
        graph.remove(node, safe=True)
        done += 1
    return done


def _named(model: ir.Model) -> PassResult:
    """The nodes and values the canonical rewrites a standard target borrows leave unnamed, named (the table's
    reasons and QNN's op trace name nodes); names already given stay as they are (the fp16 headroom list reads
    values by name, and a pass may keep a value's name on purpose)."""
    graph = model.graph
    for node in graph:
        if not node.name:
            node.name = htp_common.node_name(graph, f"{node.op_type}_htp")
        for v in node.outputs:
            if not v.name:
                v.name = htp_common.unique_name(graph, node.name)
    return PassResult(modified=False, counts={})


def _all(*results: PassResult) -> PassResult:
    """Several passes' results as one row: modified where any was, their counts side by side."""
    return PassResult(modified=any(r.modified for r in results),
                      counts={k: v for r in results for k, v in r.counts.items()})


def standard_pipeline(options: CompileOptions) -> list[Entry]:
    """The pass list of a standard target (see the module's docstring)."""
    t = options.target
    return [
        ("prepare", lambda m: prepare(m, t)),
        ("htp_f32", demote_float64),
        ("htp_fp16", lambda m: guard_fp16_range(m, dict(options.fp16_risks))),
        ("htp_norms", rewrite_broadcast_into_layernorm),
        ("htp_recip", divide_reciprocal_products),
        ("htp_angles", reduce_angles_exactly),
        ("htp_ranks", lambda m: _all(movement.resize_repeated_pixels(m), sweep(m), lower_reductions(m, t),
                                     lower_gathers(m, t), gather_bool_as_int32(m, t), lower_refused_einsums(m, t),
                                     gather_nd_flat_slices(m), _named(m))),  # before rank6's movements
        ("htp_rank6", lambda m: _all(lower_pixel_shuffles(m), lower_rank6_movements(m))),
        ("htp_tokens", pad_attention_tokens),  # before the head groups, which then split the padded form
        ("htp_heads", group_attention_heads),
        ("partition", lambda m: partition(m, t)),
    ]


def pipeline(options: CompileOptions) -> list[Entry]:
    t = options.target
    if t.kind == "standard":
        return standard_pipeline(options)
    assert isinstance(t, DispatchTarget)
    return [
        CANONICAL,
        ("joint", split_joint_attention),
        ("fuse", lambda m: fuse(m, t)),
        ("layout", lay_out_nhwc),
        ("glue", lambda m: lower_glue(m, t)),
        ("views", lambda m: absorb_views(m, t)),
        ("frames", lambda m: absorb_frame_transposes(m, t)),
        ("parallel", lambda m: join_parallel(m, t)),
        ("precision", lambda m: set_precision(m, t, options.precision)),
        ("cuts", lambda m: gather_cuts(m, t)),
        *([("handoff", lambda m: drop_handoff_edges(m, t, options.handoff))] if options.handoff else []),
        ("cleanup", lambda m: clean_up(m, t)),
        *([("prologue", lambda m: cut_prologue(m, t, options.prologue))] if options.prologue else []),
        ("partition", lambda m: partition(m, t)),
    ]


def pass_names(options: CompileOptions, steps: bool = True) -> list[str]:
    """The passes a compile with ``options`` runs, in order: every step (a group's as ``group/step``, a repeated
    group's once, under its bound: ``canonical/fold_rounds[<=10]/fold_small``), or with ``steps`` False the
    top-level passes alone (``canonical``, ``joint``, ...)."""
    entries = pipeline(options)
    if not steps:
        return [entry_name(e) for e in entries]
    return list(pass_list_names(entries))


def compile_model(model: ir.Model, options: CompileOptions | None = None,
                  after_each: Callable[[str, ir.Model], None] | None = None) -> list[PassRecord]:
    return run_passes(model, pipeline(options or CompileOptions()), after_each)


def stitched_pipeline(options: CompileOptions) -> list[tuple[str, PassFn]]:
    """What runs on a dispatch model stitched from the pieces of a block-by-block conversion
    (``sdnpu.convert.blockwise``), each piece compiled by ``pipeline``:

        seams      the views a seam left between dispatch ops absorbed (a piece's output viewed back to its own
                   shape, now read by the next piece's op: ``passes.views``)
        prologue   the CPU work on ``CompileOptions.prologue`` cut into a model of its own (Flux.1's rotary
                   tables, which the first piece computes and hands to every block: in a piece they are a graph
                   output, so only the stitched model has a prologue); only where asked
        partition  the regions again over the whole (each piece numbered its own from 0; the blocks' regions
                   meet where the casts between them went)"""
    t = options.target
    assert isinstance(t, DispatchTarget), "a standard target's pieces are compiled one by one, not stitched"
    return [
        ("seams", lambda m: absorb_views(m, t)),
        *([("prologue", lambda m: cut_prologue(m, t, options.prologue))] if options.prologue else []),
        ("partition", lambda m: partition(m, t)),
    ]
