"""Frame tokens: a video transformer's attention over frames without the transposes around it.

A temporal transformer (SVD's ``TransformerSpatioTemporalModel``, its ``temporal_transformer_blocks``) reads the
spatial layers' tokens [B*F, S, C] as one sequence of F frames per pixel, [B*S, F, C]:

    x [B, F, S, C] -> Transpose(0, 2, 1, 3) -> [B, S, F, C] (read as [B*S, F, C])
      -> LayerNorm, Gemm, GELU, the residual Adds ... attention over the F frames of each pixel ...
      -> [B, S, F, C] -> Transpose(0, 2, 1, 3) -> [B, F, S, C]

After fusion both transposes stand between dispatch ops, and the registry has no transpose: each is a CPU
node with a cast each way. But between them every op but the attention is *token-wise* (SDLayerNorm, SDGemm,
SDMatMul, SDGelu, SDSilu; SDAdd and SDMul of two such values, or of one and a value broadcast over every token):
it computes each token from the same token, so it gives the same tokens in any token order. Read in the spatial
order [B, F, S, C] instead, the region needs the transposes only for its attentions, which read them as:

    self-attention over frames   Q, K, V [B*S, F, K], heads H  ==  Q, K, V [B, F, S*K], heads S*H
                                 (each head's channels of each pixel one head of its own: the same products)
    cross-attention on a context whose rows are one per sample, broadcast over the pixels (SVD's image
    embedding: K, V = SDGemm(Expand(e [B, 1, N, C] -> [B, S, N, C])))
                                 Q [B*S, F, K], K, V [B*S, N, K]  ==  Q [B*F, S, K], K, V [B*F, N, K]
                                 (e repeated over the frames instead of the pixels, SDConcats on the
                                 NPU; the SDGemm on that)

An SDAdd or SDMul whose other operand is one row per frame broadcast over the pixels ([1, F, C] against
[B*S, F, C]: AnimateDiff's motion modules add a sinusoidal position embedding over the frames) reads it as
[1, F, 1, C] against the spatial [B, F, S, C]. All are exact (the same products and sums, in another order of
the batch). The region's exits, the movement
chains that bring its tokens back to [B, F, S, C], become views. The pass changes nothing unless every reader in
the region is one of these; otherwise it says why in the log and the counts, and the transposes stay. The
pixels as heads rely on a capability no public source states (the table's limit "pixels as heads"): the
report counts those attentions among the ops that rely on an assumption.

Runs after ``views`` (the dispatch ops read their operands through their views, which it keeps) and before
``precision``; the views it leaves (a Reshape at each exit) it absorbs itself.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import ASSUMED_TAG, BF16_ONLY_TAG
from sdnpu.ops.target import DispatchTarget
from sdnpu.passes import movement
from sdnpu.passes.irutil import Builder, attr, record_views, remove_dead_nodes, reroute, static_shape
from sdnpu.passes.manager import PassResult
from sdnpu.passes.rules.attention import mha_node
from sdnpu.passes.views import absorb_views

log = logging.getLogger(__name__)

RULE = "FrameTokens"
TOKENWISE = ("layer_norm", "gemm", "matmul", "gelu", "silu")  # the target's families (its ops' names are its own)
BINARY = ("add", "mul")


def _family_ops(target: DispatchTarget, families: tuple[str, ...]) -> frozenset[str]:
    return frozenset(target.op(f).op_type for f in families)


def _is_attention(target: DispatchTarget, op: str) -> bool:
    """An attention op of the target: Q, K, V and its mask (as the specializer reads them)."""
    spec = target.base_spec(op)
    return len(spec.inputs) >= 4 and spec.inputs[3].role == "mask"
SWAP = (0, 2, 1, 3)


@dataclass
class Region:
    """The values between a frame transpose and its exits, read in the transposed token order."""

    b: int
    f: int
    s: int
    c: int
    values: set[ir.Value] = field(default_factory=set)
    binaries: list[ir.Node] = field(default_factory=list)
    per_frame: list[tuple[ir.Node, int]] = field(default_factory=list)  # (op, its frame tokens' input)
    attentions: list[ir.Node] = field(default_factory=list)
    exits: list[list[ir.Node]] = field(default_factory=list)


def _is_frame_transpose(node: ir.Node) -> tuple[int, int, int, int] | None:
    """[B, F, S, C] -> [B, S, F, C] (F, S > 1): its (B, F, S, C), else None."""
    if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm = attr(node, "perm")
    shape = static_shape(node.inputs[0])
    if perm is None or tuple(int(p) for p in perm) != SWAP or shape is None or len(shape) != 4:
        return None
    b, f, s, c = shape
    return (b, f, s, c) if f > 1 and s > 1 else None


def _views(target: DispatchTarget, node: ir.Node) -> dict[int, list[int]]:
    return target.base_spec(node.op_type).input_views({k: a.value for k, a in node.attributes.items()})


def _exit_chain(region: Region, v: ir.Value, first: ir.Node) -> list[ir.Node] | str:
    """The movement chain from ``v`` (starting at ``first``) that brings the tokens back to the spatial order."""
    chain = [first]
    while True:
        out = chain[-1].outputs[0]
        uses = list(out.uses())
        if out.is_graph_output() or len(uses) != 1 or not movement.is_movement(uses[0].node) or len(chain) > 8:
            break
        chain.append(uses[0].node)
    if any(not movement.is_movement(n) for n in chain):
        return f"{first.op_type} reads the frame tokens: not a static movement"
    width = (static_shape(v) or (0,))[-1]
    if width != region.c:
        return f"a movement of {width}-channel frame tokens (the region's exits keep its {region.c} channels)"
    idx = movement.index_tensor((region.b, region.f, region.s, region.c))
    if idx is None:
        return "too large to check its movements"
    got = movement.run_chain(chain, idx.transpose(SWAP).reshape(static_shape(v)))  # type: ignore[arg-type]
    if not np.array_equal(got.reshape(-1), idx.reshape(-1)):
        return "a movement that does not bring the frame tokens back to their spatial order"
    return chain


def _width(v: ir.Value | None) -> int | None:
    """A value's token width: its last axis (an op that reads it with another last axis mixes its tokens)."""
    shape = static_shape(v)
    return shape[-1] if shape else None


