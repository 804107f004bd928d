"""Exact angles: Sin / Cos of x * W with the angle reduced exactly by digits and constant tables. See
``sdnpu.passes.htp``."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import RULE_TAG
from sdnpu.passes.htp.common import F32, RULE, constant, unique_name
from sdnpu.passes.irutil import remove_dead_nodes
from sdnpu.passes.manager import PassResult


_DIGIT = 256  # the tables' length: x = 256 * hi + lo + (f + rest) / 256, hi in [-128, 128), lo and f in [0, 256)
_MOVES = frozenset({"Unsqueeze", "Reshape", "Squeeze", "Flatten"})


def _const_operand(node: ir.Node) -> tuple[ir.Value, np.ndarray] | None:
    """(the computed operand, the constant one's value) of a two-input node with exactly one constant input."""
    if len(node.inputs) != 2 or node.inputs[0] is None or node.inputs[1] is None:
        return None
    a, b = node.inputs
    if (a.const_value is None) == (b.const_value is None):
        return None
    x, c = (a, b) if b.const_value is not None else (b, a)
    return x, c.const_value.numpy().astype(np.float64)  # type: ignore[union-attr]


class _Site:
    """One ``Sin`` / ``Cos`` of ``Mul(x, W)``: ``x`` computed, constant along the last axis (size 1), ``W`` a
    constant row over it; ``scale`` a scalar the graph multiplied ``x`` by first (folded into ``W``)."""

    def __init__(self, angle: ir.Value, x: ir.Value, w: np.ndarray) -> None:
        self.angle, self.x, self.w = angle, x, w
        self.source: ir.Value = x
        self.move: ir.Node | None = None  # the Unsqueeze / Reshape between the scaled value and ``x``


def _site(angle: ir.Value) -> _Site | None:
    mul = angle.producer()
    if mul is None or mul.op_type != "Mul" or mul.domain not in ("", "ai.onnx") or angle.dtype != F32:
        return None  # (a float16 graph's angles are fp16 to begin with: its tables would be another type)
    found = _const_operand(mul)
    if found is None:
        return None
    x, w = found
    inner_mul = x.producer()
    if w.size == 1 and inner_mul is not None and inner_mul.op_type == "Mul" and inner_mul.domain in ("", "ai.onnx"):
        inner = _const_operand(inner_mul)  # (x * W) * scale: diffusers' get_timestep_embedding(scale=1000), AuraFlow's
        if inner is not None:
            x, w = inner[0], inner[1] * float(w.reshape(()))
    shape, out = x.shape, angle.shape
    if shape is None or out is None or not shape.is_static() or not out.is_static() or len(shape) < 1:
        return None
    k = int(out[-1])
    dims = [int(d) for d in shape]
    if dims[-1] != 1 or [int(d) for d in out] != dims[:-1] + [k] or w.size != k:
        return None  # the product is not x's rows times one row of frequencies
    site = _Site(angle, x, w.reshape(-1))
    # a scalar the graph multiplied x by first (Flux's timestep * 1000): folded into W, x read before it
    src, move = x, None
    if (p := x.producer()) is not None and p.op_type in _MOVES and p.domain in ("", "ai.onnx"):
        src, move = p.inputs[0], p
    scaled = src.producer() if src is not None else None
    if scaled is not None and scaled.op_type == "Mul" and scaled.domain in ("", "ai.onnx"):
        inner = _const_operand(scaled)
        if inner is not None and inner[1].size == 1:
            site.source, site.move = inner[0], move
            site.w = site.w * float(inner[1].reshape(()))
    return site


def reduce_angles_exactly(model: ir.Model) -> PassResult:
    """``Sin`` / ``Cos`` of ``x * W`` (a sinusoidal embedding: timesteps, guidance, sizes, positions times
    frequencies), with the angle reduced exactly. The HTP computes ``x * W`` in fp16, whose rounding of an angle
    of 500 rad is 0.25 rad, and its Sin and Cos drift with the argument (0.09 rad off at 500, 0.19 at 1000;
    past 2000 they give sin 0, cos 1: measured on the emulator), while diffusion models feed angles up to
    t * 1000 (SD's timesteps, Flux's t and guidance scaled by 1000) and image sizes (SDXL's 1024). So ``x``
    (read before a scalar the graph scales it by, which is folded into ``W``) is split into digits exactly in
    fp16, ``|x| = 256 hi + lo + (f + r) / 256`` (Floor and Sub of powers of two: exact for ``|x| < 32768``; the
    digits of ``|x|``, its sign applied to the sine at the end, because a negative ``x``'s fraction ``x -
    floor(x)`` is not exact in fp16: cosine 0.90 for ``x = -0.13`` scaled by 10000, measured), the
    cos and sin of ``hi * 256 W``, ``lo * W`` and ``f * W / 256`` are read from constant tables (float64 offline,
    reduced mod 2 pi), the small rest ``r * W / 256`` goes to the HTP's Sin and Cos, and the four are
    combined by the angle-addition formulas. The graph's inputs do not change; where they arrive rounded to
    fp16 (the NPU's), that rounding stays."""
    graph = model.graph
    done = 0
    sites: dict[int, tuple[_Site, list[ir.Node]]] = {}
    for node in graph:
        if node.op_type in ("Sin", "Cos") and node.domain in ("", "ai.onnx") and node.inputs[0] is not None:
            key = id(node.inputs[0])
            if key not in sites:
                site = _site(node.inputs[0])
                if site is None:
                    continue
                sites[key] = (site, [])
            sites[key][1].append(node)
    for site, users in sites.values():
        _rewrite_angles(graph, site, users)
        done += 1
    return PassResult(modified=bool(done), counts={"sin/cos of x * W reduced exactly": done})


def _rewrite_angles(graph: ir.Graph, site: _Site, users: list[ir.Node]) -> None:
    anchor = min(users, key=lambda n: list(graph).index(n))
    dtype = site.angle.dtype or F32
    k = site.w.size
    lead = [int(d) for d in site.x.shape][:-1]  # type: ignore[union-attr]
    base = unique_name(graph, f"{anchor.name}_angle")
    names = iter(range(1 << 30))

    def const(value: np.ndarray | float, what: str, dt: Any = np.float32) -> ir.Value:
        return constant(graph, np.asarray(value, dt), f"{base}_{what}")

    def op(kind: str, inputs: list[ir.Value], shape: list[int], out_type: ir.DataType = dtype, **attrs: Any
           ) -> ir.Value:
        node = ir.node(kind, inputs, attributes=attrs, name=f"{base}_{kind.lower()}_{next(names)}")
        node.metadata_props[RULE_TAG] = RULE
        graph.insert_before(anchor, node)
        out = node.outputs[0]
        out.name, out.dtype, out.shape = node.name, out_type, ir.Shape(shape)
        return out

    x = site.x
    if site.source is not site.x:  # read x before the scalar it was multiplied by
        x = site.source
        if site.move is not None:
            x = op(site.move.op_type, [x, *site.move.inputs[1:]], lead + [1], **{
                a.name: a.value for a in site.move.attributes.values()})
    flat = op("Reshape", [x, const(np.asarray(lead or [1], np.int64), "rows", np.int64)], lead or [1])
    sign = op("Sign", [flat], lead or [1])  # the digits of |x|: a negative x's fraction 1 - |f| is not exact
    flat = op("Abs", [flat], lead or [1])
    n = op("Floor", [flat], lead or [1])
    frac = op("Mul", [op("Sub", [flat, n], lead or [1]), const(float(_DIGIT), "digit")], lead or [1])
    f = op("Floor", [frac], lead or [1])
    rest = op("Sub", [frac, f], lead or [1])
    hi = op("Floor", [op("Mul", [n, const(1.0 / _DIGIT, "per_digit")], lead or [1])], lead or [1])
    lo = op("Sub", [n, op("Mul", [hi, const(float(_DIGIT), "digit_again")], lead or [1])], lead or [1])
    hi = op("Add", [hi, const(float(_DIGIT // 2), "offset")], lead or [1])
    i = np.arange(_DIGIT, dtype=np.float64)[:, None]
    w = site.w[None, :]
    factors = []
    for digit, angles, what in ((hi, (i - _DIGIT // 2) * _DIGIT * w, "hi"), (lo, i * w, "lo"),
                                (f, i * w / _DIGIT, "f")):
        index = op("Cast", [digit], lead or [1], ir.DataType.INT32, to=ir.DataType.INT32)
        angles = np.mod(angles, 2 * np.pi)
        factors.append(tuple(op("Gather", [const(fn(angles), f"{fn.__name__}_{what}"), index], (lead or [1]) + [k],
                                axis=0) for fn in (np.cos, np.sin)))
    small = op("Mul", [op("Unsqueeze", [rest, const(np.asarray([-1], np.int64), "last", np.int64)],
                          (lead or [1]) + [1]), const(site.w / _DIGIT, "rest_w")], (lead or [1]) + [k])
    factors.append((op("Cos", [small], (lead or [1]) + [k]), op("Sin", [small], (lead or [1]) + [k])))
    c, s = factors[0]
    shape = (lead or [1]) + [k]
    for c2, s2 in factors[1:]:
        c, s = (op("Sub", [op("Mul", [c, c2], shape), op("Mul", [s, s2], shape)], shape),
                op("Add", [op("Mul", [s, c2], shape), op("Mul", [c, s2], shape)], shape))
    s = op("Mul", [s, op("Unsqueeze", [sign, const(np.asarray([-1], np.int64), "sign_last", np.int64)],
                         (lead or [1]) + [1])], shape)  # sin(-a) = -sin(a), cos(-a) = cos(a)
    out_shape = [int(d) for d in site.angle.shape]  # type: ignore[union-attr]
    for user in users:
        y = c if user.op_type == "Cos" else s
        if not lead:
            y = op("Reshape", [y, const(np.asarray(out_shape, np.int64), "out", np.int64)], out_shape)
        out = user.outputs[0]
        name = out.name
        out.replace_all_uses_with(y, replace_graph_outputs=True)
        graph.remove(user, safe=True)
        y.name = name
    remove_dead_nodes(graph)
