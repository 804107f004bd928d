"""Movement normal forms: data movement in the few spellings the layout pass, the views and the rules read.

- Squeeze / Unsqueeze / Flatten with static shapes are a Reshape (the layout pass reasons about Reshape only);
  a Transpose without ``perm`` (it reverses the axes) gets its perm written out;
- a Tile that repeats one axis of size 1 (grouped-query attention's heads), or an Expand of one into the heads
  (transformers' ``repeat_kv``), is a Concat of copies, which the NPU takes;
- a zero Pad in front of a Conv becomes the Conv's pads;
- an Einsum that moves data or multiplies matrices is a Transpose, or a batched MatMul between Transposes and
  Reshapes;
- a ScatterND that writes a block of whole rows is the Concat it is, and a chain of them that writes every
  row in turn (``out[..., 0::2] = a; out[..., 1::2] = b``) the interleave it is;
- a GatherND of constant indices, or a chain of Reshape / Expand / Transpose, that copies each pixel into an
  s x s block (dynamo's nearest-exact upsampling, Wan 2.2's DupUp3D) is the nearest-upsampling Resize it is;
- a Gather of constant indices that picks, through movement, exactly one operand of a Concat (SVD's temporal
  layers take frame 0 of the encoder states the UNet repeated over the frames) is a view of that operand;
- a chain of Reshape / Expand nodes broadcasting one value (the UNet's scalar timestep to the batch) is one
  Expand, and where a small constant is all it meets (the sinusoid's frequencies), none: the constant is
  broadcast offline.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes import movement as moves
from sdnpu.passes.canonical.driver import RULE, graph_of, node_rewrite
from sdnpu.passes.irutil import Builder, attr, const, producer, replace, static_shape
from sdnpu.passes.provenance import step

_CHAIN_OPS = ("Reshape", "Expand")


@node_rewrite("squeeze/unsqueeze/flatten -> reshape", "Squeeze", "Unsqueeze", "Flatten")
def reshape_squeezes(node: ir.Node) -> bool:
    """Squeeze, Unsqueeze and Flatten with static shapes are a Reshape to the output's shape."""
    shape = static_shape(node.outputs[0])
    if shape is None or static_shape(node.inputs[0]) is None:
        return False
    graph = graph_of(node)
    b = Builder(graph, RULE)
    target = b.const(np.asarray(shape, np.int64), "shape")
    new = b.op("Reshape", [node.inputs[0], target], domain="", dtype=node.outputs[0].dtype, shape=shape)
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [new.outputs[0]])
    return True


@node_rewrite("transpose perm written out", "Transpose")
def write_out_perms(node: ir.Node) -> bool:
    """Transpose's perm defaults to reversing the axes; the layout and glue passes read it, so write it out."""
    if "perm" in node.attributes:
        return False
    shape = static_shape(node.inputs[0])
    if shape is None:
        return False
    node.attributes["perm"] = ir.AttrInt64s("perm", list(range(len(shape)))[::-1])
    return True


@node_rewrite("tiles of a size-1 axis -> Concat", "Tile")
def concat_tiles(node: ir.Node) -> bool:
    """A Tile that repeats one axis of size 1 (grouped-query attention's ``k.unsqueeze(3).repeat(1, 1, 1,
    r, 1)`` for Lumina 2's key and value heads, as TorchScript writes it) is the Concat of r copies: of the input
    viewed without that axis, along the last axis of the view, which is the Tile's output in memory. The
    Concat goes to the NPU (SDConcat); the attention reads its output as the K or V it is."""
    x, reps = node.inputs
    sx, r, sy = static_shape(x), const(reps), static_shape(node.outputs[0])
    if x is None or sx is None or r is None or sy is None or const(x) is not None:
        return False
    axes = [i for i, k in enumerate(r.reshape(-1)) if int(k) != 1]
    if len(axes) != 1 or sx[axes[0]] != 1 or not 2 <= int(r.reshape(-1)[axes[0]]) <= 64:
        return False
    _write_copies(node, x, axes[0], int(r.reshape(-1)[axes[0]]), sy)
    return True