def _binary_ok(region: Region, node: ir.Node, i: int, target: DispatchTarget) -> str | None:
    views = _views(target, node)
    out = list(attr(node, "c_shape") or [])
    other = views.get(1 - i)
    if views.get(i) != out or other is None:
        return f"{node.op_type} broadcasts the frame tokens"
    if out[-1] != _width(node.inputs[i]):
        return f"{node.op_type} {out} does not keep its tokens"
    if other == out:  # the other operand must be frame tokens too (checked once the region is whole)
        return None
    if all(d == 1 for d in other[:-1]):
        return None  # broadcast over every token
    if i == 0 and len(out) >= 2 and other[-2:] == out[-2:] == [region.f, region.c] and all(d == 1 for d in other[:-2]):
        region.per_frame.append((node, i))  # one row per frame over the pixels (a position embedding), B its second
        return None
    return f"{node.op_type} with an operand {other} that varies by token but is not a frame token"


def grow(t: ir.Node, dims: tuple[int, int, int, int], target: DispatchTarget) -> Region | str:
    """The region a frame transpose opens, or why it cannot be read in the spatial order."""
    region = Region(*dims)
    tokenwise, binary = _family_ops(target, TOKENWISE), _family_ops(target, BINARY)
    todo = [t.outputs[0]]
    seen_nodes: set[ir.Node] = set()
    while todo:
        v = todo.pop()
        if v in region.values:
            continue
        if v.is_graph_output():
            return "the frame tokens are a graph output"
        region.values.add(v)
        for use in list(v.uses()):
            node, i = use.node, use.idx
            if node in seen_nodes:
                continue
            if movement.is_movement(node):
                chain = _exit_chain(region, v, node)
                if isinstance(chain, str):
                    return chain
                region.exits.append(chain)
                seen_nodes.update(chain)
                continue
            if not target.is_dispatch(node.domain, node.op_type):
                return f"{node.op_type} (on the CPU) reads the frame tokens"
            op = target.bfp_variants.get(node.op_type, node.op_type)
            if _is_attention(target, op):
                region.attentions.append(node)
            elif op in tokenwise:
                views = _views(target, node)
                if i not in views or i != 0:
                    return f"{node.op_type} reads the frame tokens as a weight"
                out = list(attr(node, "output_shape") or [])
                if views[0][:-1] != out[:-1] or views[0][-1] != _width(v):
                    return f"{node.op_type} {views[0]} -> {out} does not keep its tokens"
            elif op in binary:
                why = _binary_ok(region, node, i, target)
                if why:
                    return why
                region.binaries.append(node)
            else:
                return f"{node.op_type} reads the frame tokens: not token-wise"
            seen_nodes.add(node)
            todo.append(node.outputs[0])
    for node in region.binaries:
        views = _views(target, node)
        out = list(attr(node, "c_shape") or [])
        for j in (0, 1):
            if views[j] == out and node.inputs[j] not in region.values:
                return f"{node.op_type} adds frame tokens to tokens in another order"
    return region


