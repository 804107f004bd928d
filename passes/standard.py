"""What a standard target (``sdnpu.ops.target.StandardTarget``: an NPU that takes standard ONNX ops within
limits, Qualcomm's HTP) makes of each node: ``node_info`` reads a node as the table's limits read it, and
``refusals`` says, for every node the table refuses, why. The partition (``sdnpu.passes.partition``) reads it
for standard targets as it reads the dispatch table for AMD's."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.ops.target import NodeInfo, StandardTarget
from sdnpu.passes.irutil import attr, static_shape

_SMALL = 64  # elements of a constant input whose values a limit may read (axes, pads, shapes)


def _value(v: ir.Value | None) -> tuple[str, tuple[int, ...] | None] | None:
    if v is None:
        return None
    dtype = v.dtype.name if v.dtype is not None else "UNDEFINED"
    return dtype, static_shape(v)


def node_info(node: ir.Node) -> NodeInfo:
    """``node`` as a standard target's limits read it."""
    constant = frozenset(i for i, v in enumerate(node.inputs) if v is not None and v.const_value is not None)
    values = {}
    for i in constant:
        c = node.inputs[i].const_value  # type: ignore[union-attr]
        if c is not None and c.size <= _SMALL:
            values[i] = np.asarray(c.numpy())
    return NodeInfo(node.op_type, {a: attr(node, a) for a in node.attributes},
                    tuple(_value(v) for v in node.inputs), tuple(_value(v) for v in node.outputs),  # type: ignore[misc]
                    constant, values)


def refusals(graph: ir.Graph, target: StandardTarget) -> dict[ir.Node, str]:
    """Every node of ``graph`` the target's table refuses, with the reason."""
    out = {}
    for node in graph:
        why = target.check(node.domain, node_info(node))
        if why is not None:
            out[node] = why
    return out
