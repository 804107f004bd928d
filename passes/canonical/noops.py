"""Neutral and no-op removal: what computes nothing goes, so that the rules see the op that does.

- Identity nodes go (their readers read the input);
- x * 1, x / 1 and x + 0 are x (a resnet's output_scale_factor of 1, as TorchScript writes it); a weight that
  happens to hold ones or zeros stays: the graph's form never depends on a parameter's values;
- a Cast to the type its input has already is its input;
- an Expand or a chain of Reshapes to the shape its input has moves nothing (TorchScript's grouped-query
  repeat at one group per head); an Expand whose readers all broadcast anyway (element-wise ops, Where)
  goes where their outputs keep their shapes;
- movements that move nothing given their constant parameters: a Where whose condition picks one side
  everywhere, a one-part Split, a Pad of zeros, a ScatterElements that overwrites a whole constant in place, a
  Resize to the size it has, a DepthToSpace / SpaceToDepth of blocks of one; a Gather of a size-1 axis becomes
  a Reshape (Z-Image's and Lumina 2's token padding where nothing is padded);
- where some rows are padded, a Where of a constant mask and a constant pad token is a Mul and an Add (which
  go to the NPU);
- a softmax's NaN guard (``Where(IsNaN(p), 0, p)``) goes where no row can be all masked.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.formats.weights import INLINE_LIMIT
from sdnpu.passes import provenance
from sdnpu.passes.canonical.driver import RULE, graph_of, node_rewrite
from sdnpu.passes.irutil import Builder, attr, const, reroute, scalar, static_shape


@node_rewrite("identities dropped", "Identity")
def drop_identities(node: ir.Node) -> bool:
    """Identity nodes go: their readers read the input; an Identity writing a graph output gives its name to
    the input value. Kept: one whose input is itself a graph output, a graph input or an initializer (the
    graph returns one value under two names). onnx_ir's IdentityEliminationPass renames a graph output
    there too, and the graph loses one of its two outputs."""
    if node.inputs[0] is None:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if y.is_graph_output() and (x.is_graph_output() or x.is_graph_input() or x.is_initializer()):
        return False
    if x.shape is None:
        x.shape = y.shape
    if x.type is None:
        x.type = y.type
    name = y.name
    y.replace_all_uses_with(x, replace_graph_outputs=True)
    graph_of(node).remove(node, safe=True)
    if x.is_graph_output():
        x.name = name
    return True


@node_rewrite("x*1, x/1, x+0 removed", "Mul", "Div", "Add")
def drop_neutral(node: ir.Node) -> bool:
    """x * 1, x / 1 and x + 0 (a resnet's output_scale_factor of 1, as TorchScript writes it) are x. A weight
    that happens to hold ones or zeros (a seeded norm's gamma, a zero-initialized bias) is a tensor, not a
    scalar, and stays: the graph's form never depends on a parameter's values."""
    if len(node.inputs) != 2:
        return False
    x, c = node.inputs
    neutral = 0.0 if node.op_type == "Add" else 1.0
    if scalar(c) != neutral or x is None or static_shape(x) != static_shape(node.outputs[0]):
        return False
    out = node.outputs[0]
    if out.is_graph_output() or x.dtype != out.dtype:
        return False
    out.replace_all_uses_with(x)
    return True


@node_rewrite("casts to the same type dropped", "Cast")
def drop_noop_casts(node: ir.Node) -> bool:
    """A Cast to the type its input has already (diffusers' rotary embedding's ``x.float()`` on an fp32
    graph; a dtype round trip the exporter kept) is its input."""
    if node.inputs[0] is None:
        return False
    x, y = node.inputs[0], node.outputs[0]
    if x.dtype is None or int(x.dtype) != attr(node, "to") or y.is_graph_output():
        return False
    y.replace_all_uses_with(x)
    return True


# the ops that broadcast their inputs against each other (numpy's rules): an Expand in front of one is redundant
# where the broadcast gives the output its shape anyway
BROADCASTING = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "Where", "And",
                           "Or", "Xor", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "BitShift"})


@node_rewrite("expands into broadcasting readers dropped", "Expand", sweep_after=True)
def drop_broadcast_expands(node: ir.Node) -> bool:
    """An Expand whose every reader broadcasts its inputs anyway (element-wise Add / Mul / Sub / Div / Pow /
    Max / Min, the comparisons and logic ops, Where) goes where each reader's output keeps its shape with the
    unexpanded input: the reader computes the same elements from the same values (each output element reads the
    one input element the Expand would have copied there). A transformers causal mask expanded to [B, 1, S, S]
    before its Where, a padding mask expanded before the Add of the scores. An Expand read by anything else
    stays (the head repeat is a Concat: ``movement.concat_head_repeats``), its CPU reason the registry's."""
    x, y = node.inputs[0], node.outputs[0]
    uses = list(y.uses())
    if x is None or y.is_graph_output() or not uses or static_shape(x) is None or x.dtype != y.dtype:
        return False
    for use in uses:
        shapes = _without_expand(use.node, x, y)
        if shapes is None or shapes[0] != shapes[1]:
            return False
    y.replace_all_uses_with(x)
    graph_of(node).remove(node, safe=True)
    return True


def _without_expand(reader: ir.Node, x: ir.Value, y: ir.Value) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """For an element-wise ``reader`` of ``y = Expand(x)``: (the shape its inputs broadcast to with ``x`` in
    ``y``'s place, its output's shape); None where it is no broadcasting op or a shape is unknown."""
    if reader.op_type not in BROADCASTING or reader.domain not in ("", "ai.onnx"):
        return None
    out = static_shape(reader.outputs[0])
    shapes = [static_shape(v) if v is not y else static_shape(x) for v in reader.inputs if v is not None]
    if out is None or any(s is None for s in shapes):
        return None
    try:
        return tuple(np.broadcast_shapes(*shapes)), tuple(out)  # type: ignore[arg-type]
    except ValueError:
        return None


@node_rewrite("expands moved below element-wise ops", "Expand", sweep_after=True)
def sink_expands(node: ir.Node) -> bool:
    """An Expand read by one element-wise op alone whose output the Expand widens (a key-padding mask
    expanded over the heads and queries before its ``Where(mask, 0, -inf)``: Lumina-Next's) moves below it:
    the op on the unexpanded input, then the Expand; the same elements, each computed once. It goes on down
    while that holds, and below a Reshape or a Split that keeps its widened leading axes apart
    (``_expand_below_movement``); an Expand every reader of which broadcasts anyway then goes
    (``drop_broadcast_expands``, the next step), and the scores' addend is the key row it is."""
    graph = graph_of(node)
    moved = False
    while True:
        x, y = node.inputs[0], node.outputs[0]
        uses = list(y.uses())
        if x is None or y.is_graph_output() or len(uses) != 1 or static_shape(x) is None:
            return moved
        r = uses[0].node
        if r.domain in ("", "ai.onnx") and r.op_type in ("Reshape", "Split"):
            if not _goes_on(r):
                return moved
            wide = _expand_below_movement(graph, node, r)
            if not wide:
                return moved
            if len(wide) > 1:  # a Split's parts: each Expand goes on down on its own
                for part in wide:
                    sink_expands.rewrite(part)
                return True
            node, moved = wide[0], True
            continue
        shapes = _without_expand(r, x, y)
        if shapes is None or len(r.outputs) != 1 or r.outputs[0].is_graph_output():
            return moved
        small, out = shapes
        if small == out:
            return moved  # it broadcasts anyway: the Expand goes (``drop_broadcast_expands``)
        b = Builder(graph, RULE)
        inner = b.op(r.op_type, [x if v is y else v for v in r.inputs], {k: a.value for k, a in r.attributes.items()},
                     dtype=r.outputs[0].dtype, shape=list(small)).outputs[0]
        wide = b.op("Expand", [inner, b.const(np.asarray(out, np.int64), "shape")], dtype=r.outputs[0].dtype,
                    shape=list(out))
        graph.insert_before(r, b.nodes)
        r.outputs[0].replace_all_uses_with(wide.outputs[0])
        node, moved = wide, True


def _broadcasting(node: ir.Node) -> bool:
    return node.op_type in BROADCASTING and node.domain in ("", "ai.onnx")


def _goes_on(r: ir.Node) -> bool:
    """Whether an Expand moved below the Reshape or Split ``r`` then goes (``_drops_below``), rather than stop at a
    reader that needs it where it was: SVD's context repeated over the pixels for the K and V of its frames'
    cross-attention (``passes/frames.py`` reads it as that Expand), a UNet's timestep expanded over the batch
    before its sinusoid (``canonical/sinusoids`` reads that)."""
    return all(_drops_below(o) for o in r.outputs)


def _drops_below(v: ir.Value, depth: int = 8) -> bool:
    """Whether an Expand writing ``v`` would go: every reader is element-wise and either broadcasts it anyway
    (another operand has the reader's output shape) or, read alone, passes it on to readers that do; a Split's
    every part likewise."""
    uses = list(v.uses())
    if not uses or v.is_graph_output() or depth < 0:
        return False
    for use in uses:
        r = use.node
        if r.op_type == "Split" and r.domain in ("", "ai.onnx") and use.idx == 0:
            if not all(_drops_below(o, depth - 1) for o in r.outputs):
                return False
            continue
        if not _broadcasting(r) or len(r.outputs) != 1:
            return False
        out = static_shape(r.outputs[0])
        if out is not None and any(x is not None and x is not v and static_shape(x) == out for x in r.inputs):
            continue  # it broadcasts the Expand's input anyway: the Expand goes here
        if len(uses) != 1 or not _drops_below(r.outputs[0], depth - 1):
            return False
    return True


def _expand_below_movement(graph: ir.Graph, expand: ir.Node, r: ir.Node) -> list[ir.Node]:
    """``r`` (a Reshape or a Split, the Expand's one reader) on the Expand's input, then Expands: where the
    Expand widens only leading axes ([1, .., 1, rest] -> [n1, .., nk, rest]) and the Reshape keeps that block
    apart (its output [m1, .., mj, rest'] with m1 * .. * mj = n1 * .. * nk), or the Split cuts an axis the
    Expand leaves. Latte repeats its timestep's modulation for every pixel before it views and chunks it: the
    chunks are then the [1, 1, C] rows every token broadcasts. The new Expands (one per output; none: no move)."""
    x, y = expand.inputs[0], expand.outputs[0]
    sx, sy = static_shape(x), static_shape(y)
    outs = [static_shape(o) for o in r.outputs]
    if x is None or sx is None or sy is None or any(o is None or v.is_graph_output() for o, v in zip(outs, r.outputs)):
        return []
    full = (1,) * (len(sy) - len(sx)) + tuple(sx)
    if len(full) != len(sy):
        return []
    wide = [i for i, (a, b) in enumerate(zip(full, sy)) if a != b]
    k = max(wide) + 1 if wide else 0
    if not wide or any(full[i] != 1 for i in range(k)):
        return []  # not a block of leading axes from 1
    b = Builder(graph, RULE)
    if r.op_type == "Reshape":
        so = outs[0]
        lead = int(np.prod(sy[:k]))
        j = next((j for j in range(len(so) + 1) if int(np.prod(so[:j])) == lead), None)  # type: ignore[index]
        if j is None or int(np.prod(so[j:])) != int(np.prod(sy[k:])):  # type: ignore[index]
            return []
        small = [1] * j + list(so[j:])  # type: ignore[index]
        inner = b.op("Reshape", [x, b.const(np.asarray(small, np.int64), "shape")], dtype=y.dtype, shape=small)
        new = b.op("Expand", [inner.outputs[0], b.const(np.asarray(so, np.int64), "shape")], dtype=y.dtype,
                   shape=list(so))  # type: ignore[arg-type]
        graph.insert_before(r, b.nodes)
        r.outputs[0].replace_all_uses_with(new.outputs[0])
        return [new]
    axis = int(r.attributes["axis"].value) if "axis" in r.attributes else 0
    axis %= len(sy)
    if axis < k or len(sx) != len(sy):
        return []  # a cut of a widened axis; or x of a lower rank (a Reshape first)
    attrs = {key: a.value for key, a in r.attributes.items()}
    parts = b.op("Split", [x, *r.inputs[1:]], attrs, n_out=len(r.outputs))
    news = []
    for part, old, shape in zip(parts.outputs, r.outputs, outs, strict=True):
        small = [1] * k + list(shape[k:])  # type: ignore[index]
        part.dtype, part.shape = y.dtype, ir.Shape(small)
        news.append(b.op("Expand", [part, b.const(np.asarray(shape, np.int64), "shape")], dtype=y.dtype,
                         shape=list(shape)))  # type: ignore[arg-type]
    graph.insert_before(r, b.nodes)
    for old, new in zip(r.outputs, news, strict=True):
        old.replace_all_uses_with(new.outputs[0])
    return news


@node_rewrite("expands and reshapes to the same shape dropped", "Expand", "Reshape", sweep_after=True)
def drop_noop_expands(node: ir.Node) -> bool:
    """An Expand whose output has its input's static shape moves nothing, nor does a Reshape (or a chain of
    them) whose literal target is the shape it started from: TorchScript's attention expands k and v to the
    [B, H, S, D] they have already and reshapes them to it (grouped-query attention's repeat, at one group per
    head), shapes that onnxscript's folder did not know yet. A target with -1 or 0 stays, as the folder leaves
    it (GroupNorm's [B, G, -1], which the norm rule reads)."""
    if node.inputs[0] is None:
        return False
    x, y = node.inputs[0], node.outputs[0]
    sx, sy, target = static_shape(x), static_shape(y), const(node.inputs[1])
    if sx is None or target is None or x.dtype != y.dtype:
        return False
    if node.op_type == "Reshape":  # a chain of reshapes back to the shape it started from
        start = x
        while (p := start.producer()) is not None and p.op_type == "Reshape" and p.domain in ("", "ai.onnx") \
                and p.inputs[0] is not None and len(start.uses()) == 1 and not start.is_graph_output():
            start = p.inputs[0]
        literal = [int(d) for d in target.reshape(-1)]
        if static_shape(start) is None or literal != list(static_shape(start)):  # type: ignore[arg-type]
            return False
        x = start
    else:
        try:
            out = tuple(np.broadcast_shapes(tuple(sx), tuple(int(d) for d in target.reshape(-1))))
        except ValueError:
            return False
        if out != tuple(sx) or (sy is not None and tuple(sy) != out):
            return False
    graph = graph_of(node)
    reroute(graph, y, x)
    graph.remove(node, safe=True)
    return True


def _noop_source(node: ir.Node) -> ir.Value | ir.Node | None:
    """What a data movement with constant parameters leaves as it is: the value it passes on unchanged, or
    for a Gather of the one row of a size-1 axis the node to become a Reshape; None where it moves data."""
    x, y = node.inputs[0] if node.inputs else None, node.outputs[0]
    sy = static_shape(y)
    if sy is None:
        return None
    op = node.op_type
    if op == "Where":  # a constant condition that picks one side everywhere (a pad mask with nothing padded)
        cond = const(node.inputs[0])
        if cond is None or cond.size == 0 or not (cond.all() or not cond.any()):
            return None
        picked = node.inputs[1] if cond.all() else node.inputs[2]
        return picked if picked is not None and static_shape(picked) == sy and picked.dtype == y.dtype else None
    if x is None or static_shape(x) is None:
        return None
    if op == "Split" and len(node.outputs) == 1:
        return x if static_shape(x) == sy else None
    if op == "Pad":
        pads = const(node.inputs[1]) if len(node.inputs) > 1 else None
        return x if pads is not None and not pads.any() and static_shape(x) == sy else None
    if op == "ScatterElements" and attr(node, "reduction", "none") == "none":
        # every element of a constant overwritten once, in place: the updates themselves (torch's
        # select_scatter into a new tensor of one row)
        data, idx, upd = node.inputs[0], const(node.inputs[1]), node.inputs[2]
        if data is None or data.const_value is None or idx is None or upd is None or static_shape(upd) != sy:
            return None
        axis = int(attr(node, "axis", 0)) % len(sy)
        iota = np.arange(sy[axis]).reshape([-1 if i == axis else 1 for i in range(len(sy))])
        return upd if idx.shape == tuple(sy) and np.array_equal(np.where(idx < 0, idx + sy[axis], idx),
                                                                 np.broadcast_to(iota, sy)) else None
    if op == "Resize" and static_shape(x) == sy and not attr(node, "antialias", 0) and \
            attr(node, "coordinate_transformation_mode", "half_pixel") != "tf_crop_and_resize":
        return x  # to the size it has: every mode samples each value at its own place (a kernel's weight 1 there)
    if op in ("DepthToSpace", "SpaceToDepth") and attr(node, "blocksize", 0) == 1:
        return x  # blocks of one value
    if op == "Gather":  # the one row of a size-1 axis: a Reshape that drops it
        idx = const(node.inputs[1])
        sx = static_shape(x)
        axis = int(attr(node, "axis", 0)) % len(sx)  # type: ignore[arg-type]
        if idx is not None and idx.size == 1 and int(idx.reshape(-1)[0]) in (0, -1) and sx[axis] == 1:  # type: ignore[index]
            return node
    return None


@node_rewrite("movements that move nothing dropped", "Where", "Split", "Pad", "ScatterElements", "Gather", "Resize",
              "DepthToSpace", "SpaceToDepth", sweep_after=True)
def drop_noop_moves(node: ir.Node) -> bool:
    """Data movements that move nothing, given their constant parameters: a Where whose constant condition
    picks one side everywhere, a Split into one part, a Pad of zeros, a ScatterElements that overwrites every
    element of a constant once in place, a Resize to the size it has, a DepthToSpace or SpaceToDepth of blocks
    of one, and a Gather of the one row of a size-1 axis (a Reshape, which a dispatch op reads as a view).
    Z-Image's and Lumina 2's token padding, at a size where nothing is padded."""
    if len(node.outputs) != 1:
        return False
    src = _noop_source(node)
    if src is None:
        return False
    graph = graph_of(node)
    y = node.outputs[0]
    if isinstance(src, ir.Node):  # the Gather -> Reshape
        b = Builder(graph, RULE)
        shape = list(static_shape(y))  # type: ignore[arg-type]
        r = b.op("Reshape", [node.inputs[0], b.const(np.asarray(shape, np.int64), "shape")], dtype=y.dtype,
                 shape=shape)
        graph.insert_before(node, b.nodes)
        reroute(graph, y, r.outputs[0])
    else:
        reroute(graph, y, src)
    graph.remove(node, safe=True)
    return True


@node_rewrite("Where over constant rows -> Mul, Add", "Where")
def rewrite_where_as_arithmetic(node: ir.Node) -> bool:
    """``Where(mask, fill, x)`` with a constant mask and a constant fill (a pad token written over the padded
    rows: Z-Image's and Lumina 2's captions) is ``x * keep + fill * mask``, with ``keep = 1 - mask``: a Mul
    and an Add that go to the NPU, where a Where stays on the CPU with a cast each way. ``fill * mask`` is
    folded next (a constant of the output's shape). Exact where x is finite (x * 1 = x, x * 0 + fill = fill);
    either side may be the constant one."""
    cond, a, b_ = node.inputs
    c = const(cond)
    y = node.outputs[0]
    if c is None or a is None or b_ is None or y.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
        return False
    if (a.const_value is None) == (b_.const_value is None) or c.all() or not c.any():
        return False  # both or neither constant; a mask that picks one side everywhere: drop_noop_moves
    fill, x, fill_where = (a, b_, c) if a.const_value is not None else (b_, a, ~c)
    if not np.isfinite(fill.const_value.numpy()).all():  # type: ignore[union-attr]
        return False  # -inf * 0 is NaN: a causal mask's fill stays a Where (ONNX's FlexAttention test)
    if fill_where.size > INLINE_LIMIT:
        return False  # its product with the fill could not be replayed from the record (LoRA overlays)
    graph = graph_of(node)
    dtype = np.float32 if y.dtype == ir.DataType.FLOAT else np.float16
    bld = Builder(graph, RULE)
    keep = bld.const((~fill_where).astype(dtype), f"{node.name}_keep")
    where = bld.const(fill_where.astype(dtype), f"{node.name}_fill_rows")
    provenance.set_origin(where, provenance.inline(fill_where.astype(dtype)))  # replays: fill * mask
    kept = bld.op("Mul", [x, keep], dtype=y.dtype, shape=None).outputs[0]
    filled = bld.op("Mul", [fill, where], dtype=y.dtype, shape=None).outputs[0]
    out = bld.op("Add", [kept, filled], dtype=y.dtype, shape=static_shape(y)).outputs[0]
    graph.insert_before(node, bld.nodes)
    reroute(graph, y, out)
    graph.remove(node, safe=True)
    return True


@node_rewrite("Where of booleans -> And, Or, Not", "Where")
def rewrite_bool_where(node: ir.Node) -> bool:
    """``Where(c, a, b)`` of booleans (dynamo's ``mask.masked_fill(idx, False)``: HunyuanVideo's token mask) is
    ``Or(And(c, a), And(Not(c), b))``; a scalar constant branch drops its term or its And (``Where(c, False, b)``
    is ``And(Not(c), b)``: a dropped branch is a scalar, so the terms broadcast to the Where's shape).
    onnxruntime has no boolean Where kernel, so a dispatch model keeping it could not run; the same values."""
    cond, a, b_ = node.inputs
    y = node.outputs[0]
    if cond is None or a is None or b_ is None or ir.DataType.BOOL not in (y.dtype, a.dtype) \
            or a.dtype not in (None, ir.DataType.BOOL) or b_.dtype not in (None, ir.DataType.BOOL):
        return False  # the branches' type is the output's (an export without its shapes may not say it)
    graph = graph_of(node)
    bld = Builder(graph, RULE)

    def op(kind: str, *xs: ir.Value) -> ir.Value:
        shapes = [static_shape(x) for x in xs]
        out = None if any(sh is None for sh in shapes) else list(np.broadcast_shapes(*shapes))  # type: ignore[misc]
        return bld.op(kind, list(xs), dtype=ir.DataType.BOOL, shape=out).outputs[0]

    terms: list[ir.Value] = []
    for pick, value in ((cond, a), (None, b_)):
        k = const(value)
        if k is not None and k.size == 1 and not bool(k.reshape(())):
            continue  # this side gives False: no term
        pick = pick if pick is not None else op("Not", cond)
        terms.append(pick if k is not None and k.size == 1 else op("And", pick, value))
    if not terms:
        return False  # Where(c, False, False): left as written
    out = terms[0] if len(terms) == 1 else op("Or", *terms)  # the broadcast of c, a, b: the Where's shape
    graph.insert_before(node, bld.nodes)
    reroute(graph, y, out)
    graph.remove(node, safe=True)
    return True


@node_rewrite("softmax NaN guards without a mask dropped", "Where", sweep_after=True)
def drop_softmax_guards(node: ir.Node) -> bool:
    """``Where(IsNaN(p), 0, p)`` after ``p = Softmax(s)`` (TorchScript's scaled_dot_product_attention guards a
    row whose keys are all masked) is ``p`` where no row can be: the scores are a MatMul's, maybe scaled by
    constants and offset by a finite constant (no -inf anywhere), so every row has a finite maximum and
    Softmax gives no NaN from finite inputs. A mask computed at run time keeps its guard."""
    cond, zero, p = node.inputs
    isnan = cond.producer() if cond is not None else None
    sm = p.producer() if p is not None else None
    if isnan is None or isnan.op_type != "IsNaN" or isnan.inputs[0] is not p or sm is None \
            or sm.op_type != "Softmax" or scalar(zero) != 0.0 or node.outputs[0].is_graph_output():
        return False
    if static_shape(node.outputs[0]) != static_shape(p) or not _finite_scores(sm.inputs[0]):
        return False
    reroute(graph_of(node), node.outputs[0], p)  # type: ignore[arg-type]
    return True


def _finite_scores(v: ir.Value | None) -> bool:
    """Whether ``v`` is a MatMul's product behind scalings and finite constant offsets (no mask of -inf)."""
    while v is not None and (p := v.producer()) is not None and p.domain in ("", "ai.onnx"):
        if p.op_type == "MatMul":
            return True
        if p.op_type not in ("Mul", "Div", "Add") or len(p.inputs) != 2:
            return False
        consts = [const(x) for x in p.inputs]
        side = next((i for i, c in enumerate(consts) if c is not None), None)
        if side is None or not np.all(np.isfinite(consts[side])) or (p.op_type == "Div" and side == 0):  # type: ignore[arg-type]
            return False
        v = p.inputs[1 - side]
    return False
