"""Data-movement ops (Reshape, Transpose, Squeeze, Unsqueeze, Flatten) and what a chain of them does.

Exporters spell the same data movement many ways (a head split is Reshape+Transpose for one, Reshape,
Transpose, Reshape, Transpose, Reshape for another). Rather than matching each spelling, we *run* a chain on
an index tensor (``arange`` in the input's shape) and compare the result with the movement we want. That
answers "is this chain a head split / a plain reshape / NHWC->NCHW" for any exporter.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes.irutil import attr, const, scalar, static_shape

MOVEMENT_OPS = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"})
MAX_SIMULATED = 1 << 26  # elements; larger tensors are not simulated (int32 index tensor: 256 MB)


def is_movement(node: ir.Node | None) -> bool:
    if node is None or node.op_type not in MOVEMENT_OPS or node.domain not in ("", "ai.onnx"):
        return False
    if static_shape(node.inputs[0]) is None or static_shape(node.outputs[0]) is None:
        return False
    return all(const(v) is not None for v in node.inputs[1:] if v is not None)


def apply(node: ir.Node, x: np.ndarray) -> np.ndarray:
    """Run one movement node on a numpy array (shapes come from the graph: they are static)."""
    op = node.op_type
    if op == "Transpose":
        perm = attr(node, "perm")
        return np.transpose(x, perm if perm is not None else None)
    out_shape = static_shape(node.outputs[0])
    assert out_shape is not None
    return x.reshape(out_shape)  # Reshape, Squeeze, Unsqueeze, Flatten keep element order


def run_chain(nodes: list[ir.Node], x: np.ndarray) -> np.ndarray:
    for node in nodes:
        x = apply(node, x)
    return x


def index_tensor(shape: tuple[int, ...]) -> np.ndarray | None:
    size = int(np.prod(shape)) if shape else 1
    if size > MAX_SIMULATED:
        return None
    return np.arange(size, dtype=np.int32).reshape(shape)


def trace_up(v: ir.Value, allow_scale: bool = True) -> tuple[ir.Value, list[ir.Node], float]:
    """Walk up from ``v`` through movement nodes (and Mul/Div by a scalar constant): the source value,
    the nodes from the source down to ``v``, and the product of the scalar factors met."""
    nodes: list[ir.Node] = []
    scale = 1.0
    while True:
        p = v.producer()
        if p is None or p.domain not in ("", "ai.onnx"):
            break
        if is_movement(p):
            nodes.append(p)
            v = p.inputs[0]  # type: ignore[assignment]
            continue
        if allow_scale and p.op_type in ("Mul", "Div") and len(p.inputs) == 2:
            s = scalar(p.inputs[1])
            if s is not None and s != 0:
                nodes.append(p)
                scale *= s if p.op_type == "Mul" else 1.0 / s
                v = p.inputs[0]  # type: ignore[assignment]
                continue
            s = scalar(p.inputs[0])
            if p.op_type == "Mul" and s is not None:
                nodes.append(p)
                scale *= s
                v = p.inputs[1]  # type: ignore[assignment]
                continue
        break
    nodes.reverse()
    return v, nodes, scale


def run_chain_ignoring_scale(nodes: list[ir.Node], x: np.ndarray) -> np.ndarray:
    return run_chain([n for n in nodes if n.op_type in MOVEMENT_OPS], x)
