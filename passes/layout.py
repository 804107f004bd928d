"""Layout pass: 4-D activations between dispatch ops go NHWC (and a video's 5-D [B, C, F, H, W] channels last,
[B, F, H, W, C], whose [B*F, H, W, C] view the dispatch ops read).

The fusions wrap each NHWC op in ``Transpose(NCHW->NHWC) -> op -> Transpose(NHWC->NCHW)``. This pass
removes those boundaries wherever two NHWC ops meet, by three rewrites run to a fixed point:

1. *chains*: a run of data-movement nodes (Reshape/Transpose/Squeeze/Unsqueeze/Flatten) is replaced by its
   simplest equivalent, found by running it on an index tensor: nothing, one Reshape, or a Reshape and a
   Transpose that exposes an NHWC<->NCHW boundary (the VAE's ``Reshape [B,C,HW] -> Transpose`` becomes
   ``Transpose -> Reshape``, which then cancels); a chain that forks is simplified from its root on each
   branch (SVD's [B*F, C, H, W] viewed as [B, F, C, H, W], read by its spatial and its temporal layers);
2. *cancel*: Transpose(Transpose(x)) composes; an identity composition disappears; a Transpose of a
   constant is folded (lazily) into the constant;
3. *push*: ``op(T(a), T(b), const)`` for a layout-agnostic ``op`` (element-wise, Concat, Split, Slice)
   becomes ``T(op'(a, b, const'))`` with the axes remapped and constants permuted offline, so the NHWC->NCHW
   Transpose after one dispatch op travels down until it meets the NCHW->NHWC Transpose of the next. A 4-D
   graph input among the operands (a ControlNet's residual entering the UNet) gets its own NCHW->NHWC
   Transpose at the edge instead; a runtime scalar (a ControlNet's conditioning scale) broadcasts in any
   layout and stays as it is. The
   element-wise ops are still plain ONNX here (the glue pass lowers them after this one).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx_ir as ir

from sdnpu.passes import movement
from sdnpu.passes.irutil import Builder, attr, const, remove_dead_nodes, replace, static_shape
from sdnpu.passes.provenance import step
from sdnpu.passes.manager import PassResult

log = logging.getLogger(__name__)

TO_NCHW = (0, 3, 1, 2)
TO_NHWC = (0, 2, 3, 1)
RANKS = (4, 5)  # channels last: NHWC, and NDHWC for a video's [B, C, F, H, W] between dispatch ops


def to_first(rank: int) -> tuple[int, ...]:
    """Channels last -> first at ``rank`` (NHWC -> NCHW at 4, NDHWC -> NCDHW at 5)."""
    return (0, rank - 1, *range(1, rank - 1))


def to_last(rank: int) -> tuple[int, ...]:
    """Channels first -> last at ``rank``."""
    return (0, *range(2, rank), 1)
RULE = "LayoutPass"

ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Sigmoid", "Cast", "Identity", "Relu", "Tanh", "Erf", "Sqrt",
                         "Neg", "Sin", "Cos", "Exp"})
AXIS_OPS = frozenset({"Concat", "Split", "Slice"})


def _perm(node: ir.Node) -> tuple[int, ...] | None:
    p = attr(node, "perm")
    return tuple(int(i) for i in p) if p is not None else None


def _is_transpose(node: ir.Node | None, perm: tuple[int, ...] | None = None) -> bool:
    return (node is not None and node.op_type == "Transpose" and node.domain in ("", "ai.onnx")
            and (perm is None or _perm(node) == perm))


def _permute(shape: tuple[int, ...], perm: tuple[int, ...]) -> list[int]:
    return [shape[i] for i in perm]


# --- 1. movement chains -----------------------------------------------------------------------------

def _chain_from(head: ir.Node) -> list[ir.Node]:
    chain = [head]
    while True:
        out = chain[-1].outputs[0]
        uses = list(out.uses())
        if out.is_graph_output() or len(uses) != 1 or not movement.is_movement(uses[0].node):
            return chain
        chain.append(uses[0].node)


def _canonical(chain: list[ir.Node], s_shape: tuple[int, ...], d_shape: tuple[int, ...]) -> bool:
    """Chains the rewrites below would leave as they are, known without simulating them: one Reshape that
    changes the shape, one NHWC<->NCHW Transpose that moves data. (Simulating a large VAE tensor costs a
    second each, on every round of the fixed point.)"""
    if len(chain) != 1:
        return False
    node = chain[0]
    if node.op_type == "Reshape":
        return s_shape != d_shape
    perm = _perm(node)
    return perm in (to_first(len(s_shape)), to_last(len(s_shape))) and len(s_shape) in RANKS \
        and not _reshape_equivalent(s_shape, perm)


def _movements_above(node: ir.Node) -> list[ir.Node]:
    """The movement nodes from the root of ``node``'s chain down to (not including) ``node``."""
    above: list[ir.Node] = []
    p = node.inputs[0].producer() if node.inputs[0] is not None else None
    while movement.is_movement(p) and len(above) < 16:
        above.append(p)  # type: ignore[arg-type]
        p = p.inputs[0].producer() if p.inputs[0] is not None else None  # type: ignore[union-attr]
    return above[::-1]


