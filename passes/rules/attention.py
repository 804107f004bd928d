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
and K as one more channel per head, the heads padded to 4x their width (``_key_channel_operands``); a mask
that varies per query or head (CLIP's causal mask, T5's position bias) runs as onnxruntime's CPU attention.

The variant follows AMD's pass: the VAE's single head is SDMHA_VAE (v1.0), M >= 256 and N >= 128 the flash
SDMHA (v2), the rest SDFlatMHA (v1.1). The mask holds 0 for the N keys and -inf for the padding up to the
length DD's kernel reads (``mha_mask_length``); one mask initializer per (length, N) is shared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import BF16_ONLY_TAG, DECLINED_TAG
from sdnpu.passes import movement
from sdnpu.passes.irutil import Builder, attr, const, is_float, producer, scalar, static_shape
from sdnpu.passes.rules.base import Declined, Match, Rule

MICROSOFT = "com.microsoft"  # onnxruntime's contrib ops: run by its CPU provider, not dispatch ops


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
    if shape is None or len(shape) != 4 or target is None or len(target) != 4:
        return shape
    b, s, h, d = shape
    tb, th = target[0], target[1]
    ts, td = (target[3], target[2]) if kind == "k" else (target[2], target[3])
    if (b, s) == (tb, ts) and h * d == th * td:
        return (b, s, h * d)
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
    """From the attention output [.., M, D] down to [B, M, C] through a head merge."""
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
    cur = v
    while True:
        if static_shape(cur) == want:
            got = movement.run_chain(nodes, idx)
            if np.array_equal(got.reshape(-1), expected.reshape(-1)):
                return nodes, cur
        uses = list(cur.uses())
        if cur.is_graph_output() or len(uses) != 1 or not movement.is_movement(uses[0].node):
            return None
        nodes.append(uses[0].node)
        cur = uses[0].node.outputs[0]


def _is_causal(mask: np.ndarray) -> bool:
    """0 on and below the diagonal, a huge negative number (or -inf) above it, for every batch/head."""
    if mask.ndim < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    m = mask.reshape(-1, *mask.shape[-2:])
    upper = np.triu(np.ones(m.shape[-2:], dtype=bool), k=1)
    return bool(np.all(m[:, ~upper] == 0) and np.all(m[:, upper] <= -1e4))