@dataclass(frozen=True)
class Attention:
    """How one attention of the region reads the spatial order."""

    node: ir.Node
    shape: tuple[int, int, int, int]  # (B, M, K, N) of its new views
    heads: int
    assumed: list[str]
    context: tuple[Context, ...] = ()  # cross-attention: K's and V's


@dataclass(frozen=True)
class Context:
    """A cross-attention's K or V: ``gemm`` over ``e`` ([B, N, C] in memory) repeated over the pixels."""

    e: ir.Value
    n: int
    c: int
    gemm: ir.Node


def _tile_leaves(v: ir.Value, target: DispatchTarget) -> list[ir.Value] | None:
    """The operands of a chain of SDConcats (``concat_tiles``' repeat of a size-1 axis), in order."""
    p = v.producer()
    if p is None or not target.is_dispatch(p.domain, p.op_type) or p.op_type != target.op("concat").op_type:
        return [v]
    out: list[ir.Value] = []
    for x in p.inputs:
        if x is None:
            return None
        more = _tile_leaves(x, target) if len(x.uses()) == 1 else [x]
        if more is None:
            return None
        out.extend(more)
    return out


def _broadcast_context(v: ir.Value, region: Region, target: DispatchTarget) -> Context | None:
    """K or V = SDGemm(x) read as [B*S, N, C], where x is a context e [B, N, C] repeated over the S pixels: an
    Expand of e [B, 1, N, C] -> [B, S, N, C], or (batch 1, up to 64 pixels) the SDConcats of S copies of e that
    the canonical steps write for it. None for anything else."""
    gemm = v.producer()
    if gemm is None or not target.is_dispatch(gemm.domain, gemm.op_type) or \
            target.bfp_variants.get(gemm.op_type, gemm.op_type) != target.op("gemm").op_type or len(v.uses()) != 1:
        return None
    rows, n, c = (int(d) for d in attr(gemm, "input_shape"))
    x = gemm.inputs[0]
    if x is None or rows != region.b * region.s:
        return None
    p = x.producer()
    if p is not None and p.op_type == "Expand" and p.domain in ("", "ai.onnx"):
        e_shape, x_shape = static_shape(p.inputs[0]), static_shape(x)
        if e_shape == (region.b, 1, n, c) and x_shape == (region.b, region.s, n, c):
            return Context(p.inputs[0], n, c, gemm)  # type: ignore[arg-type]
        return None
    leaves = _tile_leaves(x, target)
    if region.b != 1 or not leaves or len(leaves) != region.s or any(leaf is not leaves[0] for leaf in leaves):
        return None
    shape = static_shape(leaves[0])
    if shape is None or int(np.prod(shape)) != n * c:
        return None
    return Context(leaves[0], n, c, gemm)