def _simplify_chain(graph: ir.Graph, chain: list[ir.Node], shared: int = 0) -> bool:
    """``chain`` as its simplest equivalent; its first ``shared`` nodes are also read by other branches (they
    stay for them)."""
    src, dst = chain[0].inputs[0], chain[-1].outputs[0]
    s_shape, d_shape = static_shape(src), static_shape(dst)
    assert src is not None and s_shape is not None and d_shape is not None
    if _canonical(chain, s_shape, d_shape):
        return False
    idx = movement.index_tensor(s_shape)
    if idx is None:
        return False
    got = movement.run_chain(chain, idx).reshape(-1)
    flat = idx.reshape(-1)
    b = Builder(graph, RULE)
    if np.array_equal(got, flat):
        if s_shape == d_shape and not dst.is_graph_output():
            dst.replace_all_uses_with(src)
            return True
        if len(chain) == 1 and chain[0].op_type == "Reshape":
            return False
        new = [_reshape(b, src, d_shape)]
    elif len(d_shape) in RANKS and np.array_equal(got, np.transpose(
            idx.reshape(_permute(d_shape, to_last(len(d_shape)))), to_first(len(d_shape))).reshape(-1)):
        first = to_first(len(d_shape))
        nhwc = _permute(d_shape, to_last(len(d_shape)))
        if len(chain) == 1 and _is_transpose(chain[0], first):
            return False
        if len(chain) == 2 and chain[0].op_type == "Reshape" and _is_transpose(chain[1], first):
            return False
        mid = src if tuple(nhwc) == s_shape else _reshape(b, src, nhwc)
        new = [b.op("Transpose", [mid], {"perm": list(first)}, domain="", dtype=src.dtype,
                    shape=d_shape).outputs[0]]
    elif len(s_shape) in RANKS and np.array_equal(got, np.transpose(idx, to_last(len(s_shape))).reshape(-1)):
        last = to_last(len(s_shape))
        if len(chain) <= 2 and _is_transpose(chain[0], last):
            return False
        t = b.op("Transpose", [src], {"perm": list(last)}, domain="", dtype=src.dtype,
                 shape=_permute(s_shape, last)).outputs[0]
        new = [t if tuple(_permute(s_shape, last)) == d_shape else _reshape(b, t, d_shape)]
    else:
        planned = _frame_swap_chain(s_shape, d_shape, got)
        if planned is None or [(n.op_type, static_shape(n.outputs[0])) for n in chain] == planned[1]:
            return False  # not a frame swap, or in its form already
        v = src
        for (op, shape), perm in zip(planned[1], planned[0], strict=True):
            v = _reshape(b, v, shape) if op == "Reshape" else b.op("Transpose", [v], {"perm": list(perm)}, domain="",
                                                                   dtype=src.dtype, shape=list(shape)).outputs[0]
        new = [v]
    replace(graph, chain[-1], chain[shared:], b.nodes, [dst], new)
    return True