@node_rewrite("head repeats (Expand of a size-1 axis) -> Concat", "Expand")
def concat_head_repeats(node: ir.Node) -> bool:
    """Grouped-query attention's head repeat as dynamo and TorchScript write ``repeat_kv`` (transformers' Llama,
    Qwen2, Qwen3): Reshape [.., Hkv, 1, ..] -> Expand of that axis of 1 to r -> Reshape merging it into the heads,
    is a Concat of r copies, as ``concat_tiles``: the NPU takes it (SDConcat). Only where the one reader merges
    the repeated axis into the one before it (the head repeat: each head r times in place); another Expand of a
    computed value stays, with the registry's reason."""
    x, shape = node.inputs
    sx, target, sy = static_shape(x), const(shape), static_shape(node.outputs[0])
    if x is None or sx is None or target is None or sy is None or const(x) is not None or len(sx) != len(sy) \
            or target.size != len(sx):
        return False
    axes = [i for i, (a, b) in enumerate(zip(sx, sy, strict=True)) if a != b]
    if len(axes) != 1 or axes[0] == 0 or sx[axes[0]] != 1 or not 2 <= sy[axes[0]] <= 64:
        return False
    a = axes[0]
    uses = list(node.outputs[0].uses())
    merged = [*sy[:a - 1], sy[a - 1] * sy[a], *sy[a + 1:]]
    if node.outputs[0].is_graph_output() or len(uses) != 1 or uses[0].node.op_type != "Reshape" \
            or static_shape(uses[0].node.outputs[0]) != tuple(merged):
        return False
    _write_copies(node, x, a, sy[a], sy)
    return True


def _write_copies(node: ir.Node, x: ir.Value, a: int, times: int, sy: tuple[int, ...]) -> None:
    """``node`` (a Tile or Expand repeating axis ``a`` of size 1 of ``x`` ``times`` times) as the Concat of that
    many copies of ``x`` viewed without the axis, along the view's last axis: the same memory."""
    sx = static_shape(x)
    assert sx is not None
    view = [*sx[:a], int(np.prod(sx[a + 1:], dtype=np.int64))]
    graph = graph_of(node)
    b = Builder(graph, RULE)
    flat = b.op("Reshape", [x, b.const(np.asarray(view, np.int64), "shape")], dtype=x.dtype, shape=view)
    joined = [*view[:-1], view[-1] * times]
    cat = b.op("Concat", [flat.outputs[0]] * times, {"axis": len(view) - 1}, dtype=x.dtype, shape=joined)
    out = b.op("Reshape", [cat.outputs[0], b.const(np.asarray(sy, np.int64), "shape")], dtype=x.dtype,
               shape=list(sy))
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [out.outputs[0]])


