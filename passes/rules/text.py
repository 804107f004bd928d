"""The text encoders' integer-indexed ops: the token embedding and CLIP's end-of-text pooling.

    Gather(table [V, C] const, ids [B, S] int, axis=0)                       ==> SDEmbedding(table, ids)
    GatherND(x [B, S, C], Concat([[b]], Reshape(ArgMax(Cast(ids), -1))))     ==> SDTokenPool(x, ids)
    Gather(Reshape(x, [B*S, C]), ArgMax(Cast(ids), -1) [+ arange(B)*S])     ==> SDTokenPool(x, ids)
      (transformers' pooling for configs whose eos_token_id is the legacy 2: the highest id is the EOS;
      dynamo writes the first form, TorchScript (optimum's export) the second, on the flattened rows)
"""

from __future__ import annotations

import onnx_ir as ir

from sdnpu.passes.irutil import Builder, attr, const, is_float, producer, static_shape
from sdnpu.passes.rules.base import Match, Rule


class SDEmbeddingFusion(Rule):
    name = "SDEmbeddingFusion"
    anchors = ("Gather",)

    def match(self, node: ir.Node) -> Match | str | None:
        table, ids = node.inputs
        if table is None or table.const_value is None or not is_float(table):
            return "the gathered table is not a constant float tensor"
        if attr(node, "axis", 0) != 0 or len(static_shape(table) or ()) != 2 or static_shape(ids) is None:
            return "not a row lookup in a [V, C] table"
        return Match([node], [node.outputs[0]], (table, ids))

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        return [b.op("SDEmbedding", list(m.params)).outputs[0]]


class SDTokenPoolFusion(Rule):
    name = "SDTokenPoolFusion"
    anchors = ("GatherND", "Gather")

    def match(self, node: ir.Node) -> Match | str | None:
        if node.op_type == "Gather":
            return self._match_flat(node)
        x, idx = node.inputs
        cat = producer(idx, "Concat")
        x_shape = static_shape(x)
        if cat is None or x_shape is None or len(x_shape) != 3 or attr(node, "batch_dims", 0) != 0:
            return None
        batch, pos = cat.inputs
        rows = const(batch)
        reshape = producer(pos, "Reshape")
        argmax = producer(reshape.inputs[0], "ArgMax") if reshape is not None else None
        if rows is None or argmax is None or rows.reshape(-1).tolist() != list(range(x_shape[0])):
            return "not CLIP's end-of-text pooling (row index + argmax of the ids)"
        return _with_ids(argmax, [argmax, reshape, cat, node], node, x)

    def _match_flat(self, node: ir.Node) -> Match | str | None:
        """TorchScript's ``x[arange(B), argmax]``: a Gather of rows of x flattened to [B*S, C]; the row
        offsets arange(B)*S are a folded constant (absent at B == 1, where x + 0 was dropped)."""
        rows, idx = node.inputs
        flat = producer(rows, "Reshape")
        x = flat.inputs[0] if flat is not None else None
        x_shape = static_shape(x) if x is not None else None
        if flat is None or x_shape is None or len(x_shape) != 3 or attr(node, "axis", 0) != 0:
            return None
        b, s, c = x_shape
        if static_shape(rows) != (b * s, c) or static_shape(idx) != (b,):
            return "not CLIP's end-of-text pooling (rows of the flattened hidden states)"
        nodes = [flat, node]
        add = producer(idx, "Add")
        if add is not None:
            other = [v for v in add.inputs if v is not idx and const(v) is not None]
            offsets = const(other[0]) if other else None
            argmax_in = [v for v in add.inputs if v is not (other[0] if other else None)]
            if offsets is None or offsets.reshape(-1).tolist() != [i * s for i in range(b)] or len(argmax_in) != 1:
                return "the pooled rows are not arange(B) * S + argmax"
            nodes.insert(0, add)
            idx = argmax_in[0]
        elif b != 1:
            return "the pooled rows are not arange(B) * S + argmax"
        argmax = producer(idx, "ArgMax")
        if argmax is None:
            return "not CLIP's end-of-text pooling (row index + argmax of the ids)"
        if attr(argmax, "keepdims", 1):
            return "the argmax keeps its reduced axis"
        return _with_ids(argmax, [argmax, *nodes], node, x)

    def rewrite(self, b: Builder, m: Match) -> list[ir.Value]:
        return [b.op("SDTokenPool", list(m.params)).outputs[0]]


def _with_ids(argmax: ir.Node, nodes: list[ir.Node], node: ir.Node, x: ir.Value) -> Match | str:
    """The match, once the argmax is known to run over the token ids (through a Cast or not)."""
    if attr(argmax, "axis", 0) not in (-1, 1) or attr(argmax, "select_last_index", 0):
        return "the argmax is not the first maximum over the sequence"
    ids = argmax.inputs[0]
    cast = producer(ids, "Cast")
    if cast is not None:
        nodes.insert(0, cast)
        ids = cast.inputs[0]
    if ids is None or ids.const_value is not None or is_float(ids):
        return "the pooled positions do not come from the token ids"
    return Match(nodes, [node.outputs[0]], (x, ids))