def plan_attention(node: ir.Node, region: Region, target: DispatchTarget) -> Attention | str:
    bq, m, k, n = (int(d) for d in attr(node, "input_shape"))
    heads = int(attr(node, "num_heads"))
    b, f, s = region.b, region.f, region.s
    if node.inputs[0] not in region.values:
        return "an attention whose queries are not the frame tokens"
    if (bq, m) != (b * s, f):
        return f"an attention over {m} of {bq} rows, not the {f} frames of {b * s} pixels"
    if any(_width(node.inputs[j]) != k for j in range(3) if node.inputs[j] in region.values):
        return "an attention that reads the frame tokens across tokens"
    if BF16_ONLY_TAG in node.metadata_props:
        return "an attention with a key-mask channel"
    kv_in = [node.inputs[j] in region.values for j in (1, 2)]
    if all(kv_in) and n == f:
        shape, new_heads = (b, f, s * k, f), heads * s
        params = {"q": (b, f, s * k), "k": (b, f, s * k), "v": (b, f, s * k), "heads": new_heads,
                  "scale": (k // heads) ** -0.5, "frame_heads": s}
        context: tuple[Context, ...] = ()
    elif not any(kv_in):
        found = [_broadcast_context(node.inputs[j], region, target) for j in (1, 2)]  # type: ignore[arg-type]
        if any(c is None for c in found):
            return "a cross-attention whose keys are not one context per sample broadcast over the pixels"
        context = tuple(found)  # type: ignore[arg-type]
        shape, new_heads = (b * f, s, k, n), heads
        params = {"q": (b * f, s, k), "k": (b * f, n, k), "v": (b * f, n, k), "heads": heads,
                  "scale": (k // heads) ** -0.5}
    elif all(kv_in):
        return f"a self-attention over {n} keys, not the {f} frames"
    else:
        return "an attention that reads the frame tokens as only one of its keys and values"
    assert target.mha_variant is not None
    op = target.mha_variant(shape[1], shape[3], new_heads)
    reason, assumed = target.spec(op).check(params)
    if reason:
        return f"{op} cannot take it: {reason}"
    return Attention(node, shape, new_heads, assumed, context)


def _copies(b: Builder, e: ir.Value, batch: int, frames: int, width: int, target: DispatchTarget) -> ir.Value:
    """``e`` ([B, N, C] in memory, ``width`` = N*C) repeated over the frames, [B, F, N, C], as SDConcats of its
    [B, 1, N*C] view along axis 1 (the repeat ``canonical.movement.concat_tiles`` writes for an Expand of a
    size-1 axis)."""
    acc, k = e, 1
    for _ in range(frames - 1):
        a_view, c_view = [batch, k, width], [batch, k + 1, width]
        acc = b.dispatch(target.op("concat").op_type, [acc, e], {"a_shape": a_view, "b_shape": [batch, 1, width],
                                                                "c_shape": c_view, "axis": 1},
                         dtype=e.dtype, shape=c_view).outputs[0]
        k += 1
    return acc


def _rewrite(graph: ir.Graph, t: ir.Node, region: Region, plans: list[Attention], target: DispatchTarget,
             counts: Counter[str], contexts: dict[tuple[ir.Value, int], ir.Value]) -> None:
    src = t.inputs[0]
    assert src is not None
    for use in list(t.outputs[0].uses()):
        if use.node.graph is not None and not movement.is_movement(use.node):
            use.node.replace_input_with(use.idx, src)
    for chain in region.exits:  # an exit reads the tokens as they now are: a view
        v, out = chain[0].inputs[0], chain[-1].outputs[0]
        if v is t.outputs[0]:
            v = src
        b = Builder(graph, RULE, target)
        shape = static_shape(out)
        view = b.op("Reshape", [v, b.const(np.asarray(shape, np.int64), "shape")], dtype=out.dtype, shape=shape)
        graph.insert_before(chain[0], b.nodes)
        reroute(graph, out, view.outputs[0])
        graph.remove(chain[::-1], safe=True)
        counts["exits -> views"] += 1
    graph.remove(t, safe=True)
    b, f, s, c = region.b, region.f, region.s, region.c
    for node, i in region.per_frame:  # the frame rows read as [1, F, 1, C] against the spatial [B, F, S, C]
        names = ("a_shape", "b_shape")
        node.attributes[names[i]] = ir.AttrInt64s(names[i], [b, f, s, c])
        node.attributes[names[1 - i]] = ir.AttrInt64s(names[1 - i], [1, f, 1, c])
        node.attributes["c_shape"] = ir.AttrInt64s("c_shape", [b, f, s, c])
        node.outputs[0].shape = ir.Shape([b, f, s, c])
        counts["per-frame operands -> [1, F, 1, C]"] += 1
    for plan in plans:
        node = plan.node
        b = Builder(graph, RULE, target)
        q, kv = node.inputs[0], [node.inputs[1], node.inputs[2]]
        if plan.context:
            for j, ctx in enumerate(plan.context):
                e, n, c, gemm = ctx.e, ctx.n, ctx.c, ctx.gemm
                if (e, region.f) not in contexts:  # made once, where e is made: every attention after it reads it
                    made = Builder(graph, RULE, target)
                    contexts[(e, region.f)] = _copies(made, e, region.b, region.f, n * c, target)
                    producer = e.producer()  # type: ignore[union-attr]
                    if producer is not None:
                        graph.insert_after(producer, made.nodes)
                    else:
                        graph.insert_before(next(iter(graph)), made.nodes)
                width = int(attr(gemm, "output_shape")[-1])
                attrs = {k: a.value for k, a in gemm.attributes.items()}
                attrs.update(input_shape=[region.b * region.f, n, c], output_shape=[region.b * region.f, n, width])
                new = b.op(gemm.op_type, [contexts[(e, region.f)], *gemm.inputs[1:]], attrs, domain=gemm.domain,
                           dtype=gemm.outputs[0].dtype, shape=[region.b * region.f, n, width])
                new.metadata_props.update({k: v for k, v in gemm.metadata_props.items()
                                           if k in (ASSUMED_TAG, BF16_ONLY_TAG)})
                kv[j] = new.outputs[0]
        else:
            counts["attentions over frames -> pixels as heads"] += 1
        if plan.context:
            counts["cross-attentions -> frames as the batch"] += 1
        new = mha_node(b, target, q, kv[0], kv[1], plan.shape, plan.heads, plan.assumed)  # type: ignore[arg-type]
        graph.insert_before(node, b.nodes)
        node.outputs[0].replace_all_uses_with(new.outputs[0])
    for node in graph:
        if target.is_dispatch(node.domain, node.op_type):
            record_views(node, target)
    counts["frame transposes -> views"] += 1


def absorb_frame_transposes(model: ir.Model, target: DispatchTarget) -> PassResult:
    graph = model.graph
    counts: Counter[str] = Counter()
    contexts: dict[tuple[ir.Value, int], ir.Value] = {}  # a context repeated over the frames, once per value
    for t in list(graph):
        if t.graph is None:
            continue
        dims = _is_frame_transpose(t)
        if dims is None or t.outputs[0].is_graph_output():
            continue
        region = grow(t, dims, target)
        plans: list[Attention] = []
        if not isinstance(region, str):
            for node in region.attentions:
                plan = plan_attention(node, region, target)
                if isinstance(plan, str):
                    region = plan
                    break
                plans.append(plan)
        if isinstance(region, str):
            log.info("frame transpose %s stays: %s", t.name, region)
            counts[f"stays: {region}"] += 1
            continue
        log.debug("frame transpose %s: %d values, %d exits, %d attentions", t.name, len(region.values),
                  len(region.exits), len(region.attentions))
        _rewrite(graph, t, region, plans, target, counts, contexts)
    counts["nodes left dead"] = remove_dead_nodes(graph)
    if counts["frame transposes -> views"]:
        views = absorb_views(model, target)  # the exits' views, read by the dispatch ops after them
        counts["views absorbed"] = sum(v for k, v in views.counts.items() if k.startswith("views absorbed"))
    changed = bool(counts["frame transposes -> views"])
    return PassResult(modified=changed, counts={k: v for k, v in counts.items() if v})