def _bias_reason(bias: np.ndarray) -> str:
    """Why a constant added to the scores (not CLIP's causal mask) cannot be SDMHA's mask."""
    rows = bias.reshape(-1, bias.shape[-1]) if bias.ndim else bias.reshape(1, 1)
    if bias.ndim >= 3 and bias.shape[-3] > 1 and bias.shape[-2] > 1 and not np.all(rows == rows[:1]):
        return (f"the scores get a {list(bias.shape)} bias that varies per head and query (T5's relative-position "
                "bias): SDMHA's mask is one row of N keys")
    return "the attention mask is not CLIP's causal mask"


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
        guard = _nan_guard(node.inputs[0])
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
            side = mask_side[0] if len(mask_side) == 1 else _bias_side(p)
            if side is None:
                return "the scores' addend is computed, and neither side is the scores' product"
            bias = p.inputs[side]
            added = const(bias)
            if added is None:
                bias_reason = _COMPUTED
            elif not np.any(added) and static_shape(p.outputs[0]) == static_shape(p.inputs[1 - side]):
                bias = None  # zeros (Lumina 2's mask where no key is masked) that widen nothing: no mask at all
            elif not _is_causal(added):
                bias_reason = _bias_reason(added)
            causal = added is not None and bias is not None and _is_causal(added)
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
                       and _key_row(bias, q_shape[0], k_shape[1]))
        if key_channel:  # the target takes it, its mask given as a channel (the op that is, checked as such)
            wide = (q_shape[0], q_shape[1], 4 * q_shape[2])
            op = self.target.mha_variant(q_shape[1], k_shape[1] + int(bool(guard)), heads)
            reason, assumed = self.target.spec(op).check(
                {**params, "q": wide, "k": (k_shape[0], k_shape[1] + int(bool(guard)), wide[2]),
                 "v": (v_shape[0], v_shape[1] + int(bool(guard)), wide[2]), "scale": total / 2, "key_channel": True})
            key_channel = reason is None
        reason = None if key_channel else bias_reason or reason
        if reason and bias is not None and not _bias_fits(bias, q_shape[0], heads, q_shape[1], k_shape[1]):
            return no(reason)
        if guard and not reason and not key_channel and bias is not None and not _every_row_has_a_key(const(bias)):
            return no("a NaN guard after the softmax, and a mask that leaves a query without keys")
        nodes = [*q_chain, *k_chain, *v_chain, qk_mm, *reversed(between), sm, *(guard[:2] if guard else ()), node,
                 *out_chain]
        uniq = _own_nodes(list(dict.fromkeys(nodes)), {*q_chain, *k_chain, *v_chain})
        return Match(uniq, [out], MHAParams(q_src, k_src, v_src, heads, assumed, reason, bias, total, bool(guard),
                                            key_channel))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        p: MHAParams = m.params
        q, k_in, v = (_rank3(b, x) for x in (p.q, p.k, p.v))
        if p.cpu:
            return [_cpu_attention(b, self.name, p, q, k_in, v)]
        if p.key_channel:
            q, k_in, v = _key_channel_operands(b, p, q, k_in, v, self._key_masks)
        bq, mq, k = static_shape(q)  # type: ignore[misc]
        n = static_shape(k_in)[1]  # type: ignore[index]
        op = self.target.mha_variant(mq, n, p.heads)  # type: ignore[misc]
        mask = self.target.mha_mask(bq, mq, k, n)
        length = len(mask)
        mask_v = b.shared_const(mask, f"sdnpu_mha_mask_{length}_{n}")
        spec = self.target.spec(op)
        attrs: dict[str, object] = {"input_shape": [bq, mq, k, n], "num_heads": p.heads,
                                    "op_version": spec.attr("op_version").doc.strip("'")}
        flag = next((a.name for a in spec.attrs if a.name.startswith("is_")), None)
        if flag:
            attrs[flag] = 1
        node = b.dispatch(op, [q, k_in, v, mask_v], attrs, dtype=q.dtype, shape=[bq, mq, k],
                          assumed=p.assumed)
        if p.key_channel:  # each head's first quarter is its output: a 0/1 weight picks it (an SDGemm, fused next)
            node.metadata_props[BF16_ONLY_TAG] = "a mask channel in K: a shared exponent cannot hold its -inf"
            return [_first_quarters(b, node.outputs[0], p.heads)]
        return [node.outputs[0]]

    @property
    def _key_masks(self) -> dict[str, ir.Value]:
        """The key-mask channels made so far, by what computes them: a mask that each layer recomputes alike
        from the same input (Lumina 2's refiner layers) is made, expanded and cast once."""
        if not hasattr(self, "_masks"):
            self._masks: dict[str, ir.Value] = {}
        return self._masks


_COMPUTED = "the scores' addend is computed, not a constant mask"


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
SENTINEL = -1.0e4  # the score of the key a guarded attention gets for rows whose keys are all masked


def _scores_shape(bias: ir.Value) -> tuple[int, ...] | None:
    """A float addend of the scores as the [B, H, M, N] it broadcasts as (leading axes of 1 maybe missing)."""
    shape = static_shape(bias)
    if shape is None or len(shape) > 4 or not is_float(bias):
        return None
    return (1,) * (4 - len(shape)) + tuple(shape)


def _key_row(bias: ir.Value, b: int, n: int) -> bool:
    """Whether an addend of the scores is one row over the N keys per batch ([B or 1, 1, 1, N]): a key-padding
    mask, the same for every head and query."""
    full = _scores_shape(bias)
    return full is not None and full[0] in (1, b) and full[1] == full[2] == 1 and full[3] == n