SWAP = (0, 2, 1, 3)


def frame_swap(shape: tuple[int, ...], got: np.ndarray) -> tuple[int, int, int, int] | None:
    """(B, F, S, C) where ``got`` (a movement's output as flat indices into its source of ``shape``) is the source
    viewed [B, F, S, C] with F and S swapped, C its last axis and F, S > 1: a video's tokens read per pixel
    over the frames, or back. None for any other movement. One pass over ``got``: its element at C is the
    first token of frame 1, at F * C the second pixel of frame 0."""
    c, n = shape[-1], got.size
    if n < 4 * c or not np.array_equal(got[:c], np.arange(c)) or got[c] % c or got[c] < 2 * c:
        return None
    s = int(got[c]) // c
    hits = np.nonzero(got[::c] == c)[0]
    f = int(hits[0]) if hits.size else 0
    if f < 2 or n % (f * s * c):
        return None
    dims = (n // (f * s * c), f, s, c)
    want = np.arange(n, dtype=got.dtype).reshape(dims).transpose(SWAP).reshape(-1)
    return dims if np.array_equal(got, want) else None


def _frame_swap_chain(s_shape: tuple[int, ...], d_shape: tuple[int, ...], got: np.ndarray
                      ) -> tuple[list[tuple[int, ...] | None], list[tuple[str, tuple[int, ...]]]] | None:
    """A chain that is a frame swap (``frame_swap``), or one followed by channels last -> first at a 4-D or
    5-D destination (a video UNet's temporal layers hand their tokens back to an NCHW residual Add), as its
    plain form: Reshape to [B, F, S, C], Transpose(0, 2, 1, 3), Reshape, and that Transpose to channels first
    (which the push rewrite then carries down to cancel): (perms, [(op, output shape)]), None otherwise. The
    frames pass reads the swap's region in the spatial order (``passes/frames.py``)."""
    dims = frame_swap(s_shape, got)
    last: tuple[int, ...] | None = None
    if dims is None and len(d_shape) in RANKS:
        nhwc = tuple(_permute(d_shape, to_last(len(d_shape))))
        dims = frame_swap(s_shape, np.transpose(got.reshape(d_shape), to_last(len(d_shape))).reshape(-1))
        last = nhwc if dims is not None else None
    if dims is None:
        return None
    b, f, s, c = dims
    plan: list[tuple[str, tuple[int, ...]]] = []
    perms: list[tuple[int, ...] | None] = []
    if s_shape != dims:
        plan.append(("Reshape", dims))
        perms.append(None)
    plan.append(("Transpose", (b, s, f, c)))
    perms.append(SWAP)
    end = last if last is not None else d_shape
    if end != (b, s, f, c):
        plan.append(("Reshape", end))
        perms.append(None)
    if last is not None:
        plan.append(("Transpose", d_shape))
        perms.append(to_first(len(d_shape)))
    return perms, plan


def _reshape(b: Builder, x: ir.Value, shape: tuple[int, ...] | list[int]) -> ir.Value:
    target = b.const(np.asarray(shape, np.int64), "shape")
    return b.op("Reshape", [x, target], domain="", dtype=x.dtype, shape=list(shape)).outputs[0]


def simplify_chains(graph: ir.Graph) -> int:
    done = 0
    for node in list(graph):
        if node.graph is None or not movement.is_movement(node):
            continue
        src = node.inputs[0]
        upstream: list[ir.Node] = []
        if movement.is_movement(src.producer() if src is not None else None):  # type: ignore[union-attr]
            if len(src.uses()) == 1 and not src.is_graph_output():  # type: ignore[union-attr]
                continue  # not the head of its chain
            upstream = _movements_above(node)  # a branch of a chain that forks: simplified from the chain's root
        if _simplify_chain(graph, [*upstream, *_chain_from(node)], len(upstream)):
            done += 1
    return done


# --- 2. cancel and fold transposes --------------------------------------------------------------------

def cancel_transposes(graph: ir.Graph) -> int:
    done = 0
    for node in list(graph):
        if node.graph is None or not _is_transpose(node):
            continue
        x = node.inputs[0]
        assert x is not None
        perm = _perm(node)
        rank = len(static_shape(x) or ())
        if perm is None or not rank:
            continue
        inner = x.producer()
        out = node.outputs[0]
        if _is_transpose(inner):
            inner_perm = _perm(inner)  # type: ignore[arg-type]
            if inner_perm is None:
                continue
            composed = tuple(inner_perm[i] for i in perm)
            base = inner.inputs[0]  # type: ignore[union-attr]
            assert base is not None
            b = Builder(graph, RULE)
            if composed == tuple(range(rank)) and not out.is_graph_output():
                out.replace_all_uses_with(base)
            else:
                new = b.op("Transpose", [base], {"perm": list(composed)}, domain="", dtype=out.dtype,
                           shape=static_shape(out))
                replace(graph, node, [node], b.nodes, [out], [new.outputs[0]])
            done += 1
        elif x.const_value is not None and not out.is_graph_output():
            b = Builder(graph, RULE)
            folded = b.derived(x, [step("transpose", perm=list(perm))],
                               _permute(static_shape(x), perm), f"{x.name}_t")  # type: ignore[arg-type]
            out.replace_all_uses_with(folded)
            done += 1
        elif perm == tuple(range(rank)) and not out.is_graph_output():
            out.replace_all_uses_with(x)
            done += 1
    return done


# --- 3. push NHWC->NCHW transposes down -----------------------------------------------------------------

def _reshape_equivalent(shape: tuple[int, ...], perm: tuple[int, ...]) -> bool:
    """True when transposing ``shape`` by ``perm`` moves no data (only size-1 axes change place)."""
    kept = [i for i in perm if shape[i] != 1]
    return kept == sorted(kept)


def _push_one(graph: ir.Graph, t: ir.Node, node: ir.Node) -> bool:
    op = node.op_type
    if node.domain not in ("", "ai.onnx") or not (op in ELEMENTWISE or op in AXIS_OPS):
        return False
    if op in ("Split", "Slice") and node.inputs[0] is not t.outputs[0]:
        return False
    r = len(_perm(t) or ())
    first, last = to_first(r), to_last(r)
    if any(static_shape(o) is None or len(static_shape(o) or ()) != r for o in node.outputs):
        return False
    b = Builder(graph, RULE)
    new_inputs: list[ir.Value | None] = []
    data_inputs = node.inputs[:1] if op in ("Split", "Slice") else node.inputs
    for v in data_inputs:
        if v is None:
            new_inputs.append(None)
            continue
        p = v.producer()
        shape = static_shape(v)
        if _is_transpose(p, first):
            new_inputs.append(p.inputs[0])  # type: ignore[union-attr]
        elif v.const_value is not None and shape is not None and len(shape) <= r:
            full = (1,) * (r - len(shape)) + shape
            new_inputs.append(b.derived(v, [step("reshape", shape=list(full)), step("transpose", perm=list(last))],
                                        _permute(full, last), f"{v.name}_nhwc"))
        elif shape is not None and len(shape) == r and _reshape_equivalent(shape, last):
            new_inputs.append(_reshape(b, v, _permute(shape, last)))
        elif shape is not None and len(shape) == r and v.is_graph_input():
            new_inputs.append(_to_nhwc(b, v, shape))  # an NCHW input meets NHWC values: it turns, they stay
        elif op in ELEMENTWISE and shape is not None and len(shape) <= r and all(d == 1 for d in shape):
            new_inputs.append(v)  # a runtime scalar (a ControlNet's conditioning scale) broadcasts in any layout
        else:
            return False
    attrs = {k: a.value for k, a in node.attributes.items()}
    extra: list[ir.Value | None] = []
    if op in ("Concat", "Split"):
        axis = attrs.get("axis", 0) % r
        attrs["axis"] = first[axis]
        if op == "Split":
            extra = list(node.inputs[1:])
    elif op == "Slice":
        if any(const(v) is None for v in node.inputs[1:] if v is not None):
            return False
        axes_v = node.inputs[3] if len(node.inputs) > 3 else None
        axes = const(axes_v) if axes_v is not None else np.arange(const(node.inputs[1]).size)  # type: ignore
        new_axes = b.const(np.asarray([first[int(a) % r] for a in axes], np.int64), "axes")
        rest = list(node.inputs[1:])
        while len(rest) < 3:
            rest.append(None)
        rest[2] = new_axes
        extra = rest
    moved = b.op(op, [*new_inputs, *extra], attrs, domain=node.domain, n_out=len(node.outputs))
    news = []
    for old, new in zip(node.outputs, moved.outputs, strict=True):
        new.dtype = old.dtype
        new.shape = ir.Shape(_permute(static_shape(old), last))  # type: ignore[arg-type]
        news.append(b.op("Transpose", [new], {"perm": list(first)}, domain="", dtype=old.dtype,
                         shape=static_shape(old)).outputs[0])
    replace(graph, node, [node], b.nodes, list(node.outputs), news)
    return True


def _to_nhwc(b: Builder, v: ir.Value, shape: tuple[int, ...]) -> ir.Value:
    """A graph input's NCHW->NHWC Transpose: the one it has already, or a new one (which runs on the CPU at the
    graph's edge, as the sample's does, instead of turning the NPU's values back to NCHW)."""
    last = to_last(len(shape))
    for use in v.uses():
        if _is_transpose(use.node, last) and use.node.graph is not None:
            return use.node.outputs[0]
    return b.op("Transpose", [v], {"perm": list(last)}, domain="", dtype=v.dtype,
                shape=_permute(shape, last)).outputs[0]


def push_transposes(graph: ir.Graph) -> int:
    done = 0
    for t in list(graph):
        if t.graph is None or not any(_is_transpose(t, to_first(r)) for r in RANKS):
            continue
        for use in list(t.outputs[0].uses()):
            if use.node.graph is not None and _push_one(graph, t, use.node):
                done += 1
    return done


def merge_twin_movements(graph: ir.Graph) -> int:
    """Movement nodes that move one value the same way (a Reshape to the same shape, a Transpose by the same
    perm), once: the branches of a forked chain each simplified from its root make such twins, and the glue's
    patterns (x * sigmoid(x)) read one value, not two equal views of it."""
    seen: dict[tuple[object, ...], ir.Value] = {}
    done = 0
    for node in list(graph):
        if node.graph is None or node.op_type not in ("Reshape", "Transpose") or node.domain not in ("", "ai.onnx"):
            continue
        out, src = node.outputs[0], node.inputs[0]
        shape = static_shape(out)
        if src is None or shape is None or out.is_graph_output():
            continue
        key = (node.op_type, id(src), tuple(shape), tuple(_perm(node) or ()))
        twin = seen.get(key)
        if twin is None:
            seen[key] = out
            continue
        out.replace_all_uses_with(twin)
        done += 1
    return done


def lay_out_nhwc(model: ir.Model) -> PassResult:
    graph = model.graph
    counts: Counter[str] = Counter()
    for _ in range(100):
        step = Counter({"chains simplified": simplify_chains(graph), "transposes cancelled": cancel_transposes(graph),
                        "transposes pushed": push_transposes(graph),
                        "twin movements merged": merge_twin_movements(graph)})
        remove_dead_nodes(graph)
        counts += step
        if not sum(step.values()):
            break
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
