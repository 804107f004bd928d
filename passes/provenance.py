"""The weight record while the passes run: each constant's expression over the input model's constants.

Each pass that makes a constant from another says so through ``Builder.derived`` / ``Builder.concatenated``,
whose transforms are the steps of ``sdnpu.formats.weights`` (the format of ``dd/weights.json`` and its
replay): the same functions compute the weight at compile time and replay it later, so the record cannot
drift from what the compiler did. While the passes run, an expression lives in ``Value.meta`` under
``PROVENANCE_KEY`` (pass-private, never serialized). At the end, ``record`` gathers one per initializer of the
dispatch model, and ``compile_into`` writes them to ``dd/weights.json`` beside it.

A small weight the canonical steps fold is recorded as the ONNX node that computed it, by sdnpu's own
folder (``canonical.constants.fold_small``) or by onnxscript's (``constant_subgraph`` describes what that one may fold before it runs;
``mark_folded`` names what it made).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import onnx_ir as ir

from sdnpu.formats.keys import PROVENANCE_KEY as KEY
from sdnpu.formats.weights import LITERAL, UNKNOWN, Expr, Step, add_up, apply, chain, folded, inline, make_record, step

__all__ = ["KEY", "LITERAL", "UNKNOWN", "Expr", "Step", "add_up", "apply", "chain", "inline", "constant_subgraph", "mark_folded",
           "folded", "mark_inputs", "origin", "record", "set_origin", "step"]


def origin(v: ir.Value) -> Expr:
    """``v``'s expression; a constant nobody described is ``UNKNOWN``."""
    return v.meta.get(KEY) or UNKNOWN  # type: ignore[no-any-return]


def set_origin(v: ir.Value, expr: Expr) -> None:
    v.meta[KEY] = expr


def mark_inputs(graph: ir.Graph, names: Iterable[str] | None = None) -> None:
    """The input model's constants (``names``, default every initializer) are themselves: ``{"init": name}``.
    Values that already have an expression keep it."""
    for name in graph.initializers if names is None else names:
        v = graph.initializers[name]
        if KEY not in v.meta:
            set_origin(v, {"init": name})


def constant_subgraph(graph: ir.Graph) -> dict[str, Expr]:
    """What a constant folder could compute, before it runs: for each output of a node whose inputs are
    constants or such outputs (Shape and Size of anything: literal), its expression. The canonical fold step
    calls it before onnxscript's folder and gives the initializers that folder makes (named as the outputs they
    replace) these expressions after it, through ``mark_folded``."""
    exprs: dict[str, Expr] = {}
    for node in graph:
        if node.domain not in ("", "ai.onnx") or not node.inputs:
            continue
        if node.op_type in ("Shape", "Size"):
            exprs.update((o.name, LITERAL) for o in node.outputs if o.name)
            continue
        xs: list[Expr | None] = []
        for v in node.inputs:
            if v is None:
                xs.append(None)
            elif v.const_value is not None:
                xs.append(origin(v))
            elif v.name in exprs:
                xs.append(exprs[v.name])
            else:
                break
        else:
            proto = ir.serde.serialize_node(node)
            for i, o in enumerate(node.outputs):
                if o.name:
                    exprs[o.name] = folded(proto, i, xs)
    return exprs


def mark_folded(graph: ir.Graph, exprs: dict[str, Expr]) -> None:
    """Initializers without an expression that are named as an output in ``exprs`` get that expression."""
    for name, v in graph.initializers.items():
        if KEY not in v.meta and name in exprs:
            set_origin(v, exprs[name])


def record(graph: ir.Graph, source: str) -> dict[str, Any]:
    """The record ``dd/weights.json`` holds: every initializer of the compiled graph with its expression."""
    return make_record(source, {name: origin(v) for name, v in graph.initializers.items()})