@node_rewrite("Pad merged into Conv", "Pad")
def merge_pad_into_conv(node: ir.Node) -> bool:
    """Pad(x, zeros on the spatial axes) -> Conv becomes one Conv with those pads, at any rank: the VAE encoder's
    downsampler pads right and bottom by one (dynamo already writes it this way); Wan's causal Conv3d pads its
    frames in front (``F.pad`` with the temporal padding all before, TorchScript keeps the Pad). Not a cropping
    (negative) Pad, nor one of the batch or channel axes. The Pad is left unread (the rewrites after sweep it)."""
    uses = list(node.outputs[0].uses())
    pads = const(node.inputs[1]) if len(node.inputs) > 1 else None
    value = const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else np.zeros(1)
    mode = attr(node, "mode", "constant")
    if (len(uses) != 1 or uses[0].node.op_type != "Conv" or uses[0].idx != 0 or pads is None or pads.size < 6
            or pads.size % 2 or value is None or np.any(value != 0) or mode not in ("constant", b"constant")
            or (len(node.inputs) > 3 and node.inputs[3] is not None) or node.outputs[0].is_graph_output()):
        return False
    conv, rank = uses[0].node, pads.size // 2
    if attr(conv, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") or np.any(pads[[0, 1, rank, rank + 1]] != 0):
        return False
    if np.any(pads < 0):  # a negative pad crops the data; a Conv's pads only add zeros
        return False
    k = rank - 2
    old = list(attr(conv, "pads", [0] * (2 * k)))
    if len(old) != 2 * k:
        return False
    new = [old[i] + int(pads[2 + i]) for i in range(k)] + [old[k + i] + int(pads[rank + 2 + i]) for i in range(k)]
    conv.attributes["pads"] = ir.AttrInt64s("pads", new)
    conv.replace_input_with(0, node.inputs[0])
    return True


@node_rewrite("Einsum -> Transpose / MatMul", "Einsum")
def lower_einsum(node: ir.Node) -> bool:
    """An Einsum that moves data or multiplies matrices, written as those ops: one operand with every index
    once (``nhwpqc->nchpwq``, the DiTs' unpatchify) is a Transpose; two operands with no index summed alone
    or repeated are a batched MatMul between Transposes and Reshapes (``bij,bjk->bik``, ``bhqd,bhkd->bhqk``),
    which the layout pass simplifies and the rules fuse; an outer product (``i,j->ij``) a broadcast Mul.
    Anything else (an ellipsis, a diagonal, a sum over an index of one operand) stays an Einsum."""
    return einsum_as_ops(node, outer_as_mul=True)


def einsum_as_ops(node: ir.Node, outer_as_mul: bool) -> bool:
    """``lower_einsum``'s rewrite; ``outer_as_mul`` False keeps an outer product a MatMul over a summed axis of
    size 1 (the form Qualcomm's compiler was measured taking, ``sdnpu.passes.htp.ranks``)."""
    eq = attr(node, "equation", "")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    if "->" not in eq or "." in eq:
        return False
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    shapes = [static_shape(v) for v in node.inputs]
    y_shape = static_shape(node.outputs[0])
    if y_shape is None or any(sh is None or len(sh) != len(t) for sh, t in zip(shapes, terms, strict=False)) \
            or len(terms) != len(node.inputs) or any(len(set(t)) != len(t) for t in [*terms, out]):
        return False
    graph = graph_of(node)
    b = Builder(graph, RULE)
    x = node.inputs[0]
    assert x is not None
    if len(terms) == 1 and sorted(terms[0]) == sorted(out):
        y = b.op("Transpose", [x], {"perm": [terms[0].index(c) for c in out]}, dtype=node.outputs[0].dtype,
                 shape=y_shape).outputs[0]
    elif len(terms) == 2 and set(out) <= set(terms[0]) | set(terms[1]) \
            and not (set(terms[0]) ^ set(terms[1])) - set(out):
        y = _einsum_matmul(b, node, terms, out, shapes, y_shape, outer_as_mul)  # type: ignore[arg-type]
    else:
        return False
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [y])
    return True


def _einsum_matmul(b: Builder, node: ir.Node, terms: list[str], out: str, shapes: list[tuple[int, ...]],
                   y_shape: tuple[int, ...], outer_as_mul: bool = True) -> ir.Value:
    """A two-operand Einsum as Transpose, Reshape to [batch, rows, summed] and [batch, summed, cols], MatMul
    (a Mul where nothing is summed), Reshape and Transpose to the output's order."""
    a, c = terms
    dims = {ch: d for t, sh in zip(terms, shapes, strict=True) for ch, d in zip(t, sh, strict=True)}
    batch = [ch for ch in out if ch in a and ch in c]
    rows = [ch for ch in out if ch in a and ch not in c]
    cols = [ch for ch in out if ch in c and ch not in a]
    summed = [ch for ch in a if ch in c and ch not in out]
    dtype = node.outputs[0].dtype

    def arrange(v: ir.Value, term: str, order: list[str], groups: list[list[str]]) -> ir.Value:
        perm = [term.index(ch) for ch in order]
        shape = [int(np.prod([dims[ch] for ch in g])) for g in groups]
        if v.const_value is not None:  # a constant operand (the rotary's frequencies, a weight) arranged offline
            return b.derived(v, [step("transpose", perm=perm), step("reshape", shape=shape)], shape,
                             f"{v.name}_einsum")
        if perm != list(range(len(perm))):
            v = b.op("Transpose", [v], {"perm": perm}, dtype=dtype, shape=[dims[ch] for ch in order]).outputs[0]
        return b.op("Reshape", [v, b.const(np.asarray(shape, np.int64), "shape")], dtype=dtype, shape=shape).outputs[0]

    left = arrange(node.inputs[0], a, batch + rows + summed, [batch, rows, summed])  # type: ignore[arg-type]
    right = arrange(node.inputs[1], c, batch + summed + cols, [batch, summed, cols])  # type: ignore[arg-type]
    n_b, n_r, n_c = (int(np.prod([dims[ch] for ch in g])) for g in (batch, rows, cols))
    # nothing summed (an outer product, ``torch.outer``: the rotary's positions times its frequencies): the
    # [batch, rows, 1] and [batch, 1, cols] views broadcast in a Mul, the same products; a MatMul of one
    # summed element would count as a weight-bearing layer, and the table it makes would not be the CPU's edge
    outer = not summed and outer_as_mul
    prod = b.op("Mul" if outer else "MatMul", [left, right], dtype=dtype, shape=[n_b, n_r, n_c]).outputs[0]
    order = batch + rows + cols
    full = b.op("Reshape", [prod, b.const(np.asarray([dims[ch] for ch in order], np.int64), "shape")], dtype=dtype,
                shape=[dims[ch] for ch in order]).outputs[0]
    perm = [order.index(ch) for ch in out]
    if perm == list(range(len(perm))):
        return full
    return b.op("Transpose", [full], {"perm": perm}, dtype=dtype, shape=list(y_shape)).outputs[0]


