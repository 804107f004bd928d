"""Activation spellings: one op for each activation whatever the exporter wrote, so that one rule reads it.

- the Erf form of GELU, ``x * (erf(x / sqrt 2) + 1) * 0.5`` (TorchScript's below opset 20, optimum's), is one
  ``Gelu``; the tanh form written out, ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`` (transformers'
  ``gelu_new``, T5's), one ``Gelu(approximate='tanh')``: the activation rule maps both to the target's GELU;
- ``Div(1, x)`` is ``Reciprocal(x)``: TorchScript's spelling of an RMS norm's ``1 / sqrt(mean + eps)``, where
  dynamo and torch's own RMSNorm write Reciprocal, so that the norm rule reads one form.

Each chain is taken only where its intermediates are read by the chain alone, and where its constants match
to the rounding of an fp16 or bf16 export (1e-3 relative).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.passes.canonical.driver import RULE, graph_of, node_rewrite
from sdnpu.passes.irutil import Builder, producer, replace, scalar, static_shape

_ROOT_2_PI = float(np.sqrt(2.0 / np.pi))


def _other(node: ir.Node, v: ir.Value | None) -> ir.Value | None:
    """The other input of a two-input node."""
    return node.inputs[1] if node.inputs[0] is v else node.inputs[0]


def _near(v: ir.Value | None, want: float) -> bool:
    c = scalar(v)
    return c is not None and abs(c - want) <= 1e-3 * abs(want)  # fp16/bf16 exports round the constants


def _only(n: ir.Node | None, op: str) -> ir.Node | None:
    """The one reader of n's output, when it is an ``op`` node and n's output is no graph output."""
    if n is None or n.outputs[0].is_graph_output() or len(n.outputs[0].uses()) != 1:
        return None
    user = n.outputs[0].uses()[0].node
    return user if user.op_type == op and user.domain in ("", "ai.onnx") else None


def _cube_of(v: ir.Value | None, x: ir.Value) -> list[ir.Node] | None:
    """The nodes computing ``v = x^3``, as Pow(x, 3) or x * x * x; None otherwise."""
    p = producer(v, "Pow")
    if p is not None and p.inputs[0] is x and _near(p.inputs[1], 3.0):
        return [p]
    m = producer(v, "Mul")
    if m is None:
        return None
    sq = next((producer(w, "Mul") for w in m.inputs if producer(w, "Mul") is not None), None)
    if sq is not None and list(sq.inputs) == [x, x] and _other(m, sq.outputs[0]) is x:
        return [sq, m]
    return None


@node_rewrite("Erf GELU -> Gelu", "Mul")
def collapse_erf_gelu(half: ir.Node) -> bool:
    """x * (erf(x / sqrt 2) + 1) * 0.5, as TorchScript writes GELU below opset 20 (optimum: opset 18) -> Gelu.
    Anchored at the halving Mul."""
    for y in half.inputs:
        if scalar(_other(half, y)) != 0.5:
            continue
        outer = producer(y, "Mul")
        if outer is None:
            continue
        for x in outer.inputs:
            add = producer(_other(outer, x), "Add")
            erf = next((producer(v, "Erf") for v in (add.inputs if add else []) if producer(v, "Erf")), None)
            if add is None or erf is None or scalar(_other(add, erf.outputs[0])) != 1.0:
                continue
            div = producer(erf.inputs[0], "Div") or producer(erf.inputs[0], "Mul")
            if div is None or div.inputs[0] is not x:
                continue
            c = scalar(div.inputs[1])
            root2 = c if div.op_type == "Div" else (1 / c if c else None)
            # fp16 and bf16 exports store sqrt 2 (or 1/sqrt 2) as 1.4140625 (0.70703125): 1.5e-4 off
            if root2 is None or abs(root2 - 2**0.5) > 1e-3:
                continue
            chain = [div, erf, add, outer]
            if any(len(n.outputs[0].uses()) != 1 or n.outputs[0].is_graph_output() for n in chain):
                continue
            if static_shape(half.outputs[0]) != static_shape(x):  # a [1, 1, ..] constant raised the rank
                continue
            graph = graph_of(half)
            b = Builder(graph, RULE)
            gelu = b.op("Gelu", [x], {"approximate": "none"}, domain="", dtype=x.dtype, shape=static_shape(x))
            replace(graph, half, [*chain, half], b.nodes, [half.outputs[0]], [gelu.outputs[0]])
            return True
    return False


@node_rewrite("tanh GELU -> Gelu", "Tanh")
def collapse_tanh_gelu(tanh: ir.Node) -> bool:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as transformers' ``NewGELUActivation`` (T5's
    ``gelu_new``) exports, -> Gelu(approximate='tanh'). The cube may be Pow(x, 3) or x*x*x; the halving may
    come first (HF's ``0.5 * x * ...``) or last. Every intermediate must be read by the chain alone. Anchored
    at the Tanh."""
    scaled = producer(tanh.inputs[0], "Mul")
    if scaled is None:
        return False
    inner = next((v for v in scaled.inputs if _near(_other(scaled, v), _ROOT_2_PI)), None)
    add = producer(inner, "Add")
    if add is None:
        return False
    for x in add.inputs:
        cubic = producer(_other(add, x), "Mul")
        if x is None or cubic is None:
            continue
        cube_v = next((v for v in cubic.inputs if _near(_other(cubic, v), 0.044715)), None)
        cube = _cube_of(cube_v, x)
        if cube is not None:
            break
    else:
        return False
    one = _only(tanh, "Add")
    if one is None or not _near(_other(one, tanh.outputs[0]), 1.0):
        return False
    m1 = _only(one, "Mul")
    if m1 is None:
        return False
    rest = _other(m1, one.outputs[0])
    half = producer(rest, "Mul")
    last = _only(m1, "Mul")  # m1's one reader, where it is a Mul
    if half is not None and x in half.inputs and _near(_other(half, x), 0.5):  # (0.5 * x) * (1 + tanh)
        tail, out = [half, m1], m1
    elif rest is x and last is not None and _near(_other(last, m1.outputs[0]), 0.5):
        tail, out = [m1, last], last  # (x * (1 + tanh)) * 0.5
    elif _near(rest, 0.5) and last is not None and _other(last, m1.outputs[0]) is x:
        tail, out = [m1, last], last  # ((1 + tanh) * 0.5) * x
    else:
        return False
    chain = [*cube, cubic, add, scaled, tanh, one, *tail]
    inside = set(chain)
    if any(o.is_graph_output() or any(u.node not in inside for u in o.uses())
           for n in chain if n is not out for o in n.outputs):
        return False  # an intermediate is read elsewhere: the chain is not GELU alone
    if static_shape(out.outputs[0]) != static_shape(x):  # a [1, 1, ..] constant raised the rank
        return False
    graph = graph_of(tanh)
    b = Builder(graph, RULE)
    gelu = b.op("Gelu", [x], {"approximate": "tanh"}, domain="", dtype=x.dtype, shape=static_shape(x))
    replace(graph, out, chain, b.nodes, [out.outputs[0]], [gelu.outputs[0]])
    return True


@node_rewrite("1 / x -> Reciprocal", "Div")
def use_reciprocals(node: ir.Node) -> bool:
    """Div(1, x) is Reciprocal(x): TorchScript writes an RMSNorm's 1 / sqrt(mean + eps) so, where dynamo and
    torch's own RMSNorm write Reciprocal (or x / sqrt), and the norm rule reads one form."""
    if scalar(node.inputs[0]) != 1.0:
        return False
    x, y = node.inputs[1], node.outputs[0]
    if x is None or static_shape(x) != static_shape(y) or x.dtype != y.dtype:
        return False
    graph = graph_of(node)
    b = Builder(graph, RULE)
    r = b.op("Reciprocal", [x], dtype=y.dtype, shape=static_shape(y))
    replace(graph, node, [node], b.nodes, [y], [r.outputs[0]])
    return True
