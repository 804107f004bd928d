"""Glue: the element-wise ops between the fused families become the target's dispatch ops, so that an NPU
region is not cut by an Add, a SiLU or a Concat.

    Mul(x, Sigmoid(x))             ==> SDSilu
    x · sigmoid(1.702 x)           ==> SDMul(x, 1.702) -> SDSilu -> SDMul(., 1/1.702)   (CLIP's quick_gelu)
    Gelu(x)                        ==> SDGelu on the [B, M, N] view of x
    Add(a, b), Sub(a, c)           ==> SDAdd (a constant operand second, as a bias: is_bias_add=1; -c)
    Mul(a, b), Div(a, c)           ==> SDMul (the larger operand first; 1/c; a runtime scalar b spread
                                       to [N, 1, 1, C] by one shared CPU Expand, the kernels taking no
                                       scalar; twice that width by SDConcat of it with itself); a
                                       2-D pair, which the kernels refuse, read as [1, M, N] views
    Concat(a, b, ...)              ==> SDConcat pairs (2-D operands along their last axis read as
                                       [B, 1, 1, C]: the NHWC channel concatenation the kernel takes)
    Split(view of SDConv, last)    ==> one SDConv per part (its rows of the weight; the VAE attention's q, k, v)
    x * (s + 1)                    ==> x + x * s, before the rest (a modulation's scale: bf16 would round
                                       1 + s at 1's spacing, 2^-8, where x * s rounds at its own scale;
                                       the same two ops)

Runs after the layout pass, which moves the NHWC Transposes through the plain ONNX forms. An op is lowered
only where it touches the NPU (an input written by a dispatch op, or a dispatch op reading its output), to a
fixed point: arithmetic among CPU values (the sinusoidal embeddings' fp32 arguments) stays on the CPU,
where a lowered op would cost a cast in and out and bf16 precision. Whatever the target cannot take keeps
its reason (node metadata ``sdnpu.declined``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import DECLINED_TAG
from sdnpu.ops.target import DispatchTarget, prod
from sdnpu.passes.irutil import (Builder, attr, bmk_view, const, is_float, producer, replace, scalar, static_shape,
                                 unview)
from sdnpu.passes.provenance import step
from sdnpu.passes.manager import PassResult

RULE = "GlueLowering"
QUICK_GELU = 1.702


def _onnx(node: ir.Node | None, op_type: str | None = None) -> bool:
    return node is not None and node.domain in ("", "ai.onnx") and (op_type is None or node.op_type == op_type)


class _Glue:
    def __init__(self, graph: ir.Graph, target: DispatchTarget) -> None:
        self.graph = graph
        self.target = target
        self.counts: Counter[str] = Counter()
        self.spreads: dict[tuple[int, int, int], dict[int, ir.Value]] = {}  # (scalar, N, rank) -> width -> value

    def dispatch(self, node: ir.Node | None) -> bool:
        return node is not None and self.target.is_dispatch(node.domain, node.op_type)

    def touches_npu(self, node: ir.Node, data: list[ir.Value | None]) -> bool:
        """Whether a dispatch op writes one of ``data`` or reads an output, through views (Reshapes)."""
        for v in data:
            p = v.producer() if v is not None else None
            while _onnx(p, "Reshape"):
                p = p.inputs[0].producer() if p.inputs[0] is not None else None  # type: ignore[union-attr]
            if self.dispatch(p):
                return True
        todo = [u.node for out in node.outputs for u in out.uses()]
        while todo:
            reader = todo.pop()
            if self.dispatch(reader):
                return True
            if _onnx(reader, "Reshape"):
                todo += [u.node for u in reader.outputs[0].uses()]
        return False

    def decline(self, node: ir.Node, reason: str) -> None:
        node.metadata_props[DECLINED_TAG] = f"{RULE}: {reason}"

    # --- one lowering per op family; each returns the replacement values, a reason, or None (no match) ---

    def silu(self, b: Builder, node: ir.Node) -> tuple[list[ir.Node], list[ir.Value]] | str | None:
        if not _onnx(node, "Mul"):
            return None
        for x, s in (node.inputs, reversed(node.inputs)):
            sig = producer(s, "Sigmoid")
            if sig is None or x is None:
                continue
            if sig.inputs[0] is x or _one_view(sig.inputs[0], x):  # x, or two views of it (a video's 4-D and 5-D)
                if len(s.uses()) != 1 or s.is_graph_output():  # type: ignore[union-attr]
                    return "the sigmoid is also read elsewhere"
                return [sig, node], [unview(b, self.unary(b, "silu", x), static_shape(node.outputs[0]))]
            inner = producer(sig.inputs[0], "Mul")
            c = scalar(next((v for v in inner.inputs if v is not x), None)) if inner is not None else None
            if inner is not None and x in inner.inputs and c is not None and abs(c - QUICK_GELU) < 1e-3:
                if any(len(v.uses()) != 1 or v.is_graph_output() for v in (inner.outputs[0], s)):  # type: ignore
                    return "quick_gelu's intermediates are also read elsewhere"
                if static_shape(node.outputs[0]) != static_shape(x):
                    return "the constant broadcasts x to another shape"
                scaled = self.binary(b, "mul", x, self.vector(b, x, c))
                if isinstance(scaled, str):
                    return scaled
                y = self.binary(b, "mul", self.unary(b, "silu", scaled), self.vector(b, x, 1.0 / c))
                return ([inner, sig, node], [y]) if not isinstance(y, str) else y
        return None

    def gelu(self, b: Builder, node: ir.Node) -> tuple[list[ir.Node], list[ir.Value]] | str | None:
        if not _onnx(node, "Gelu"):
            return None
        x = node.inputs[0]
        shape = static_shape(x)
        if x is None or shape is None:
            return "the input has no static shape"
        view = bmk_view(shape)
        approximate = node.attributes.get("approximate")
        approx = approximate.value if approximate is not None else "none"
        approx = approx.decode() if isinstance(approx, bytes) else approx
        gelu = self.target.op("gelu")
        reason, assumed = gelu.check({"x": view, "approximate": approx})
        if reason:
            return reason
        y = b.dispatch(gelu.op_type, [x], {"input_shape": view, "output_shape": view, "approximate": approx},
                       dtype=x.dtype, shape=view, assumed=assumed).outputs[0]
        return [node], [unview(b, y, shape)]

    def arithmetic(self, b: Builder, node: ir.Node) -> tuple[list[ir.Node], list[ir.Value]] | str | None:
        if not _onnx(node) or node.op_type not in ("Add", "Sub", "Mul", "Div") or len(node.inputs) != 2:
            return None
        a, c = node.inputs
        if a is None or c is None:
            return None
        if node.op_type == "Mul" and any(sig is not None and (sig.inputs[0] is x or _one_view(sig.inputs[0], x))
                                         and len(sig.outputs[0].uses()) == 1 and not sig.outputs[0].is_graph_output()
                                         for x, sig in ((a, producer(c, "Sigmoid")), (c, producer(a, "Sigmoid")))):
            return None  # x * sigmoid(x): the SiLU's, once its x touches the NPU (a later round)
        op = "add" if node.op_type in ("Add", "Sub") else "mul"
        if node.op_type in ("Sub", "Div"):
            k = const(c)
            if k is None:
                if const(a) is not None:  # k - x needs a negation, k / x a reciprocal: the registry has neither
                    sym = "-" if node.op_type == "Sub" else "/"
                    return (f"{node.op_type} with the constant first (k {sym} x): only x {sym} k maps onto the "
                            f"{self.target.name} registry")
                return f"{node.op_type} of two activations: not in the {self.target.name} registry"
            if node.op_type == "Div" and np.any(k == 0):
                return "division by zero"
            c = b.derived(c, [step("neg" if node.op_type == "Sub" else "reciprocal")], list(k.shape), f"{c.name}_glue")
        if a.const_value is not None and c.const_value is None:
            a, c = c, a
        if a.const_value is not None:
            return "both operands are constants"
        y = self.binary(b, op, a, c)
        return y if isinstance(y, str) else ([node], [y])

    def concat(self, b: Builder, node: ir.Node) -> tuple[list[ir.Node], list[ir.Value]] | str | None:
        if not _onnx(node, "Concat") or len(node.inputs) < 2:
            return None
        out_shape = static_shape(node.outputs[0])
        if out_shape is None or any(static_shape(v) is None for v in node.inputs):
            return "operands without static shapes"
        if all(v.const_value is not None for v in node.inputs):  # type: ignore[union-attr]
            return "every operand is a constant"
        rank = len(out_shape)
        axis = int(node.attributes["axis"].value) % rank
        lifted = rank == 2 and axis == 1  # [B, C] along C: the kernel's NHWC channel concat on [B, 1, 1, C]
        rows = rank == 2 and axis == 0  # [S, C] along S (Flux.2's rotary tables): the sequence concat of [1, S, C]
        acc: ir.Value = node.inputs[0]  # type: ignore[assignment]
        acc_shape = list(static_shape(acc))  # type: ignore[arg-type]
        for v in node.inputs[1:]:
            v_shape = list(static_shape(v))  # type: ignore[arg-type]
            c_shape = list(acc_shape)
            c_shape[axis] += v_shape[axis]
            a_view, b_view, c_view = ([[s[0], 1, 1, s[1]] for s in (acc_shape, v_shape, c_shape)] if lifted
                                      else [[1, *s] for s in (acc_shape, v_shape, c_shape)] if rows
                                      else (acc_shape, v_shape, c_shape))
            constant = acc.const_value is not None or v.const_value is not None  # type: ignore[union-attr]
            reason, assumed = self.target.op("concat").check({"a": a_view, "b": b_view, "op": "Concat",
                                                                  "b_const": constant})
            if reason:
                return reason
            attrs = {"a_shape": a_view, "b_shape": b_view, "c_shape": c_view,
                     "axis": 3 if lifted else 1 if rows else axis}
            acc = b.dispatch(self.target.op("concat").op_type, [acc, v], attrs, dtype=node.outputs[0].dtype,
                             shape=c_view, assumed=assumed).outputs[0]
            acc_shape = c_shape
        return [node], [unview(b, acc, out_shape)]

    def conv_split(self, b: Builder, node: ir.Node) -> tuple[list[ir.Node], list[ir.Value]] | None:
        """A Split of a conv's channels (its NHWC output's last axis, through views that keep it last: the VAE
        attention's q, k, v from one qkv projection) as one conv per part, each with its rows of the weight and
        bias: the registry's slice has no offsets, a conv's output channels are its weight's rows."""
        if not _onnx(node, "Split") or len(node.outputs) < 2:
            return None
        x = node.inputs[0]
        shape = static_shape(x)
        conv = _viewed(x).producer() if _viewed(x) is not None else None  # type: ignore[union-attr]
        if shape is None or conv is None or conv.op_type != self.target.op("conv").op_type or \
                conv.domain != self.target.domain or int(attr(node, "axis", 0)) % len(shape) != len(shape) - 1:
            return None
        y = conv.outputs[0]
        y_shape, w, bias = static_shape(y), conv.inputs[1], conv.inputs[2]
        if y_shape is None or y_shape[-1] != shape[-1] or w is None or bias is None or const(bias) is None \
                or w.const_value is None or y.is_graph_output() or len(y.uses()) != 1:
            return None
        parts = [static_shape(o) for o in node.outputs]
        if any(p is None for p in parts):
            return None
        news, start = [], 0
        attrs = {k: a.value for k, a in conv.attributes.items() if k not in ("in_dtypes", "out_dtypes")}
        for part in parts:
            width = part[-1]  # type: ignore[index]
            w_shape = [width, *static_shape(w)[1:]]  # type: ignore[index]
            wp = b.derived(w, [step("slice", axis=0, start=start, stop=start + width)], w_shape, f"{w.name}_part")
            bp = b.derived(bias, [step("slice", axis=0, start=start, stop=start + width)], [width],
                           f"{bias.name}_part")
            out = [*y_shape[:-1], width]
            yp = b.dispatch(conv.op_type, [conv.inputs[0], wp, bp],
                            {**attrs, "output_shape": out, "weight_shape": w_shape}, dtype=y.dtype,
                            shape=out).outputs[0]
            news.append(unview(b, yp, part))  # type: ignore[arg-type]
            start += width
        return [node], news

    # --- helpers ---

    def unary(self, b: Builder, family: str, x: ir.Value) -> ir.Value:
        full = static_shape(x)
        shape = _frames_folded(list(full))  # type: ignore[arg-type]
        y = b.dispatch(self.target.op(family).op_type, [x], {"input_shape": shape, "output_shape": shape},
                       dtype=x.dtype, shape=shape).outputs[0]
        return unview(b, y, full)

    def vector(self, b: Builder, like: ir.Value, value: float) -> ir.Value:
        """A constant [C] along ``like``'s last axis (the kernels' bias form)."""
        c = static_shape(like)[-1]  # type: ignore[index]
        return b.const(np.full(c, value, np.float32), f"glue_{value:.6g}")

    def spread(self, b: Builder, c: ir.Value, a_shape: list[int]) -> tuple[ir.Value, list[int]]:
        """A runtime scalar (a ControlNet's conditioning scale) as the [N, 1, .., C] operand the element-wise
        kernels broadcast (they take no scalar): one CPU Expand, shared by every op that needs it; a width
        that doubles one made already (SD's 320 -> 640 -> 1280 channels) is SDConcat of it with itself on the
        NPU instead of another Expand and cast."""
        shape = [a_shape[0], *([1] * (len(a_shape) - 2)), a_shape[-1]]
        made = self.spreads.setdefault((id(c), shape[0], len(shape)), {})
        for width in [w for w, v in made.items() if v.producer().graph is None]:  # type: ignore[union-attr]
            del made[width]  # made for a lowering that was refused
        width = shape[-1]
        if width in made:
            return made[width], shape
        half = width // 2
        while half and half not in made and half % 2 == 0:
            half //= 2
        if half in made and width % half == 0 and (width // half) & (width // half - 1) == 0:
            v, w = made[half], half
            while w < width:
                part = [*shape[:-1], w]
                full = [*shape[:-1], 2 * w]
                reason, _ = self.target.op("concat").check({"a": part, "b": part, "op": "Concat"})
                if reason:
                    break
                v = b.dispatch(self.target.op("concat").op_type, [v, v],
                               {"a_shape": part, "b_shape": part, "c_shape": full, "axis": len(shape) - 1},
                               dtype=c.dtype, shape=full).outputs[0]
                w *= 2
                made[w] = v
            if w == width:
                return v, shape
        target = b.const(np.asarray(shape, np.int64), "spread")
        node = b.op("Expand", [c, target], domain="", dtype=c.dtype, shape=shape)
        node.metadata_props[DECLINED_TAG] = (f"{RULE}: spreads a runtime scalar to the {shape} operand the "
                                             f"{self.target.name} element-wise kernels broadcast (no scalar form)")
        made[width] = node.outputs[0]
        return made[width], shape

    def binary(self, b: Builder, family: str, a: ir.Value, c: ir.Value) -> ir.Value | str:
        """``a + c`` or ``a * c`` (``family`` "add" or "mul") as the target's element-wise op, or why not."""
        a_shape, c_shape = static_shape(a), static_shape(c)
        if a_shape is None or c_shape is None or not is_float(a):
            return "operands without static float shapes"
        a_shape, c_shape = list(a_shape), list(c_shape)
        bias = c.const_value is not None
        if not bias and prod(c_shape) > prod(a_shape):
            a, c, a_shape, c_shape = c, a, c_shape, a_shape  # the larger operand first
        try:
            out = list(np.broadcast_shapes(tuple(a_shape), tuple(c_shape)))
        except ValueError:
            return f"{a_shape} and {c_shape} do not broadcast"
        if out != a_shape:
            return f"the result {out} is larger than the first operand {a_shape}"
        if bias and (prod(c_shape) == 1 or (prod(c_shape) == a_shape[-1] and c_shape[-1] == a_shape[-1])):
            c = b.derived(c, [step("astype", dtype="float32"), step("reshape", shape=[-1]),
                              step("broadcast", shape=[a_shape[-1]])], [a_shape[-1]], f"{c.name}_c",
                          dtype=ir.DataType.FLOAT)
            c_shape = [a_shape[-1]]
        elif bias and len(c_shape) < len(a_shape):  # numpy's broadcasting reads a lower rank with ones before it
            lifted = [1] * (len(a_shape) - len(c_shape)) + c_shape  # (Qwen-Image's rotations [S, 1, D] on [B, S, H, D])
            c = b.derived(c, [step("reshape", shape=lifted)], lifted, f"{c.name}_r")
            c_shape = lifted
        shape = a_shape
        if len(a_shape) == 5:  # a video's [B, F, H, W, C] (channels last) read as [B*F, H, W, C]
            c5 = [1] * (5 - len(c_shape)) + c_shape
            if c5[:2] != a_shape[:2] and c5[:2] != [1, 1]:
                return f"{c_shape} broadcasts along the frames of {a_shape} (the kernels take rank 2 to 4)"
            a_shape, c_shape = _frames_folded(a_shape), (_frames_folded(c5) if len(c_shape) == 5 else c_shape)
        if not bias and prod(c_shape) == 1 and len(a_shape) >= 2:
            c, c_shape = self.spread(b, c, a_shape)
        spec = self.target.op(family)
        if len(a_shape) == 2 and len(c_shape) == 2:  # the kernels take no 2-D pair: read both as [1, M, N] views
            a_shape, c_shape = [1, *a_shape], [1, *c_shape]
        reason, assumed = spec.check({"a": a_shape, "b": c_shape, "b_const": bias, "op": family.capitalize()})
        if reason:
            return reason
        attrs: dict[str, object] = {"a_shape": a_shape, "b_shape": c_shape, "c_shape": a_shape}
        if family == "add":
            attrs["is_bias_add"] = int(bias)
        y = b.dispatch(spec.op_type, [a, c], attrs, dtype=a.dtype, shape=a_shape, assumed=assumed).outputs[0]
        return unview(b, y, tuple(shape)) if shape != a_shape else y


def _viewed(v: ir.Value | None) -> ir.Value | None:
    """``v`` with the Reshapes above it stripped (the value it views)."""
    while v is not None and _onnx(v.producer(), "Reshape"):
        v = v.producer().inputs[0]  # type: ignore[union-attr]
    return v


def _one_view(a: ir.Value | None, c: ir.Value | None) -> bool:
    """Whether ``a`` and ``c`` are views (Reshapes) of one value, element for element (the same sizes)."""
    sa, sc = static_shape(a), static_shape(c)
    return (a is not None and sa is not None and sc is not None and prod(list(sa)) == prod(list(sc))
            and _viewed(a) is _viewed(c))


def _frames_folded(shape: list[int]) -> list[int]:
    """A rank-5 shape read as rank 4, its first two axes as one (a video's batch and frames); others as they are."""
    return [shape[0] * shape[1], *shape[2:]] if len(shape) == 5 else shape


def _ones(v: ir.Value | None) -> bool:
    k = const(v)
    return k is not None and k.size > 0 and bool(np.all(k == 1))


def distribute_one_plus(graph: ir.Graph, glue: _Glue) -> int:
    """``x * (s + 1)`` as ``x + x * s`` where x comes from the NPU and s is computed (AdaLN's
    ``norm(x) * (1 + scale)``, where the ``1 +`` has not folded into a layer's bias: Wan's scale is a learned
    table plus the timestep's projection, then 1 +). In bf16 the sum 1 + s keeps s only to 1's spacing, a
    per-channel error every later op carries; x * s rounds at its own, smaller scale and the one rounding at
    x's scale is the final sum's. The same two element-wise ops (an SDMul and an SDAdd), so only where the sum
    has that one product for its reader (Flux.1's single blocks scale the text's and the image's parts by one
    sum: two products, which would cost an op more); x of the product's own shape (the wide operand), s not
    widened by the 1."""
    done = 0
    for add in list(graph):
        if add.graph is None or not _onnx(add, "Add") or len(add.inputs) != 2 or add.outputs[0].is_graph_output():
            continue
        s, one = add.inputs if _ones(add.inputs[1]) else (add.inputs[1], add.inputs[0])
        if not _ones(one) or s is None or s.const_value is not None or not is_float(s) \
                or static_shape(s) is None or static_shape(add.outputs[0]) != static_shape(s):
            continue
        uses = add.outputs[0].uses()
        mul = uses[0].node if len(uses) == 1 else None  # one product: more would each add an op
        if not _onnx(mul, "Mul") or len(mul.inputs) != 2 or mul.inputs[0] is mul.inputs[1]:  # type: ignore[union-attr]
            continue
        x = mul.inputs[1] if mul.inputs[0] is add.outputs[0] else mul.inputs[0]  # type: ignore[union-attr]
        if x is None or x.const_value is not None or static_shape(x) is None \
                or static_shape(x) != static_shape(mul.outputs[0]) \
                or not glue.touches_npu(mul, [x]):  # type: ignore[union-attr, arg-type]
            continue
        b = Builder(graph, RULE)
        shape = list(static_shape(x))  # type: ignore[arg-type]
        xs = b.op("Mul", [x, s], dtype=x.dtype, shape=shape).outputs[0]
        y = b.op("Add", [x, xs], dtype=x.dtype, shape=shape).outputs[0]
        replace(graph, mul, [mul, add], b.nodes, [mul.outputs[0]], [y])  # type: ignore[list-item]
        done += 1
    return done


def lower_glue(model: ir.Model, target: DispatchTarget) -> PassResult:
    graph = model.graph
    glue = _Glue(graph, target)
    distributed = distribute_one_plus(graph, glue)
    families: list[tuple[str, Callable[..., object]]] = [("SiLU", glue.silu), ("GELU", glue.gelu),
                                                         ("arithmetic", glue.arithmetic), ("Concat", glue.concat),
                                                         ("conv Split", glue.conv_split)]
    counts: Counter[str] = Counter()
    for _ in range(100):  # each lowering can make a neighbour touch the NPU
        changed = 0
        for name, lower in families:
            for node in list(graph):
                if node.graph is None or not _onnx(node):
                    continue
                data = list(node.inputs)
                if not glue.touches_npu(node, data):
                    continue
                b = Builder(graph, RULE, target)
                found = lower(b, node)
                if found is None:
                    continue
                if isinstance(found, str):
                    glue.decline(node, found)
                    for v in b.initializers:  # constants made for a refused lowering
                        if not v.uses():
                            del graph.initializers[v.name]  # type: ignore[arg-type]
                    continue
                old_nodes, news = found  # type: ignore[misc]
                olds = list(old_nodes[-1].outputs)[:len(news)]
                replace(graph, old_nodes[-1], old_nodes, b.nodes, olds, news)
                counts[f"{name} -> {', '.join(sorted({n.op_type for n in b.nodes if n.domain == target.domain}))}"] += 1
                changed += 1
        if not changed:
            break
    if glue.spreads:  # a spread made at one op's place may serve an op before it, lowered in a later round
        graph.sort()
    lowerable = ("Add", "Sub", "Mul", "Div", "Concat", "Gelu")
    for node in graph:  # what stayed among CPU values says so (its reason, unless a family declined it)
        if _onnx(node) and node.op_type in lowerable and DECLINED_TAG not in node.metadata_props:
            glue.decline(node, "computes on CPU values only (no dispatch op writes its inputs or reads its "
                               "output): on the NPU it would cost a cast each way")
    if distributed:
        counts["x * (s + 1) -> x + x * s"] = distributed
    return PassResult(modified=bool(counts), counts=dict(counts))