@node_rewrite("row-block ScatterND -> Concat", "ScatterND")
def concat_row_scatters(node: ir.Node) -> bool:
    """ScatterND with constant indices that write a block of whole rows along one axis (an in-place slice
    assignment: CogView4's ``query[:, :, text:] = rope(query[:, :, text:])``) is the Concat it is: the rows
    before the block, the updates, the rows after, whose parts the streams pass then reads apart. Found by
    running the scatter on index tensors."""
    data, idx, upd = node.inputs[0], node.inputs[1], node.inputs[2]
    d_shape, u_shape, ix = static_shape(data), static_shape(upd), const(idx)
    if data is None or upd is None or d_shape is None or u_shape is None or ix is None or \
            attr(node, "reduction", "none") not in ("none", b"none") or int(np.prod(d_shape)) > 1 << 24:
        return False
    k = ix.shape[-1]
    probe = np.zeros(d_shape, np.int64)
    try:
        probe[tuple(np.moveaxis(ix, -1, 0))] = np.arange(1, int(np.prod(u_shape)) + 1).reshape(u_shape)
    except (IndexError, ValueError):
        return False
    written = probe > 0
    block = None
    for axis in range(min(k, len(d_shape))):
        rows = np.nonzero(np.any(written, axis=tuple(a for a in range(len(d_shape)) if a != axis)))[0]
        if rows.size == 0:
            break
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        index = [slice(None)] * len(d_shape)
        index[axis] = slice(lo, hi)
        want = np.zeros(d_shape, bool)
        want[tuple(index)] = True
        region = probe[tuple(index)]
        if np.array_equal(written, want) and np.array_equal(region.reshape(-1), np.arange(1, region.size + 1)):
            block = (axis, lo, hi, region.shape)
            break
    if block is None:
        return False
    axis, lo, hi, region_shape = block
    graph = graph_of(node)
    b = Builder(graph, RULE)
    parts = []
    for start, stop in ((0, lo), (hi, d_shape[axis])):
        if start < stop:
            piece = [*d_shape[:axis], stop - start, *d_shape[axis + 1:]]
            args = [b.const(np.asarray([x], np.int64), "rows") for x in (start, stop, axis)]
            parts.append((start, b.op("Slice", [data, *args], dtype=data.dtype, shape=piece).outputs[0]))
    middle = upd if tuple(u_shape) == tuple(region_shape) else b.op(
        "Reshape", [upd, b.const(np.asarray(region_shape, np.int64), "shape")], dtype=upd.dtype,
        shape=list(region_shape)).outputs[0]
    parts.append((lo, middle))
    parts.sort(key=lambda p: p[0])
    y = b.op("Concat", [v for _, v in parts], {"axis": axis}, dtype=node.outputs[0].dtype,
             shape=list(d_shape)).outputs[0]
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [y])
    return True