def _signature(v: ir.Value | None, memo: dict[int, str], budget: list[int]) -> str | None:
    """What computes ``v``, as text (ops, attributes, constants, graph inputs): equal for two values that the
    graph computes alike, None past a small budget of nodes or for a value no node writes."""
    if v is None:
        return "-"
    if id(v) in memo:
        return memo[id(v)]
    if v.const_value is not None:
        a = v.const_value.numpy()
        digest = hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).hexdigest()
        sig = f"c{a.dtype}{list(a.shape)}{digest}" if a.size <= 1 << 12 else None
    elif v.is_graph_input():
        sig = f"in:{v.name}"
    else:
        node = v.producer()
        budget[0] -= 1
        if node is None or budget[0] < 0:
            return None
        ins = [_signature(x, memo, budget) for x in node.inputs]
        if any(x is None for x in ins):
            return None
        attrs = sorted((k, str(a.value)) for k, a in node.attributes.items())
        sig = f"{node.domain}:{node.op_type}{attrs}[{list(node.outputs).index(v)}]({','.join(ins)})"  # type: ignore[arg-type]
    if sig is not None:
        memo[id(v)] = sig
    return sig


def _extra_channel(d: int) -> int:
    """Where a head of width d, padded to 4d, carries the mask: the first channel of a block of 8 that the
    head's own values do not touch (AMD's bfp16 shares an exponent per 8 channels), else right after them."""
    e = 8 * -(-d // 8)
    return e if e < 4 * d else d


def _reshape(b: Builder, x: ir.Value, shape: list[int]) -> ir.Value:
    return b.op("Reshape", [x, b.const(np.asarray(shape, np.int64), "shape")], dtype=x.dtype, shape=shape).outputs[0]


def _concat(b: Builder, parts: list[ir.Value], axis: int) -> ir.Value:
    shapes = [list(static_shape(x)) for x in parts]  # type: ignore[arg-type]
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    return b.op("Concat", parts, {"axis": axis}, dtype=parts[0].dtype, shape=out).outputs[0]


def _key_channel_operands(b: Builder, p: MHAParams, q: ir.Value, k: ir.Value, v: ir.Value,
                          made: dict[str, ir.Value]) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Q, K, V for an attention whose scores get a computed key-padding row (the caption's mask) that the
    kernel's load-time mask cannot be. Each head of width d grows to 4d: Q's head is [2q, .., c, ..],
    K's [k, .., bias, ..] (c and the bias at ``_extra_channel``, zeros elsewhere), V's
    [v, 0..]. The kernel's 1/sqrt(4d) then gives q·k/sqrt(d) + c·bias/(2 sqrt(d)): the graph's scores and
    mask, with c = 2 sqrt(d) (rounded to bf16 as every constant: exact for 0 / -inf masks, within 2^-9 of
    a finite bias). The 4x width keeps the factor on q a power of two (exact in bf16), where d + 1 would
    round q once more. The mask row is expanded over the heads on the CPU, once per distinct computation.
    Under the NaN guard (a query whose keys are all masked gets zeros) one more key is appended: score
    SENTINEL, value 0, which takes no weight while any key is unmasked (exp(-1e4) is 0) and all of it when
    none is."""
    bq, m, cq = static_shape(q)  # type: ignore[misc]
    n = static_shape(k)[1]  # type: ignore[index]
    h = p.heads
    d = cq // h
    e = _extra_channel(d)
    dtype = q.dtype
    np_dtype = dtype.numpy()  # type: ignore[union-attr]
    assert p.bias is not None
    fixed, key = const(p.bias), None
    if fixed is not None:  # a constant row per batch (a padding mask the export baked in): a constant channel
        rows = np.broadcast_to(fixed.reshape(-1, 1, 1, n).transpose(0, 3, 1, 2), (bq, n, h, 1))
        row = b.const(np.ascontiguousarray(rows, dtype=np_dtype), "key_mask")
    else:
        sig = _signature(p.bias, {}, [32])
        key = f"{sig}|{bq}|{n}|{h}" if sig is not None else None
        row = made.get(key) if key is not None else None
    if row is None:
        full = _scores_shape(p.bias)
        assert full is not None
        bb = full[0]
        row = _reshape(b, p.bias, [bb, n, 1, 1])
        if row.dtype != dtype:
            row = b.op("Cast", [row], {"to": int(dtype)}, dtype=dtype, shape=[bb, n, 1, 1]).outputs[0]
        row = b.op("Expand", [row, b.const(np.asarray([bq, n, h, 1], np.int64), "shape")], dtype=dtype,
                   shape=[bq, n, h, 1]).outputs[0]
        row.producer().metadata_props[DECLINED_TAG] = (  # type: ignore[union-attr]
            "AttentionFusion: spreads the computed key mask over the heads (the channel it rides in Q and K)")
        if key is not None:
            made[key] = row
    q_extra = np.zeros((bq, m, h, 3 * d), np_dtype)
    q_extra[..., e - d] = 2.0 * np.sqrt(d)
    q4 = b.op("Mul", [_reshape(b, q, [bq, m, h, d]), b.const(np.asarray(2.0, np_dtype), "two")], dtype=dtype,
              shape=[bq, m, h, d]).outputs[0]
    q_wide = _concat(b, [q4, b.shared_const(q_extra, f"sdnpu_key_channel_q_{bq}_{m}_{h}_{d}")], 3)
    k_parts = [_reshape(b, k, [bq, n, h, d])]
    if e > d:
        k_parts.append(b.shared_const(np.zeros((bq, n, h, e - d), np_dtype), f"sdnpu_zeros_{bq}_{n}_{h}_{e - d}"))
    k_parts += [row, b.shared_const(np.zeros((bq, n, h, 4 * d - e - 1), np_dtype),
                                    f"sdnpu_zeros_{bq}_{n}_{h}_{4 * d - e - 1}")]
    k_wide = _concat(b, k_parts, 3)
    v_wide = _concat(b, [_reshape(b, v, [bq, n, h, d]),
                         b.shared_const(np.zeros((bq, n, h, 3 * d), np_dtype), f"sdnpu_zeros_{bq}_{n}_{h}_{3 * d}")], 3)
    if p.guard:
        sentinel = np.zeros((bq, 1, h, 4 * d), np_dtype)
        sentinel[..., e] = SENTINEL
        k_wide = _concat(b, [k_wide, b.shared_const(sentinel, f"sdnpu_key_channel_sentinel_{bq}_{h}_{d}")], 1)
        v_wide = _concat(b, [v_wide, b.shared_const(np.zeros((bq, 1, h, 4 * d), np_dtype),
                                                    f"sdnpu_zeros_{bq}_1_{h}_{4 * d}")], 1)
        n += 1
    return (_reshape(b, q_wide, [bq, m, 4 * cq]), _reshape(b, k_wide, [bq, n, 4 * cq]),
            _reshape(b, v_wide, [bq, n, 4 * cq]))


def _first_quarters(b: Builder, out: ir.Value, heads: int) -> ir.Value:
    """[B, M, H * 4d] -> [B, M, H * d]: each head's first d channels, by a 0/1 weight (a MatMul the Gemm rule
    makes an SDGemm)."""
    bq, m, wide = static_shape(out)  # type: ignore[misc]
    d = wide // (4 * heads)
    pick = np.zeros((wide, heads * d), out.dtype.numpy())  # type: ignore[union-attr]
    for i in range(heads):
        pick[i * 4 * d + np.arange(d), i * d + np.arange(d)] = 1.0
    return b.op("MatMul", [out, b.shared_const(pick, f"sdnpu_key_channel_pick_{heads}_{d}")], dtype=out.dtype,
                shape=[bq, m, heads * d]).outputs[0]


def _nan_guard(v: ir.Value | None) -> tuple[ir.Node, ir.Node, ir.Value] | None:
    """``Where(IsNaN(p), 0, p)`` writing ``v`` (TorchScript's scaled_dot_product_attention with a mask: a query
    whose keys are all masked gets zeros, not NaN): (its IsNaN, its Where, p); else None."""
    where = producer(v, "Where")
    if where is None or len(where.inputs) != 3:
        return None
    isnan = producer(where.inputs[0], "IsNaN")
    p = where.inputs[2]
    if isnan is None or isnan.inputs[0] is not p or scalar(where.inputs[1]) != 0.0 or p is None \
            or static_shape(where.outputs[0]) != static_shape(p):
        return None
    return isnan, where, p


def _every_row_has_a_key(mask: np.ndarray | None) -> bool:
    """Whether a constant mask added to the scores leaves each query at least one finite key (then the NaN
    guard after the softmax never acts); a computed mask: not known."""
    if mask is None:
        return False
    rows = mask.reshape(-1, mask.shape[-1]) if mask.ndim else mask.reshape(1, 1)
    return bool(np.all(np.any(np.isfinite(rows), axis=-1)))


def _bias_side(add: ir.Node) -> int | None:
    """Which input of the Add before the Softmax is the addend (a runtime mask), the other being Q·Kᵀ's
    product (maybe scaled): None where neither is."""
    for i, v in enumerate(add.inputs):
        other = add.inputs[1 - i]
        p = other.producer() if other is not None else None
        while p is not None and p.op_type in ("Mul", "Div") and p.domain in ("", "ai.onnx"):
            p = p.inputs[0].producer() if p.inputs[0] is not None else None
        if p is not None and p.op_type == "MatMul" and v is not None:
            return i
    return None


def _bias_fits(bias: ir.Value, b: int, h: int, m: int, n: int) -> bool:
    """Whether onnxruntime's MultiHeadAttention takes ``bias`` as its attention_bias: [B or 1, H or 1, M, N]
    (leading axes of 1 may be missing), or one row over the keys per batch ([B or 1, 1, 1, N]: a key-padding
    mask, broadcast over the queries first)."""
    full = _scores_shape(bias)
    return full is not None and full[0] in (1, b) and full[1] in (1, h) and full[2] in (1, m) and full[3] == n


def _cpu_attention(b: Builder, rule: str, p: MHAParams, q: ir.Value, k: ir.Value, v: ir.Value) -> ir.Value:
    """The attention the target cannot take (a causal mask, a per-head bias: SDMHA's mask is one row over the
    keys) as one onnxruntime ``com.microsoft.MultiHeadAttention`` on the CPU: Q [B, M, C], K and V [B, N, C],
    the scores' addend as its attention_bias, the scale as the product of every scalar met. One CPU node
    instead of the head moves, two MatMuls, the Add and the Softmax."""
    inputs: list[ir.Value | None] = [q, k, v]
    if p.bias is not None:
        shape = static_shape(p.bias)
        assert shape is not None
        bias = p.bias
        full = [1] * (4 - len(shape)) + list(shape)
        if len(shape) < 4:
            bias = b.op("Reshape", [bias, b.const(np.asarray(full, np.int64), "shape")], dtype=bias.dtype,
                        shape=full).outputs[0]
        if full[2] != static_shape(q)[1]:  # type: ignore[index]  # one row over the keys: every query's
            full[2] = static_shape(q)[1]  # type: ignore[index]
            bias = b.op("Expand", [bias, b.const(np.asarray(full, np.int64), "shape")], dtype=bias.dtype,
                        shape=full).outputs[0]
        inputs += [None, None, bias]
    bq, mq, _ = static_shape(q)  # type: ignore[misc]
    cv = static_shape(v)[2]  # type: ignore[index]
    node = b.op("MultiHeadAttention", inputs, {"num_heads": p.heads, "scale": float(p.scale)}, domain=MICROSOFT,
                dtype=q.dtype, shape=[bq, mq, cv])
    node.metadata_props[DECLINED_TAG] = (f"{rule}: {p.cpu}; runs on the CPU as one onnxruntime "
                                         "MultiHeadAttention")
    out = node.outputs[0]
    if p.guard:  # a query whose keys are all masked: NaN from its softmax, zeros in the graph, so zeros here
        isnan = b.op("IsNaN", [out], dtype=ir.DataType.BOOL, shape=[bq, mq, cv])
        zero = b.const(np.zeros((), out.dtype.numpy()), "zero")  # type: ignore[union-attr]
        guarded = b.op("Where", [isnan.outputs[0], zero, out], dtype=q.dtype, shape=[bq, mq, cv])
        for n in (isnan, guarded):
            n.metadata_props[DECLINED_TAG] = f"{rule}: the attention's NaN guard (a query without keys gives zeros)"
        out = guarded.outputs[0]
    return out


def _rank3(b: Builder, x: ir.Value) -> ir.Value:
    """A [B, S, H, D] source as the [B, S, H * D] view SDMHA takes (the op absorbs the Reshape)."""
    shape = static_shape(x)
    if shape is None or len(shape) == 3:
        return x
    return _reshape(b, x, [shape[0], shape[1], shape[2] * shape[3]])
