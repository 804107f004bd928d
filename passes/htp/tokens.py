"""An attention's tokens padded to a multiple of ``ALIGN`` (``pad_attention_tokens``), for QNN's compiler.

QNN 2.51's HTP compiler takes an attention's ``MatMul -> Softmax -> MatMul`` over a token count that is a
multiple of 64 in seconds, and over one that is not for many minutes and many gigabytes. Measured here on one
attention alone, ``[2, 6, n, 64]`` per head group, scores ``[2, 6, n, n]``, fallback off (``bench/results.md``):
n = 4096 in 50 s at 0.92 GB peak, n = 4480 in 33 s at 1.08 GB, n = 4429 still compiling at 8.4 GB after 300 s.
4429 is SD 3.5's joint attention at 1024 px (4096 image tokens and 333 of text); one SD 3.5 block's compile was
killed at this machine's 24 GB after 10 minutes, where SDXL's attentions (4096 tokens) compile in seconds.

So an attention over ``M`` queries and ``N`` keys, either not a multiple of ``ALIGN``, is computed over ``M'`` and
``N'``, the next multiples: Q's rows and V's rows padded with zeros (``Pad``), Kᵀ's columns too, and before the
softmax an ``Add`` of a constant row that is 0 on the ``N`` keys and ``PAD_SCORE`` (-1e4, the floor of the
masks on this target) on the padded ones, whose softmax weights are then exactly 0 in float32 and fp16
(``exp(-1e4)`` underflows both); the ``M' - M`` padded query rows are computed and dropped (``Slice``). The
attention's output is the same numbers up to the softmax's summation order. A scale, mask or bias between the
product and the softmax (the forms ``sdnpu.passes.htp.heads`` matches) is padded with what leaves the padded
scores as they were: 0 for an ``Add``/``Sub``, 1 for a ``Mul``/``Div``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import RULE_TAG
from sdnpu.passes.htp.common import RULE, constant, node_name, unique_name
from sdnpu.passes.htp.headroom import MASK_FLOOR
from sdnpu.passes.htp.heads import attentions, static_shape
from sdnpu.passes.manager import PassResult

ALIGN = 64  # tokens: a multiple compiles fast (4096, 4480), 4429 did not
PAD_FROM = 1024  # fewer tokens than this on both sides: QNN's compile is quick either way, and padding costs
PAD_SCORE = MASK_FLOOR  # the padded keys' score: exp() of it is 0 in fp16 and float32


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _pad(graph: ir.Graph, anchor: ir.Node, v: ir.Value, axis: int, extra: int, fill: float, hint: str
         ) -> ir.Value:
    """``v`` with ``extra`` more rows along ``axis`` (negative: from the end) holding ``fill``; a constant is
    padded offline."""
    shape = static_shape(v)
    assert shape is not None
    rank = len(shape)
    axis %= rank
    if v.const_value is not None:
        a = np.asarray(v.const_value.numpy())
        widths = [(0, extra if d == axis else 0) for d in range(rank)]
        return constant(graph, np.pad(a, widths, constant_values=fill).astype(a.dtype), f"{hint}_padded")
    pads = constant(graph, np.asarray([0] * rank + [extra if d == axis else 0 for d in range(rank)], np.int64),
                    f"{hint}_pads")
    dtype = v.dtype or ir.DataType.FLOAT
    value = constant(graph, np.asarray(fill, dtype=dtype.numpy()), f"{hint}_fill")
    node = ir.node("Pad", [v, pads, value], name=node_name(graph, f"{hint}_pad"))
    node.metadata_props[RULE_TAG] = RULE
    graph.insert_before(anchor, node)
    out = node.outputs[0]
    out.name = unique_name(graph, f"{hint}_padded")
    out.dtype = v.dtype
    out.shape = ir.Shape([s + extra if d == axis else s for d, s in enumerate(shape)])
    return out


def _padded(shape: list[int], rows: int, cols: int) -> ir.Shape:
    return ir.Shape([*shape[:-2], rows, cols])


def pad_attention_tokens(model: ir.Model) -> PassResult:
    """Every attention over a token count that is not a multiple of ``ALIGN`` computed over the next multiple
    (see the module's docstring)."""
    graph = model.graph
    done = 0
    for node, att, scores in attentions(graph):
        m, n = scores[-2:]
        m2, n2 = _up(m), _up(n)
        if (m2, n2) == (m, n) or max(m, n) < PAD_FROM:
            continue
        q, kt = att.qk.inputs
        v = att.pv.inputs[1]
        assert q is not None and kt is not None and v is not None
        qs, ks, vs = static_shape(q), static_shape(kt), static_shape(v)
        if qs is None or ks is None or vs is None or qs[-2] != m or ks[-1] != n or vs[-2] != n:
            continue
        name = node.name or "attention"
        anchor = att.qk
        if m2 > m:
            att.qk.replace_input_with(0, _pad(graph, anchor, q, -2, m2 - m, 0.0, f"{name}_q"))
        if n2 > n:
            att.qk.replace_input_with(1, _pad(graph, anchor, kt, -1, n2 - n, 0.0, f"{name}_kt"))
            att.pv.replace_input_with(1, _pad(graph, att.pv, v, -2, n2 - n, 0.0, f"{name}_v"))
        att.qk.outputs[0].shape = _padded(scores, m2, n2)
        for b in att.between:  # a scale, mask or bias: padded with what leaves the padded scores as they are
            fill = 1.0 if b.op_type in ("Mul", "Div") else 0.0
            for i, x in enumerate(b.inputs):
                xs = static_shape(x)
                if x is None or xs is None or x.producer() in att.nodes:
                    continue
                y = x
                if len(xs) >= 1 and xs[-1] == n and n2 > n:
                    y = _pad(graph, b, y, -1, n2 - n, fill, f"{name}_operand")
                if len(xs) >= 2 and xs[-2] == m and m2 > m:
                    y = _pad(graph, b, y, -2, m2 - m, fill, f"{name}_operand")
                if y is not x:
                    b.replace_input_with(i, y)
            b.outputs[0].shape = _padded(scores, m2, n2)
        if n2 > n:  # the padded keys' scores: PAD_SCORE, their weights 0
            row = np.zeros([1] * (len(scores) - 1) + [n2], np.float32)
            row[..., n:] = PAD_SCORE
            last = node.inputs[0]
            assert last is not None
            dtype = last.dtype or ir.DataType.FLOAT
            mask = constant(graph, row.astype(dtype.numpy()), f"{name}_padded_keys")
            add = ir.node("Add", [last, mask], name=node_name(graph, f"{name}_padded_keys"))
            add.metadata_props[RULE_TAG] = RULE
            graph.insert_before(node, add)
            add.outputs[0].name = unique_name(graph, f"{name}_scores_padded")
            add.outputs[0].dtype, add.outputs[0].shape = last.dtype, _padded(scores, m2, n2)
            node.replace_input_with(0, add.outputs[0])
        node.outputs[0].shape = _padded(scores, m2, n2)
        out = att.pv.outputs[0]
        outs = static_shape(out)
        assert outs is not None
        if m2 > m:  # the padded queries' rows dropped
            keep = out.name
            starts = constant(graph, np.asarray([0], np.int64), f"{name}_rows_start")
            ends = constant(graph, np.asarray([m], np.int64), f"{name}_rows_end")
            axes = constant(graph, np.asarray([len(outs) - 2], np.int64), f"{name}_rows_axis")
            sl = ir.node("Slice", [out, starts, ends, axes], name=node_name(graph, f"{name}_rows"))
            sl.metadata_props[RULE_TAG] = RULE
            graph.insert_after(att.pv, sl)
            y = sl.outputs[0]
            y.dtype, y.shape = out.dtype, ir.Shape(outs)
            out.replace_all_uses_with(y, replace_graph_outputs=True)
            sl.replace_input_with(0, out)
            out.name = unique_name(graph, f"{keep}_padded")
            y.name = keep
            out.shape = ir.Shape([*outs[:-2], m2, outs[-1]])
        done += 1
    return PassResult(modified=done > 0, counts={"attentions over padded tokens": done})
