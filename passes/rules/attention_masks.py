"""What an attention's scores are given, for ``AttentionFusion`` (``sdnpu.passes.rules.attention``): which
addend SDMHA's one load-time mask row can be, and how the others travel.

- *Read*: the addend of the scores (``bias_side``: the side that is not Q·Kᵀ's product), CLIP's causal mask
  (``is_causal``), why another constant cannot be the kernel's row (``constant_bias_reason``), TorchScript's NaN
  guard after the softmax (``nan_guard``: ``Where(IsNaN(p), 0, p)``) and whether a constant mask ever makes it act
  (``every_row_has_a_key``).
- *A key channel*: a mask the kernel's one row cannot be, but which is one row over the keys per batch
  (``key_row``: a padding mask that differs between batch rows, or one computed from an input: Lumina 2's caption
  mask), rides in Q and K as one more channel per head, the heads padded to 4x their width
  (``key_channel_operands``); ``first_quarters`` takes each head's output back out of its 4x width.
- *On the CPU*: a mask that varies per query or head (CLIP's causal mask, T5's position bias) runs as onnxruntime's
  ``com.microsoft.MultiHeadAttention`` (``cpu_attention``), whose attention_bias takes it (``bias_fits``).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import DECLINED_TAG
from sdnpu.passes.movement import MOVEMENT_OPS
from sdnpu.passes.irutil import Builder, const, is_float, producer, scalar, static_shape

if TYPE_CHECKING:  # the rule's params: the rule builds on this module
    from sdnpu.passes.rules.attention import MHAParams

MICROSOFT = "com.microsoft"  # onnxruntime's contrib ops: run by its CPU provider, not dispatch ops
COMPUTED = "the scores' addend is computed, not a constant mask"


# --- reading the scores' addend -----------------------------------------------------------------------------------

def bias_side(add: ir.Node) -> int | None:
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


def is_causal(mask: np.ndarray) -> bool:
    """0 on and below the diagonal, a huge negative number (or -inf) above it, for every batch/head."""
    if mask.ndim < 2 or mask.shape[-1] != mask.shape[-2]:
        return False
    m = mask.reshape(-1, *mask.shape[-2:])
    upper = np.triu(np.ones(m.shape[-2:], dtype=bool), k=1)
    return bool(np.all(m[:, ~upper] == 0) and np.all(m[:, upper] <= -1e4))


def constant_bias_reason(bias: np.ndarray) -> str:
    """Why a constant added to the scores (not CLIP's causal mask) cannot be SDMHA's mask."""
    rows = bias.reshape(-1, bias.shape[-1]) if bias.ndim else bias.reshape(1, 1)
    if bias.ndim >= 3 and bias.shape[-3] > 1 and bias.shape[-2] > 1 and not np.all(rows == rows[:1]):
        return (f"the scores get a {list(bias.shape)} bias that varies per head and query (T5's relative-position "
                "bias): SDMHA's mask is one row of N keys")
    return "the attention mask is not CLIP's causal mask"


def nan_guard(v: ir.Value | None) -> tuple[ir.Node, ir.Node, ir.Value] | None:
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


def computed_reason(bias: ir.Value) -> str:
    """Why an addend of the scores that the graph computes (from its inputs: transformers' causal mask merged with
    the padding mask) cannot be SDMHA's mask: it is no constant, and where it varies per query, no row over the
    keys either (a key row rides in Q and K instead: ``key_channel_operands``)."""
    full = _scores_shape(bias)
    named = f"{COMPUTED} ({mask_sources(bias)})"
    if full is not None and full[2] > 1:
        return (f"{named}, and it varies per query ({list(static_shape(bias) or ())}: {per_query_kind(bias)}): "
                "SDMHA's mask is one row of N keys")
    return named


_COMPARISONS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Trilu"})


def per_query_kind(bias: ir.Value, budget: int = 64) -> str:
    """What makes a computed addend of the scores vary per query, read from the nodes within ``budget`` upstream:
    a learned position bias (a Gather of a constant [buckets, heads] table: T5's relative attention bias; or,
    its positions static, that bias folded: a constant added that varies per query), a causal mask (the
    positions compared, or Trilu), both, or neither of those."""
    seen: set[int] = set()
    stack, kinds = [bias], set()
    while stack and budget > 0:
        v = stack.pop()
        node = v.producer() if v is not None and id(v) not in seen and v.const_value is None else None
        if node is None:
            continue
        seen.add(id(v))
        budget -= 1
        table = node.inputs[0].const_value if node.op_type == "Gather" and node.inputs else None
        if table is not None and len(table.shape) == 2 and is_float(node.inputs[0]):
            kinds.add(f"a learned position bias, a Gather of a {list(table.shape)} table")
        elif node.op_type in _COMPARISONS:
            kinds.add("a causal mask built in the graph")
        for w in node.inputs:  # a constant that varies per query, added (T5's bias folded for static positions)
            full = _scores_shape(w) if w is not None and w.const_value is not None else None
            if node.op_type == "Add" and full is not None and full[2] > 1:
                kinds.add(f"a constant {list(w.shape)} position bias")  # type: ignore[union-attr]
        stack.extend(node.inputs)
    return " and ".join(sorted(kinds, reverse=True)) or "a mask per query"


def mask_sources(bias: ir.Value, budget: int = 64) -> str:
    """What a computed addend of the scores is made from, for the report: the graph inputs it reads (the
    caption's ``encoder_attention_mask``, an ``attention_mask``), found within ``budget`` nodes upstream."""
    seen: set[int] = set()
    inputs: list[str] = []
    stack = [bias]
    while stack and budget > 0:
        v = stack.pop()
        if v is None or id(v) in seen or v.const_value is not None:
            continue
        seen.add(id(v))
        if v.is_graph_input():
            inputs.append(v.name or "?")
            continue
        node = v.producer()
        if node is None:
            continue
        budget -= 1
        stack.extend(node.inputs)
    if not inputs:
        return "from no graph input within a few nodes"
    return "from the graph input" + ("s " if len(inputs) > 1 else " ") + ", ".join(sorted(set(inputs)))


def every_row_has_a_key(mask: np.ndarray | None) -> bool:
    """Whether a constant mask added to the scores leaves each query at least one finite key (then the NaN
    guard after the softmax never acts); a computed mask: not known."""
    if mask is None:
        return False
    rows = mask.reshape(-1, mask.shape[-1]) if mask.ndim else mask.reshape(1, 1)
    return bool(np.all(np.any(np.isfinite(rows), axis=-1)))


def _scores_shape(bias: ir.Value) -> tuple[int, ...] | None:
    """A float addend of the scores as the [B, H, M, N] it broadcasts as (leading axes of 1 maybe missing)."""
    shape = static_shape(bias)
    if shape is None or len(shape) > 4 or not is_float(bias):
        return None
    return (1,) * (4 - len(shape)) + tuple(shape)


def key_row(bias: ir.Value, b: int, n: int) -> bool:
    """Whether an addend of the scores is one row over the N keys per batch ([B or 1, 1, 1, N]): a key-padding
    mask, the same for every head and query."""
    full = _scores_shape(bias)
    return full is not None and full[0] in (1, b) and full[1] == full[2] == 1 and full[3] == n


def bias_fits(bias: ir.Value, b: int, h: int, m: int, n: int) -> bool:
    """Whether onnxruntime's MultiHeadAttention takes ``bias`` as its attention_bias: [B or 1, H or 1, M, N]
    (leading axes of 1 may be missing), or one row over the keys per batch ([B or 1, 1, 1, N]: a key-padding
    mask, broadcast over the queries first)."""
    full = _scores_shape(bias)
    return full is not None and full[0] in (1, b) and full[1] in (1, h) and full[2] in (1, m) and full[3] == n


# --- a key channel in Q and K -------------------------------------------------------------------------------------

def _signature(v: ir.Value | None, memo: dict[int, str], budget: list[int]) -> str | None:
    """What computes ``v``, as text (ops, attributes, constants, graph inputs): equal for two values that the
    graph computes alike, None past a small budget of nodes or for a value no node writes."""
    if v is None:
        return "-"
    if id(v) in memo:
        return memo[id(v)]
    if v.const_value is not None:
        a = v.const_value.numpy()
        if a.size > 1 << 20:  # a weight, not a mask's ones or zeros
            return None
        digest = hashlib.blake2b(np.ascontiguousarray(a).tobytes(), digest_size=16).hexdigest()
        sig = f"c{a.dtype}{list(a.shape)}{digest}"
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


def _mask_floor(np_dtype: np.dtype, d: int) -> float:
    """The lowest mask value a head of width d carries in its channel: a power of two L whose product with the
    channel's 2 sqrt(d) on Q (and twice it: the guard's sentinel key, -2L) stays a quarter below the dtype's
    largest number. A mask below it (the exports' ``finfo.min`` fill, whose product with 2 sqrt(d) overflowed
    to -inf and turned a query whose keys are all masked into NaN; -inf itself) is raised to -L: no key's
    weight changes while one key is above it (exp(-L) is 0 beside it), and a query whose keys all are weighs
    them alike, as the graph's equal fills do. A computed row whose values its spelling does not show (a float
    input) has its -inf raised too where no guard reads it (one node, the Max that spreads the row over the
    heads): a query whose keys are all -inf, NaN in the graph, gets the mean of V. Under the guard, in a
    constant row and in a Where of 0 and -inf, -inf stays (the guard's zeros, the graph's NaN)."""
    top = int(np.floor(np.log2(float(ml_dtypes.finfo(np_dtype).max))))  # numpy's finfo lacks bfloat16
    return float(2.0 ** (top - int(np.ceil(np.log2(2.0 * np.sqrt(d)))) - 2))


_MOVES = MOVEMENT_OPS | {"Expand", "Identity", "Tile"}  # ops that keep the values a mask holds


def mask_values(v: ir.Value | None, depth: int = 12) -> set[float] | None:
    """The values a computed mask can take, where its spelling says (a Where of constants, a bool cast, a
    constant; sums and products of those with constants; through movements and casts), else None."""
    if v is None or depth < 0:
        return None
    c = const(v)
    if c is not None:
        u = np.unique(np.asarray(c, np.float64))
        return set(u.tolist()) if u.size <= 16 else None
    node = v.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type in _MOVES or node.op_type == "Cast":
        src = node.inputs[0]
        if node.op_type == "Cast" and src is not None and src.dtype == ir.DataType.BOOL:
            return {0.0, 1.0}
        return mask_values(src, depth - 1)
    if node.op_type == "Where" and len(node.inputs) == 3:
        a, b = mask_values(node.inputs[1], depth - 1), mask_values(node.inputs[2], depth - 1)
        return a | b if a is not None and b is not None else None
    if node.op_type in ("Add", "Sub", "Mul") and len(node.inputs) == 2:
        a, b = mask_values(node.inputs[0], depth - 1), mask_values(node.inputs[1], depth - 1)
        if a is None or b is None or len(a) * len(b) > 64:
            return None
        fn = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[node.op_type]
        with np.errstate(all="ignore"):
            return {float(fn(x, y)) for x in a for y in b}
    return None


def _reshape(b: Builder, x: ir.Value, shape: list[int]) -> ir.Value:
    return b.op("Reshape", [x, b.const(np.asarray(shape, np.int64), "shape")], dtype=x.dtype, shape=shape).outputs[0]


def _concat(b: Builder, parts: list[ir.Value], axis: int) -> ir.Value:
    shapes = [list(static_shape(x)) for x in parts]  # type: ignore[arg-type]
    out = list(shapes[0])
    out[axis] = sum(s[axis] for s in shapes)
    return b.op("Concat", parts, {"axis": axis}, dtype=parts[0].dtype, shape=out).outputs[0]


def key_channel_operands(b: Builder, p: MHAParams, q: ir.Value, k: ir.Value, v: ir.Value,
                          made: dict[str, ir.Value]) -> tuple[ir.Value, ir.Value, ir.Value]:
    """Q, K, V for an attention whose scores get a computed key-padding row (the caption's mask) that the
    kernel's load-time mask cannot be. Each head of width d grows to 4d: Q's head is [2q, .., c, ..],
    K's [k, .., bias, ..] (c and the bias at ``_extra_channel``, zeros elsewhere), V's
    [v, 0..]. The kernel's 1/sqrt(4d) then gives q·k/sqrt(d) + c·bias/(2 sqrt(d)): the graph's scores and
    mask, with c = 2 sqrt(d) (rounded to bf16 as every constant: exact for 0 / -inf masks, within 2^-9 of
    a finite bias). The 4x width keeps the factor on q a power of two (exact in bf16), where d + 1 would
    round q once more. The mask row is spread over the heads on the CPU once per distinct computation: an
    Expand where its spelling says it holds nothing below ``_mask_floor`` but -inf (``mask_values``: a Where
    of 0 and -inf); otherwise one Max with a constant of the heads' shape, which also raises it to the floor
    (c times the exports' ``finfo.min`` overflows), and under the NaN guard, where the row may hold -inf,
    IsInf and Where beside it keep -inf.
    Under the NaN guard (a query whose keys are all -inf gets zeros) one more key is appended: score -2L
    (below every raised mask), value 0, which takes no weight while any key is above -L (a finite fill, as the
    graph's softmax gives it no NaN) and all of it when every key is -inf (kept so under the guard)."""
    bq, m, cq = static_shape(q)  # type: ignore[misc]
    n = static_shape(k)[1]  # type: ignore[index]
    h = p.heads
    d = cq // h
    e = _extra_channel(d)
    dtype = q.dtype
    np_dtype = dtype.numpy()  # type: ignore[union-attr]
    floor = _mask_floor(np_dtype, d)
    assert p.bias is not None
    fixed, key = const(p.bias), None
    if fixed is not None:  # a constant row per batch (a padding mask the export baked in): a constant channel
        rows = np.broadcast_to(fixed.reshape(-1, 1, 1, n).transpose(0, 3, 1, 2), (bq, n, h, 1)).astype(np_dtype)
        rows = np.where(np.isneginf(rows), rows, np.maximum(rows, np_dtype.type(-floor)))  # -inf kept: exact
        row = b.const(np.ascontiguousarray(rows, dtype=np_dtype), "key_mask")
    else:
        sig = _signature(p.bias, {}, [32])
        key = f"{sig}|{bq}|{n}|{h}|{d}|{bool(p.guard)}" if sig is not None else None
        row = made.get(key) if key is not None else None
    if row is None:
        full = _scores_shape(p.bias)
        assert full is not None
        bb = full[0]
        row = _reshape(b, p.bias, [bb, n, 1, 1])
        if row.dtype != dtype:
            row = b.op("Cast", [row], {"to": int(dtype)}, dtype=dtype, shape=[bb, n, 1, 1]).outputs[0]
        values = mask_values(p.bias)
        low = b.shared_const(np.full((bq, n, h, 1), -floor, np_dtype), f"sdnpu_key_mask_floor_{bq}_{n}_{h}_{d}")
        if values is not None and all(x >= -floor or x == -np.inf for x in values):  # 0 / -inf: nothing to raise
            nodes = [b.op("Expand", [row, b.const(np.asarray([bq, n, h, 1], np.int64), "shape")], dtype=dtype,
                          shape=[bq, n, h, 1])]
        else:
            nodes = [b.op("Max", [row, low], dtype=dtype, shape=[bq, n, h, 1])]  # the Expand and the floor in one
            if p.guard and (values is None or -np.inf in values):  # -inf kept: the guard's zeros are for a query
                minus_inf = b.op("IsInf", [row], {"detect_positive": 0}, dtype=ir.DataType.BOOL,  # whose keys are
                                 shape=[bb, n, 1, 1])  # all -inf, not all finfo.min
                nodes += [minus_inf, b.op("Where", [minus_inf.outputs[0], row, nodes[0].outputs[0]], dtype=dtype,
                                          shape=[bq, n, h, 1])]
        row = nodes[-1].outputs[0]
        for node in nodes:
            node.metadata_props[DECLINED_TAG] = (
                "AttentionFusion: spreads the computed key mask over the heads (the channel it rides in Q and K), "
                "raised to what the channel holds")
        if key is not None:
            made[key] = row
    q_extra = np.zeros((bq, m, h, 3 * d), np_dtype)
    q_extra[..., e - d] = 2.0 * np.sqrt(d)
    q4 = b.op("Mul", [_reshape(b, q, [bq, m, h, d]), b.const(np.asarray(2.0, np_dtype), "two")], dtype=dtype,
              shape=[bq, m, h, d]).outputs[0]
    q_wide = _concat(b, [q4, b.shared_const(q_extra, f"sdnpu_key_channel_q_{bq}_{m}_{h}_{d}")], 3)
    # the attentions of one K and V (a joint attention's query parts: ``passes.streams``) share their widened K
    # and V, as they share the mask row (keyed by the values' identities, which ``made`` keeps alive)
    wide = f"wide|{id(p.k)}|{id(p.v)}|{id(row)}|{bq}|{n}|{h}|{d}|{bool(p.guard)}"
    if wide + "|k" in made:
        return _reshape(b, q_wide, [bq, m, 4 * cq]), made[wide + "|k"], made[wide + "|v"]
    made[wide + "|sources"], made[wide + "|source_v"] = p.k, p.v
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
        sentinel[..., e] = -2.0 * floor
        k_wide = _concat(b, [k_wide, b.shared_const(sentinel, f"sdnpu_key_channel_sentinel_{bq}_{h}_{d}")], 1)
        v_wide = _concat(b, [v_wide, b.shared_const(np.zeros((bq, 1, h, 4 * d), np_dtype),
                                                    f"sdnpu_zeros_{bq}_1_{h}_{4 * d}")], 1)
        n += 1
    made[wide + "|k"], made[wide + "|v"] = _reshape(b, k_wide, [bq, n, 4 * cq]), _reshape(b, v_wide, [bq, n, 4 * cq])
    return _reshape(b, q_wide, [bq, m, 4 * cq]), made[wide + "|k"], made[wide + "|v"]


def first_quarters(b: Builder, out: ir.Value, heads: int) -> ir.Value:
    """[B, M, H * 4d] -> [B, M, H * d]: each head's first d channels, by a 0/1 weight (a MatMul the Gemm rule
    makes an SDGemm)."""
    bq, m, wide = static_shape(out)  # type: ignore[misc]
    d = wide // (4 * heads)
    pick = np.zeros((wide, heads * d), out.dtype.numpy())  # type: ignore[union-attr]
    for i in range(heads):
        pick[i * 4 * d + np.arange(d), i * d + np.arange(d)] = 1.0
    return b.op("MatMul", [out, b.shared_const(pick, f"sdnpu_key_channel_pick_{heads}_{d}")], dtype=out.dtype,
                shape=[bq, m, heads * d]).outputs[0]


# --- on the CPU ---------------------------------------------------------------------------------------------------

def cpu_attention(b: Builder, rule: str, p: MHAParams, q: ir.Value, k: ir.Value, v: ir.Value) -> ir.Value:
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
            expand = b.op("Expand", [bias, b.const(np.asarray(full, np.int64), "shape")], dtype=bias.dtype,
                          shape=full)
            expand.metadata_props[DECLINED_TAG] = (f"{rule}: the key mask spread over the queries, as onnxruntime's "
                                                   "MultiHeadAttention takes its attention_bias ([B, H, M, N])")
            bias = expand.outputs[0]
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