def _row_scatter(node: ir.Node, rows: int) -> tuple[np.ndarray, ir.Value] | None:
    """(rows written, updates) of a ScatterND that writes whole rows along axis 0 of data with ``rows`` rows
    (constant indices [m, 1], no reduction), in the order of the updates' rows; None otherwise."""
    if node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 3:
        return None
    ix, upd = const(node.inputs[1]), node.inputs[2]
    if ix is None or upd is None or attr(node, "reduction", "none") not in ("none", b"none") or ix.ndim != 2 or \
            ix.shape[1] != 1:
        return None
    at = ix[:, 0].astype(np.int64)
    at = np.where(at < 0, at + rows, at)
    return (at, upd) if np.all((at >= 0) & (at < rows)) else None


@node_rewrite("strided ScatterND rows -> interleave", "ScatterND")
def interleave_row_scatters(node: ir.Node) -> bool:
    """A chain of ScatterNDs that writes every row along axis 0 of its data, each writing rows r, r + s,
    r + 2s, ... from its updates in order (``out[..., 0::2] = a; out[..., 1::2] = b``, which dynamo exports
    with the axis moved first: Wan's rotary), is the interleave of the updates: each viewed [n, 1, ...], a
    Concat, a Reshape to [n s, ...]. Where every update is a Transpose of the same perm p (the axis moved first),
    the interleave is of the Transposes' inputs along axis p[0], then one Transpose p: the rows of the value it
    interleaves stay those of its producers (the rotary reads them so). Anchored at the chain's last scatter;
    the data it starts from is overwritten everywhere and goes."""
    out = node.outputs[0]
    if any(u.node.op_type == "ScatterND" and u.idx == 0 for u in out.uses()):
        return False  # not the end of its chain
    d_shape = static_shape(out)
    if d_shape is None or not d_shape:
        return False
    chain: list[tuple[np.ndarray, ir.Value]] = []
    cur: ir.Node | None = node
    while cur is not None:
        found = _row_scatter(cur, d_shape[0])
        if found is None:
            break
        chain.insert(0, found)
        data = cur.inputs[0]
        cur = data.producer() if data is not None and len(data.uses()) == 1 and not data.is_graph_output() else None
    if len(chain) < 2:
        return False
    rows = d_shape[0]
    owner, pos = np.full(rows, -1), np.zeros(rows, np.int64)
    for j, (at, _) in enumerate(chain):
        owner[at], pos[at] = j, np.arange(at.size)
    stride = len(chain)
    if np.any(owner < 0) or rows % stride:
        return False  # some rows keep the data's: not an interleave (the row-block rule's, or the CPU's)
    n = rows // stride
    phases = []
    for r in range(stride):
        at, upd = chain[owner[r]]
        u_shape = static_shape(upd)
        if not (np.all(owner[r::stride] == owner[r]) and np.array_equal(pos[r::stride], np.arange(n))
                and u_shape is not None and tuple(u_shape) == (n, *d_shape[1:])):
            return False
        phases.append(upd)
    if len({id(p) for p in phases}) != stride:
        return False
    tps = [p.producer() for p in phases]
    perms = {tuple(attr(t, "perm", [])) if t is not None and t.op_type == "Transpose" and t.domain in ("", "ai.onnx")
             else None for t in tps}
    perm = next(iter(perms)) if len(perms) == 1 else None
    if perm:
        phases = [t.inputs[0] for t in tps]  # type: ignore[union-attr,misc]
    axis = perm[0] if perm else 0
    p_shape = static_shape(phases[0])
    if p_shape is None:
        return False
    graph = graph_of(node)
    b = Builder(graph, RULE)
    one = [*p_shape[:axis + 1], 1, *p_shape[axis + 1:]]
    parts = [b.op("Reshape", [p, b.const(np.asarray(one, np.int64), "shape")], dtype=out.dtype, shape=one).outputs[0]
             for p in phases]
    both = [*p_shape[:axis + 1], stride, *p_shape[axis + 1:]]
    cat = b.op("Concat", parts, {"axis": axis + 1}, dtype=out.dtype, shape=both).outputs[0]
    whole = [*p_shape[:axis], rows, *p_shape[axis + 1:]]
    y = b.op("Reshape", [cat, b.const(np.asarray(whole, np.int64), "shape")], dtype=out.dtype, shape=whole).outputs[0]
    if perm:
        y = b.op("Transpose", [y], {"perm": list(perm)}, dtype=out.dtype, shape=d_shape).outputs[0]
    replace(graph, node, [node], b.nodes, [out], [y])
    return True


