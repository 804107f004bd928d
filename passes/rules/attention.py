"""SDMHA: scaled dot-product attention with its head split and merge, from any exporter.

    Q: [B, M, C] -> heads [B, H, M, D]     (Reshape/Transpose chain, any spelling; maybe a scalar Mul; a
                                            source already [B, M, H, D], as SD3.5's per-head norms leave it
                                            (passes/joint.py), is read as its [B, M, C] view)
    K: [B, N, C] -> heads [B, H, D, N]
    V: [B, N, C] -> heads [B, H, N, D]
    O = Softmax(Q·K * scale) · V : [B, H, M, D] -> merge heads -> [B, M, C]
    ==> SDMHA | SDFlatMHA | SDMHA_VAE (Q [B, M, C], K [B, N, C], V [B, N, C], mask [L])

Pattern: ``MatMul(Softmax(MatMul(q, k) [* s]), v)``. Check: walking up from q, k, v through movement and
scalar-scale nodes reaches rank-3 sources whose chains *are* head splits, run on an index tensor (so the
TorchScript spelling with its Sqrt(Sqrt(d)) scales on q and kᵀ and the dynamo one match alike), and walking
down from the output reaches [B, M, C] through a head merge. ``scale`` is the product of every scalar met and
must be the kernel's 1/sqrt(d); a causal mask (CLIP) cannot be expressed by the kernel's one-row mask.
Grouped-query attention's key and value heads, repeated (a Tile of the heads, which the canonical steps write as
a Concat: SDConcat), are read as the [B, N, C] source they are. TorchScript's NaN guard after the softmax
(``Where(IsNaN(p), 0, p)``: a query whose keys are all masked gets zeros) is part of the pattern: dropped where
the mask leaves every query a key, kept after onnxruntime's CPU attention where a computed mask may not.

A mask the kernel's one load-time row cannot be, but which is one row over the keys per batch (a padding
mask that differs between batch rows, or one computed from an input: Lumina 2's caption mask), rides in Q
and K as one more channel per head, the heads padded to 4x their width; a mask that varies per query or head
(CLIP's causal mask, T5's position bias) runs as onnxruntime's CPU attention. Reading the masks and carrying
them: ``sdnpu.passes.rules.attention_masks``.

The variant follows AMD's pass: the VAE's single head is SDMHA_VAE (v1.0), M >= 256 and N >= 128 the flash
SDMHA (v2), the rest SDFlatMHA (v1.1). The mask holds 0 for the N keys and -inf for the padding up to the
length DD's kernel reads (``mha_mask_length``); one mask initializer per (length, N) is shared.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import BF16_ONLY_TAG
from sdnpu.ops.target import DispatchTarget
from sdnpu.passes import movement
from sdnpu.passes.irutil import Builder, attr, const, producer, scalar, static_shape
from sdnpu.passes.rules.attention_masks import (bias_fits, bias_side, computed_reason, constant_bias_reason,
                                                cpu_attention, every_row_has_a_key, first_quarters, is_causal,
                                                key_channel_operands, key_row, nan_guard)
from sdnpu.passes.rules.base import Declined, Match, Rule

@dataclass(frozen=True)
class MHAParams:
    q: ir.Value
    k: ir.Value
    v: ir.Value
    heads: int
    assumed: list[str]
    cpu: str | None = None  # why the target cannot take it: then onnxruntime's MultiHeadAttention on the CPU
    bias: ir.Value | None = None  # what is added to the scores (a causal mask, T5's position bias)
    scale: float = 1.0
    guard: bool = False  # a NaN guard on the probabilities (a row whose keys are all masked gives zeros)
    key_channel: bool = False  # a computed key-padding mask carried in Q and K as one more channel per head
    views: tuple[tuple[int, ...], ...] = ()  # q, k, v read as [B, S, C]
    merged: tuple[int, ...] | None = None  # the output's own shape where it is the heads side by side, [B, M, H, D]


def _head_split(src: tuple[int, ...], heads: int, kind: str) -> np.ndarray | None:
    idx = movement.index_tensor(src)
    if idx is None:
        return None
    b, s, c = src
    split = idx.reshape(b, s, heads, c // heads)
    return split.transpose(0, 2, 3, 1) if kind == "k" else split.transpose(0, 2, 1, 3)


def _as_rank3(shape: tuple[int, ...] | None, target: tuple[int, ...] | None, kind: str) -> tuple[int, ...] | None:
    """A source's [B, S, C]: its own, or a 4-D [B, S, h, d] read as one where the heads the attention reads
    (``target``: [B, H, S, D], K's [B, H, D, S]) hold its h * d channels per token: heads already apart
    ([B, S, H, D]), or grouped-query attention's key and value heads repeated ([B, S, Hkv, r * D], the Concat
    a Tile of the heads is, ``canonical.movement.concat_tiles``). The split itself is checked on index tensors."""
    if shape is not None and len(shape) == 3 and target is not None and len(target) == 4 and shape[1] == 1 \
            and target[0] == 1 and shape[0] == (target[3] if kind == "k" else target[2]) and shape[0] > 1:
        return (1, shape[0], shape[2])  # sequence first, batch 1 ([S, 1, C]: torch's MultiheadAttention, HunyuanDiT's
        # attention pool), the [1, S, C] it views
    if shape is None or len(shape) != 4 or target is None or len(target) != 4:
        return shape
    b, s, h, d = shape
    tb, th = target[0], target[1]
    ts, td = (target[3], target[2]) if kind == "k" else (target[2], target[3])
    if (b, s) == (tb, ts) and h * d == th * td:
        return (b, s, h * d)
    if s == 1 and th == 1 and (b, h) == (tb, ts) and d == td:  # one head, its axis already there: [B, 1, S, D]
        return (b, h, d)  # (Qwen-Image's VAE attention: q, k, v one Split of the [B, 1, S, 3D] projection)
    return shape


def _check_split(src: ir.Value, chain: list[ir.Node], target: ir.Value, heads: int, kind: str) -> bool:
    t_shape = static_shape(target)
    shape = _as_rank3(static_shape(src), t_shape, kind)
    if shape is None or t_shape is None or len(shape) != 3 or shape[2] % heads:
        return False
    expected = _head_split(shape, heads, kind)
    idx = movement.index_tensor(shape)
    if expected is None or idx is None:
        return False
    got = movement.run_chain_ignoring_scale(chain, idx.reshape(static_shape(src)))  # type: ignore[arg-type]
    return got.shape == t_shape and np.array_equal(got.reshape(-1), expected.reshape(-1))


def _trace_down(v: ir.Value, want: tuple[int, ...], heads: int) -> tuple[list[ir.Node], ir.Value] | None:
    """From the attention output [.., M, D] down to [B, M, C] through a head merge; or, where the graph goes on
    from the heads side by side ([B, M, H, D], the merge's own view: Lumina-Next gates and sums its two
    attentions per head before it flattens them), to the last such value the movements reach."""
    nodes: list[ir.Node] = []
    shape = static_shape(v)
    if shape is None:
        return None
    idx = movement.index_tensor(shape)
    if idx is None:
        return None
    b, m, c = want
    if b * m * c != idx.size or c % heads:
        return None
    expected = idx.reshape(b, heads, m, c // heads).transpose(0, 2, 1, 3).reshape(b, m, c)
    side_by_side = (b, m, heads, c // heads)
    found: tuple[list[ir.Node], ir.Value] | None = None
    cur = v
    while True:
        if static_shape(cur) in (want, side_by_side):
            got = movement.run_chain(nodes, idx)
            if np.array_equal(got.reshape(-1), expected.reshape(-1)):
                if static_shape(cur) == want:
                    return nodes, cur
                found = (list(nodes), cur)
        uses = list(cur.uses())
        if cur.is_graph_output() or len(uses) != 1 or not movement.is_movement(uses[0].node):
            return found
        nodes.append(uses[0].node)
        cur = uses[0].node.outputs[0]


def _own_nodes(nodes: list[ir.Node], chains: set[ir.Node]) -> list[ir.Node]:
    """``nodes`` less the head-split nodes that another reader shares (SD3's attentions, one per query part,
    read the joint K and V through one split): SDMHA reads the sources, so those stay for the other."""
    inside = set(nodes)
    changed = True
    while changed:
        changed = False
        for n in [n for n in nodes if n in inside and n in chains]:
            if any(o.is_graph_output() or any(u.node not in inside for u in o.uses()) for o in n.outputs):
                inside.discard(n)
                changed = True
    return [n for n in nodes if n in inside]


class AttentionFusion(Rule):
    name = "AttentionFusion"
    anchors = ("MatMul",)

    def match(self, node: ir.Node) -> Match | str | None:
        guard = nan_guard(node.inputs[0])
        sm = producer(guard[2] if guard else node.inputs[0], "Softmax")
        if sm is None:
            return None
        qk = sm.inputs[0]
        between: list[ir.Node] = []
        scale = 1.0
        p = qk.producer() if qk is not None else None
        causal, bias, bias_reason = False, None, None
        if p is not None and p.op_type == "Add" and p.domain in ("", "ai.onnx"):
            mask_side = [i for i, v in enumerate(p.inputs) if const(v) is not None]
            side = mask_side[0] if len(mask_side) == 1 else bias_side(p)
            if side is None:
                return "the scores' addend is computed, and neither side is the scores' product"
            bias = p.inputs[side]
            added = const(bias)
            if added is None:
                bias_reason = computed_reason(bias)
            elif not np.any(added) and static_shape(p.outputs[0]) == static_shape(p.inputs[1 - side]):
                bias = None  # zeros (Lumina 2's mask where no key is masked) that widen nothing: no mask at all
            elif not is_causal(added):
                bias_reason = constant_bias_reason(added)
            causal = added is not None and bias is not None and is_causal(added)
            between.append(p)
            p = p.inputs[1 - side].producer()  # type: ignore[union-attr]
        while p is not None and p.op_type in ("Mul", "Div") and len(p.inputs) == 2:
            # the scale on either side of a Mul (Mul(s, scores) as well as Mul(scores, s)); a Div's divisor
            if scalar(p.inputs[1]) is not None:
                side = 1
            elif p.op_type == "Mul" and scalar(p.inputs[0]) is not None:
                side = 0
            else:
                break
            s = scalar(p.inputs[side])
            scale *= s if p.op_type == "Mul" else 1.0 / s  # type: ignore[operator]
            between.append(p)
            rest = p.inputs[1 - side]
            p = rest.producer() if rest is not None else None
        if p is not None and p.op_type == "Tanh" and p.domain in ("", "ai.onnx"):
            capped = _soft_capped(p)
            if capped is not None:  # Gemma 2's scores: neither kernel has the cap, so the core stays and says why
                return Declined("the scores are soft-capped (c * tanh(s / c), Gemma 2's attention logit "
                                "softcapping): SDMHA and onnxruntime's MultiHeadAttention take the product alone",
                                [capped, sm, node])
        if p is None or p.op_type != "MatMul" or p.domain not in ("", "ai.onnx"):
            return None
        qk_mm = p
        # a refusal leaves the two products and the softmax on the CPU, each saying why (not the registry's "MatMul
        # of two activations"); the scale and the mask's Add stay the glue's to lower
        core = [qk_mm, sm, node]

        def no(reason: str) -> Declined:
            mask = bias_reason or ("a causal mask" if causal else None)
            return Declined(reason if mask is None or mask in reason else f"{reason}; its mask: {mask}", core)

        rank = len(static_shape(sm.outputs[0]) or ())
        if attr(sm, "axis", -1) not in (-1, rank - 1):
            return no("softmax is not over the last axis")
        q_src, q_chain, q_s = movement.trace_up(qk_mm.inputs[0])  # type: ignore[arg-type]
        k_src, k_chain, k_s = movement.trace_up(qk_mm.inputs[1])  # type: ignore[arg-type]
        v_src, v_chain, _ = movement.trace_up(node.inputs[1], allow_scale=False)  # type: ignore[arg-type]
        head_dim = (static_shape(qk_mm.inputs[0]) or (0,))[-1]
        q_shape = _as_rank3(static_shape(q_src), static_shape(qk_mm.inputs[0]), "q")
        v_shape = _as_rank3(static_shape(v_src), static_shape(node.inputs[1]), "v")
        if q_shape is None or v_shape is None or len(q_shape) != 3 or not head_dim:
            if _repeats_heads(qk_mm.inputs[1]) or _repeats_heads(node.inputs[1]):
                return no("k and v repeat their heads with an Expand (grouped-query attention): SDMHA takes as many "
                          "k and v heads as q heads")
            return no("q, k, v are not rank-3 [B, S, C] tensors behind their reshapes")
        heads = q_shape[2] // head_dim
        for src, chain, target, kind in ((q_src, q_chain, qk_mm.inputs[0], "q"), (k_src, k_chain, qk_mm.inputs[1], "k"),
                                         (v_src, v_chain, node.inputs[1], "v")):
            if not _check_split(src, chain, target, heads, kind):  # type: ignore[arg-type]
                return no(f"the {kind} reshapes are not a split into {heads} heads")
        down = _trace_down(node.outputs[0], (q_shape[0], q_shape[1], v_shape[2]), heads)
        if down is None:
            return no("the output is not merged back to [B, M, C]")
        out_chain, out = down
        k_shape = _as_rank3(static_shape(k_src), static_shape(qk_mm.inputs[1]), "k")
        assert k_shape is not None
        assert self.target.mha_variant is not None, f"{self.target.name} has no attention op"
        op = self.target.mha_variant(q_shape[1], k_shape[1], heads)
        total = scale * q_s * k_s
        params = {"q": q_shape, "k": k_shape, "v": v_shape, "heads": heads, "causal": causal, "scale": total}
        reason, assumed = self.target.spec(op).check(params)
        key_channel = (bias_reason is not None and not causal and reason is None and bias is not None
                       and key_row(bias, q_shape[0], k_shape[1]))
        if key_channel:  # the target takes it, its mask given as a channel (the op that is, checked as such)
            wide = (q_shape[0], q_shape[1], 4 * q_shape[2])
            op = self.target.mha_variant(q_shape[1], k_shape[1] + int(bool(guard)), heads)
            reason, assumed = self.target.spec(op).check(
                {**params, "q": wide, "k": (k_shape[0], k_shape[1] + int(bool(guard)), wide[2]),
                 "v": (v_shape[0], v_shape[1] + int(bool(guard)), wide[2]), "scale": total / 2, "key_channel": True})
            key_channel = reason is None
        reason = None if key_channel else bias_reason or reason
        if reason and bias is not None and not bias_fits(bias, q_shape[0], heads, q_shape[1], k_shape[1]):
            return no(reason)
        if guard and not reason and not key_channel and bias is not None and not every_row_has_a_key(const(bias)):
            return no("a NaN guard after the softmax, and a mask that leaves a query without keys")
        nodes = [*q_chain, *k_chain, *v_chain, qk_mm, *reversed(between), sm, *(guard[:2] if guard else ()), node,
                 *out_chain]
        uniq = _own_nodes(list(dict.fromkeys(nodes)), {*q_chain, *k_chain, *v_chain})
        merged = static_shape(out)
        return Match(uniq, [out], MHAParams(q_src, k_src, v_src, heads, assumed, reason, bias, total, bool(guard),
                                            key_channel, (q_shape, k_shape, v_shape),
                                            merged if merged is not None and len(merged) == 4 else None))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        out = self._rewrite(b, m)
        merged = m.params.merged
        if merged is None:
            return [out]
        return [b.op("Reshape", [out, b.const(np.asarray(merged, np.int64), "shape")], dtype=out.dtype,
                     shape=list(merged)).outputs[0]]  # the heads side by side: a view the readers absorb

    def _rewrite(self, b: Builder, m: Match) -> ir.Value:
        p: MHAParams = m.params
        q, k_in, v = (_rank3(b, x, view) for x, view in zip((p.q, p.k, p.v), p.views, strict=True))
        if p.cpu:
            return cpu_attention(b, self.name, p, q, k_in, v)
        if p.key_channel:
            q, k_in, v = key_channel_operands(b, p, q, k_in, v, self._key_masks)
        bq, mq, k = static_shape(q)  # type: ignore[misc]
        n = static_shape(k_in)[1]  # type: ignore[index]
        node = mha_node(b, self.target, q, k_in, v, (bq, mq, k, n), p.heads, p.assumed)
        if p.key_channel:  # each head's first quarter is its output: a 0/1 weight picks it (an SDGemm, fused next)
            node.metadata_props[BF16_ONLY_TAG] = "a mask channel in K: a shared exponent cannot hold its -inf"
            return first_quarters(b, node.outputs[0], p.heads)
        return node.outputs[0]

    @property
    def _key_masks(self) -> dict[str, ir.Value]:
        """The key-mask channels made so far, by what computes them: a mask that each layer recomputes alike
        from the same input (Lumina 2's refiner layers) is made, expanded and cast once."""
        if not hasattr(self, "_masks"):
            self._masks: dict[str, ir.Value] = {}
        return self._masks


def mha_node(b: Builder, target: DispatchTarget, q: ir.Value, k: ir.Value, v: ir.Value,
             shape: tuple[int, int, int, int], heads: int, assumed: list[str]) -> ir.Node:
    """The target's attention op over Q [B, M, K], K and V [B, N, K] (``shape`` = (B, M, K, N): the views it
    reads its operands as), its variant, mask and flags as AMD's pass writes them."""
    bq, mq, width, n = shape
    assert target.mha_variant is not None, f"{target.name} has no attention op"
    op = target.mha_variant(mq, n, heads)
    mask = target.mha_mask(bq, mq, width, n)
    mask_v = b.shared_const(mask, f"sdnpu_mha_mask_{len(mask)}_{n}")
    spec = target.spec(op)
    attrs: dict[str, object] = {"input_shape": [bq, mq, width, n], "num_heads": heads,
                                "op_version": spec.attr("op_version").doc.strip("'")}
    flag = next((a.name for a in spec.attrs if a.name.startswith("is_")), None)
    if flag:
        attrs[flag] = 1
    return b.dispatch(op, [q, k, v, mask_v], attrs, dtype=q.dtype, shape=[bq, mq, width], assumed=assumed)


def _soft_capped(tanh: ir.Node) -> ir.Node | None:
    """The scores' product (a MatMul) under a soft cap: ``Tanh`` of it divided (or multiplied) by a scalar, maybe
    scaled first; else None."""
    v = tanh.inputs[0]
    for _ in range(4):
        p = v.producer() if v is not None else None
        if p is None or p.domain not in ("", "ai.onnx"):
            return None
        if p.op_type == "MatMul":
            return p
        if p.op_type not in ("Mul", "Div") or len(p.inputs) != 2 or scalar(p.inputs[1]) is None:
            return None
        v = p.inputs[0]
    return None


def _repeats_heads(v: ir.Value | None, depth: int = 6) -> bool:
    """Whether ``v`` (k or v at the attention's product) comes through an Expand among its movements: grouped-query
    attention repeats each k / v head for several q heads (``repeat_kv``: Unsqueeze, Expand, Reshape)."""
    for _ in range(depth):
        p = v.producer() if v is not None else None
        if p is None or p.domain not in ("", "ai.onnx"):
            return False
        if p.op_type == "Expand":
            return True
        if p.op_type not in ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten"):
            return False
        v = p.inputs[0]
    return False


def _rank3(b: Builder, x: ir.Value, view: tuple[int, ...]) -> ir.Value:
    """A [B, S, H, D] (or one head's [B, 1, S, D], or a sequence-first [S, 1, C]) source as the [B, S, C]
    ``view`` SDMHA takes (the op absorbs the Reshape)."""
    shape = static_shape(x)
    if shape is None or tuple(shape) == tuple(view):
        return x
    return b.op("Reshape", [x, b.const(np.asarray(view, np.int64), "shape")], dtype=x.dtype,
                shape=list(view)).outputs[0]