@node_rewrite("broadcast chains -> Expand", *_CHAIN_OPS)
def merge_broadcast_chains(node: ir.Node) -> bool:
    """A chain of Reshape/Expand nodes from a one-element tensor (the timestep) -> one Expand. Anchored at the
    chain's last node."""
    out = node.outputs[0]
    if any(u.node.op_type in _CHAIN_OPS for u in out.uses()):
        return False  # not the end of its chain
    src, length = node.inputs[0], 1
    while src is not None and src.producer() is not None and src.producer().op_type in _CHAIN_OPS \
            and src.producer().domain in ("", "ai.onnx"):  # type: ignore[union-attr]
        src = src.producer().inputs[0]  # type: ignore[union-attr]
        length += 1
    shape, src_shape = static_shape(out), static_shape(src)
    if length < 2 or shape is None or src_shape is None or int(np.prod(src_shape)) != 1 \
            or len(src_shape) > len(shape):
        return False
    graph = graph_of(node)
    b = Builder(graph, RULE)
    new = b.op("Expand", [src, b.const(np.asarray(shape, np.int64), "shape")], dtype=out.dtype, shape=shape)
    replace(graph, node, [node], b.nodes, [out], [new.outputs[0]])
    return True


@node_rewrite("expands folded into constants", "Mul", "Add")
def fold_expands_into_constants(node: ir.Node) -> bool:
    """Mul/Add(Expand(s), c) with ``s`` one value and ``c`` a small constant -> Mul/Add(s, c broadcast to the
    result's shape), the broadcast done once offline: the UNet's timestep expanded to the batch, times the
    sinusoid's frequencies, is one CPU node instead of two. The same numbers (each element is s op c). A
    Reshape of one value is the same broadcast (the timestep viewed as [1, 1] at batch 1)."""
    out_shape = static_shape(node.outputs[0])
    for i in (0, 1):
        e, c = producer(node.inputs[i], "Expand") or producer(node.inputs[i], "Reshape"), node.inputs[1 - i]
        if e is None or c is None or const(c) is None or out_shape is None or int(np.prod(out_shape)) > 1 << 16:
            continue
        src, src_shape = e.inputs[0], static_shape(e.inputs[0])
        if src is None or src_shape is None or int(np.prod(src_shape)) != 1 or len(src_shape) > len(out_shape):
            continue
        if len(e.outputs[0].uses()) != 1 or e.outputs[0].is_graph_output():
            continue
        graph = graph_of(node)
        b = Builder(graph, RULE)
        big = b.derived(c, [step("broadcast", shape=list(out_shape))], list(out_shape), f"{c.name}_b")
        operands = [src, big] if i == 0 else [big, src]
        new = b.op(node.op_type, operands, dtype=node.outputs[0].dtype, shape=out_shape)
        replace(graph, node, [node], b.nodes, [node.outputs[0]], [new.outputs[0]])
        return True
    return False


@node_rewrite("nearest upsampling gathers -> Resize", "GatherND")
def resize_nearest_gathers(node: ir.Node) -> bool:
    """GatherND with constant indices that pick row i // s of each of the data's first k axes (dynamo's
    ``_unsafe_index`` spelling of ``F.interpolate(mode="nearest-exact")`` at an integer factor s, on the image
    transposed to [H, W, B, C]: Qwen-Image's and Wan's VAE upsamplers) is that nearest upsampling: a Resize
    (nearest, asymmetric, floor: output i reads i // s) of the axes moved last, between Transposes the layout
    pass cancels with the exporter's own."""
    data, idx = node.inputs[0], node.inputs[1]
    d_shape, ix, y_shape = static_shape(data), const(idx), static_shape(node.outputs[0])
    if data is None or d_shape is None or ix is None or y_shape is None or int(attr(node, "batch_dims", 0)) != 0:
        return False
    k = ix.shape[-1]
    if ix.ndim != k + 1 or not 0 < k <= len(d_shape) or any(ix.shape[i] % d_shape[i] for i in range(k)):
        return False
    factors = [ix.shape[i] // d_shape[i] for i in range(k)]
    want = np.stack(np.meshgrid(*[np.arange(ix.shape[i]) // factors[i] for i in range(k)], indexing="ij"), -1)
    if not np.array_equal(ix, want) or all(f == 1 for f in factors):
        return False
    n = len(d_shape)
    perm = [*range(k, n), *range(k)]
    moved = [d_shape[i] for i in perm]
    graph = graph_of(node)
    b = Builder(graph, RULE)
    t = b.op("Transpose", [data], {"perm": perm}, dtype=data.dtype, shape=moved).outputs[0]
    scales = b.const(np.asarray([1.0] * (n - k) + factors, np.float32), "scales")
    up = [*moved[:n - k], *(moved[n - k + i] * factors[i] for i in range(k))]
    r = b.op("Resize", [t, None, scales], {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                                           "nearest_mode": "floor"}, dtype=data.dtype, shape=up).outputs[0]
    back = [perm.index(i) for i in range(n)]
    y = b.op("Transpose", [r], {"perm": back}, dtype=data.dtype, shape=list(y_shape)).outputs[0]
    replace(graph, node, [node], b.nodes, [node.outputs[0]], [y])
    return True


_UPSAMPLE_CHAIN = ("Reshape", "Transpose", "Expand", "Unsqueeze", "Squeeze", "Flatten")  # the last three: views


@node_rewrite("nearest upsampling movements -> Resize", "Reshape", "Transpose", "Squeeze", "Flatten")
def resize_repeated_pixels(node: ir.Node) -> bool:
    """A chain of Reshape / Transpose / Expand (a constant shape) and the views Unsqueeze / Squeeze / Flatten
    (static shapes; AMD's canonical form has made them Reshapes by here, a standard target's has not) that
    copies each pixel of its source into an s x s block, found by running the chain on an index tensor: Wan
    2.2's ``DupUp3D`` (each channel repeated
    s * s times, then the copies moved into space) where it repeats as many times as it moves, a nearest
    upsampling by s. Written as the Resize it is (nearest, asymmetric, floor) of the source viewed as
    [B, C', H, W], then viewed back. Anchored at the chain's last node."""
    out = node.outputs[0]
    if any(u.node.op_type in _UPSAMPLE_CHAIN and u.node.domain in ("", "ai.onnx") for u in out.uses()):
        return False  # not the end of its chain
    chain, v = [], node.outputs[0]
    while True:
        p = v.producer()
        if p is None or p.op_type not in _UPSAMPLE_CHAIN or p.domain not in ("", "ai.onnx") or len(chain) > 12:
            break
        if p.op_type == "Expand" and const(p.inputs[1]) is None:
            break
        chain.append(p)
        v = p.inputs[0]  # type: ignore[assignment]
    chain.reverse()
    src = v
    s_shape, y_shape = static_shape(src), static_shape(out)
    if not any(n.op_type == "Expand" for n in chain) or s_shape is None or y_shape is None or len(s_shape) < 3 \
            or len(y_shape) != len(s_shape) or any(static_shape(n.outputs[0]) is None for n in chain) \
            or tuple(y_shape[:-2]) != tuple(s_shape[:-2]) or y_shape[-1] % s_shape[-1] or y_shape[-2] % s_shape[-2]:
        return False
    sh, sw = y_shape[-2] // s_shape[-2], y_shape[-1] // s_shape[-1]
    if int(np.prod(y_shape)) > 1 << 24 or (sh, sw) == (1, 1):
        return False
    got = np.arange(int(np.prod(s_shape)), dtype=np.int32).reshape(s_shape)
    for n in chain:
        shape = static_shape(n.outputs[0])
        got = np.broadcast_to(got, shape) if n.op_type == "Expand" else (
            np.transpose(got, attr(n, "perm")) if n.op_type == "Transpose" else got.reshape(shape))
    want = np.repeat(np.repeat(np.arange(got.size // (sh * sw), dtype=np.int32).reshape(s_shape), sh, -2), sw, -1)
    if got.shape != want.shape or not np.array_equal(got, want):
        return False
    graph = graph_of(node)
    b = Builder(graph, RULE)
    four = [s_shape[0], int(np.prod(s_shape[1:-2])), s_shape[-2], s_shape[-1]]
    x = src if len(s_shape) == 4 else b.op("Reshape", [src, b.const(np.asarray(four, np.int64), "shape")],
                                           dtype=src.dtype, shape=four).outputs[0]
    up = [*four[:2], four[2] * sh, four[3] * sw]
    scales = b.const(np.asarray([1.0, 1.0, sh, sw], np.float32), "scales")
    y = b.op("Resize", [x, None, scales], {"mode": "nearest", "coordinate_transformation_mode": "asymmetric",
                                           "nearest_mode": "floor"}, dtype=src.dtype, shape=up).outputs[0]
    if len(s_shape) != 4:
        y = b.op("Reshape", [y, b.const(np.asarray(y_shape, np.int64), "shape")], dtype=src.dtype,
                 shape=list(y_shape)).outputs[0]
    replace(graph, node, [node], b.nodes, [out], [y])
    return True


@node_rewrite("a Gather of one Concat operand -> a view of it", "Gather")
def select_concat_parts(node: ir.Node) -> bool:
    """``Gather(x, i, axis)`` with constant indices, where x is a Concat's output (or an Expand's copies of its
    input) through movement (Reshape, Transpose) and the elements it picks are one operand's, all of them and in
    their order: a Reshape of that operand (checked on index tensors: each operand's elements numbered, the
    movement and the Gather run on them). dynamo writes diffusers' ``repeat_interleave`` of the encoder states
    over the frames as an Expand (a Concat of copies after ``concat_head_repeats``), and SVD's temporal
    transformer picks frame 0 of it (``[:, 0]``): the states themselves. A Gather
    that mixes operands or reorders one stays, with the registry's reason."""
    x, index = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
    idx, out_shape = const(index), static_shape(node.outputs[0])
    if x is None or idx is None or out_shape is None or static_shape(x) is None:
        return False
    src, chain, _ = moves.trace_up(x, allow_scale=False)
    cat = src.producer()
    if cat is None or cat.op_type not in ("Concat", "Expand") or cat.domain not in ("", "ai.onnx"):
        return False
    parts = cat.inputs if cat.op_type == "Concat" else cat.inputs[:1]
    shapes = [static_shape(v) for v in parts]
    cat_shape = static_shape(src)
    if cat_shape is None or any(s is None for s in shapes) or int(np.prod(cat_shape)) > moves.MAX_SIMULATED:
        return False
    offsets = np.cumsum([0] + [int(np.prod(s)) for s in shapes])  # type: ignore[arg-type]
    numbered = [(offsets[j] + np.arange(int(np.prod(s)), dtype=np.int64)).reshape(s)  # type: ignore[arg-type]
                for j, s in enumerate(shapes)]
    if cat.op_type == "Concat":
        ids = np.concatenate(numbered, axis=int(attr(cat, "axis", 0)) % len(cat_shape))
    else:  # the copies an Expand makes (before ``concat_head_repeats`` writes some of them as a Concat)
        ids = np.broadcast_to(numbered[0], cat_shape)
    picked = np.take(moves.run_chain(chain, ids), idx.astype(np.int64), axis=int(attr(node, "axis", 0)))
    flat = picked.reshape(-1)
    for j, v in enumerate(parts):
        if flat.size == offsets[j + 1] - offsets[j] and np.array_equal(flat, np.arange(offsets[j], offsets[j + 1])):
            graph = graph_of(node)
            b = Builder(graph, RULE)
            view = b.op("Reshape", [v, b.const(np.asarray(out_shape, np.int64), "shape")], domain="", dtype=v.dtype,
                        shape=list(out_shape))
            replace(graph, node, [node], b.nodes, [node.outputs[0]], [view.outputs[0]])
            return True
    return False
