"""Canonicalize: one form whatever the exporter wrote, so that the rules see a single spelling.

- opset raised to 20 where lower: the ops SD graphs use keep their meaning from 17 to 20 (opset 19 only
  added types and the Resize/Pad modes we do not use; 20 added Gelu, which our reference bodies need);
- Constant nodes become initializers; small constant subgraphs are folded (onnxscript's folder, with its
  size limits, so no large weight is ever materialized here); Identity nodes go;
- shapes and types inferred for every value (the TorchScript exporter writes none for intermediates);
- Squeeze/Unsqueeze/Flatten with static shapes become Reshape (the layout pass reasons about Reshape only);
  a Transpose without ``perm`` (it reverses the axes) gets its perm written out;
- x*1, x/1, x+0 go; a zero Pad in front of a Conv becomes the Conv's pads; the Erf form of GELU becomes
  one Gelu (TorchScript's and optimum's spellings), and the tanh form written out (transformers'
  ``gelu_new``, T5's) one Gelu(approximate='tanh');
- the sinusoidal embeddings (diffusers' ``get_timestep_embedding``: ``Concat(Sin(x·f), Cos(x·f))``, maybe
  flipped to cos-first by two Slices and a Concat) become one ``Sin(x·f' + phase)`` with cos(a) written as
  sin(a + pi/2): the same numbers to fp32 rounding of the argument (|a| <= ~1000 rad: below 1e-4), in three
  CPU nodes instead of four to seven (Sin and Cos have no dispatch op; these run on the CPU in fp32);
- a chain of Reshape/Expand nodes broadcasting one value (the UNet's scalar timestep to the batch) is one
  Expand, and where a constant is all it meets (the sinusoid's frequencies), none: the constant is
  broadcast offline.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript.optimizer

from sdnpu.passes import provenance
from sdnpu.errors import SdnpuError
from sdnpu.passes.irutil import Builder, attr, const, producer, remove_dead_nodes, replace, scalar, static_shape
from sdnpu.passes.provenance import step
from sdnpu.passes.manager import PassResult

log = logging.getLogger(__name__)

TARGET_OPSET = 20
RULE = "Canonicalize"
# model metadata: the constants cut from a larger one for this graph's size (``_crop_constants``), which the
# size specializer cannot re-derive from another size's dispatch model
from sdnpu.formats.keys import SIZED_CONSTANTS_KEY  # noqa: E402


def _to_reshape(graph: ir.Graph) -> int:
    done = 0
    for node in list(graph):
        if node.op_type not in ("Squeeze", "Unsqueeze", "Flatten") or node.domain not in ("", "ai.onnx"):
            continue
        shape = static_shape(node.outputs[0])
        if shape is None or static_shape(node.inputs[0]) is None:
            continue
        b = Builder(graph, RULE)
        target = b.const(np.asarray(shape, np.int64), "shape")
        new = b.op("Reshape", [node.inputs[0], target], domain="", dtype=node.outputs[0].dtype, shape=shape)
        replace(graph, node, [node], b.nodes, [node.outputs[0]], [new.outputs[0]])
        done += 1
    return done


_FOLD_LIMIT = 1 << 16  # elements: only shape-sized arithmetic is folded here, never a weight
_NEVER_FOLD = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                         "Bernoulli"})


def _explicit_perm(graph: ir.Graph) -> int:
    """Transpose's perm defaults to reversing the axes; the layout and glue passes read it, so write it out."""
    done = 0
    for node in graph:
        if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and "perm" not in node.attributes:
            shape = static_shape(node.inputs[0])
            if shape is not None:
                node.attributes["perm"] = ir.AttrInt64s("perm", list(range(len(shape)))[::-1])
                done += 1
    return done


def _fold_small(graph: ir.Graph) -> int:
    """Evaluate small nodes whose inputs are all constant (and Shape of a static value) with ONNX's
    reference evaluator. onnxscript's folder leaves some on purpose (ConstantOfShape, to protect memory in
    general); the TorchScript exporter's padding arithmetic is made of them."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    folded = 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER_FOLD or node.graph is None:
            continue
        outs = list(node.outputs)
        if any(o.is_graph_output() for o in outs):
            continue
        if node.op_type == "Shape" and len(node.inputs) == 1 and static_shape(node.inputs[0]) is not None:
            shape = np.asarray(static_shape(node.inputs[0]), np.int64)
            start, end = node.attributes.get("start"), node.attributes.get("end")
            values = [shape[(start.value if start else 0): (end.value if end else None)]]
        elif node.inputs and all(v is None or v.const_value is not None for v in node.inputs):
            sizes = [v.const_value.size for v in node.inputs if v is not None]  # type: ignore[union-attr]
            if max(sizes, default=0) > _FOLD_LIMIT:
                continue
            names = [v.name if v is not None else "" for v in node.inputs]
            proto = ir.serde.serialize_node(node)
            feeds = {v.name: v.const_value.numpy() for v in node.inputs if v is not None}  # type: ignore
            g = helper.make_graph([proto], "fold", [helper.make_tensor_value_info(n, ir.serde.serialize_type(  # type: ignore
                v.type).tensor_type.elem_type, None) for n, v in zip(names, node.inputs) if v is not None], [
                helper.make_tensor_value_info(o.name, 0, None) for o in outs])
            try:  # the graph's own arithmetic: T5's position buckets take Log(0) = -inf in a branch Where drops
                with np.errstate(all="ignore"):
                    values = ReferenceEvaluator(helper.make_model(
                        g, opset_imports=[helper.make_opsetid("", TARGET_OPSET)])).run(None, feeds)
            except Exception:  # an op the reference evaluator lacks: leave it to the rules
                continue
            if any(np.asarray(v).size > _FOLD_LIMIT for v in values):
                continue
        else:
            continue
        b = Builder(graph, RULE)
        xs = [None if v is None else provenance.origin(v) if v.const_value is not None else provenance.LITERAL
              for v in node.inputs]  # not constant: the static shape Shape read
        for i, (old, value) in enumerate(zip(outs, values, strict=True)):
            new = b.const(np.asarray(value), old.name or "folded")
            provenance.set_origin(new, provenance.folded(ir.serde.serialize_node(node), i, xs))
            old.replace_all_uses_with(new)
        folded += 1
    remove_dead_nodes(graph)
    return folded


def _sync_constant_shapes(graph: ir.Graph) -> None:
    """A value that folding made constant keeps the shape the exporter declared for it, in terms of the
    dynamic axes (optimum's position ids: [batch_size, sequence_length, D]) and shape inference does not
    revisit initializers: give it its tensor's shape, or everything downstream stays symbolic."""
    for value in graph.initializers.values():
        if value.const_value is not None and (value.shape is None or not value.shape.is_static()):
            value.shape = ir.Shape(value.const_value.shape)


def _drop_identities(graph: ir.Graph) -> int:
    """Identity nodes go: their readers read the input; an Identity writing a graph output gives its name to
    the input value. Kept: one whose input is itself a graph output, a graph input or an initializer (the
    graph returns one value under two names). onnx_ir's IdentityEliminationPass renames a graph output
    there too, and the graph loses one of its two outputs."""
    done = 0
    for node in list(graph):
        if node.op_type != "Identity" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if y.is_graph_output() and (x.is_graph_output() or x.is_graph_input() or x.is_initializer()):
            continue
        if x.shape is None:
            x.shape = y.shape
        if x.type is None:
            x.type = y.type
        name = y.name
        y.replace_all_uses_with(x, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        if x.is_graph_output():
            x.name = name
        done += 1
    return done


def _drop_neutral(graph: ir.Graph) -> int:
    """x * 1, x / 1 and x + 0 (a resnet's output_scale_factor of 1, as TorchScript writes it) are x."""

    done = 0
    for node in list(graph):
        if node.op_type not in ("Mul", "Div", "Add") or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
            continue
        x, c = node.inputs
        neutral = 0.0 if node.op_type == "Add" else 1.0
        if scalar(c) != neutral or x is None or static_shape(x) != static_shape(node.outputs[0]):
            continue
        out = node.outputs[0]
        if out.is_graph_output() or x.dtype != out.dtype:
            continue
        out.replace_all_uses_with(x)
        done += 1
    return done


def _pad_into_conv(graph: ir.Graph) -> int:
    """Pad(x, zeros on H and W) -> Conv becomes one Conv with those pads (the VAE encoder's downsampler
    pads right and bottom by one; dynamo already writes it this way). Not a cropping (negative) Pad."""

    done = 0
    for node in list(graph):
        if node.op_type != "Pad" or node.domain not in ("", "ai.onnx"):
            continue
        uses = list(node.outputs[0].uses())
        pads = const(node.inputs[1]) if len(node.inputs) > 1 else None
        value = const(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] is not None else np.zeros(1)
        mode = attr(node, "mode", "constant")
        if (len(uses) != 1 or uses[0].node.op_type != "Conv" or uses[0].idx != 0 or pads is None or pads.size != 8
                or value is None or np.any(value != 0) or mode not in ("constant", b"constant")
                or (len(node.inputs) > 3 and node.inputs[3] is not None) or node.outputs[0].is_graph_output()):
            continue
        conv = uses[0].node
        if attr(conv, "auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") or np.any(pads[[0, 1, 4, 5]] != 0):
            continue
        if np.any(pads < 0):  # a negative pad crops the data; a Conv's pads only add zeros
            continue
        old = list(attr(conv, "pads", [0, 0, 0, 0]))
        new = [old[0] + int(pads[2]), old[1] + int(pads[3]), old[2] + int(pads[6]), old[3] + int(pads[7])]
        conv.attributes["pads"] = ir.AttrInt64s("pads", new)
        conv.replace_input_with(0, node.inputs[0])
        done += 1
    return done


def _erf_gelu(graph: ir.Graph) -> int:
    """x * (erf(x / sqrt 2) + 1) * 0.5, as TorchScript writes GELU below opset 20 (optimum: opset 18) -> Gelu."""

    def other(node: ir.Node, v: ir.Value | None) -> ir.Value | None:
        return node.inputs[1] if node.inputs[0] is v else node.inputs[0]

    done = 0
    for half in list(graph):
        if half.op_type != "Mul" or half.domain not in ("", "ai.onnx") or half.graph is None:
            continue
        for y in half.inputs:
            if scalar(other(half, y)) != 0.5:
                continue
            outer = producer(y, "Mul")
            if outer is None:
                continue
            for x in outer.inputs:
                add = producer(other(outer, x), "Add")
                erf = next((producer(v, "Erf") for v in (add.inputs if add else []) if producer(v, "Erf")), None)
                if add is None or erf is None or scalar(other(add, erf.outputs[0])) != 1.0:
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
                b = Builder(graph, RULE)
                gelu = b.op("Gelu", [x], {"approximate": "none"}, domain="", dtype=x.dtype, shape=static_shape(x))
                replace(graph, half, [*chain, half], b.nodes, [half.outputs[0]], [gelu.outputs[0]])
                done += 1
                break
            else:
                continue
            break
    return done


def _tanh_gelu(graph: ir.Graph) -> int:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as transformers' ``NewGELUActivation`` (T5's
    ``gelu_new``) exports, -> Gelu(approximate='tanh'). The cube may be Pow(x, 3) or x*x*x; the halving may
    come first (HF's ``0.5 * x * ...``) or last. Every intermediate must be read by the chain alone."""

    def other(node: ir.Node, v: ir.Value | None) -> ir.Value | None:
        return node.inputs[1] if node.inputs[0] is v else node.inputs[0]

    def near(v: ir.Value | None, want: float) -> bool:
        c = scalar(v)
        return c is not None and abs(c - want) <= 1e-3 * abs(want)  # fp16/bf16 exports round the constants

    def only(n: ir.Node | None, op: str) -> ir.Node | None:
        """The one reader of n's output, when it is an ``op`` node and n's output is no graph output."""
        if n is None or n.outputs[0].is_graph_output() or len(n.outputs[0].uses()) != 1:
            return None
        user = n.outputs[0].uses()[0].node
        return user if user.op_type == op and user.domain in ("", "ai.onnx") else None

    def cube_of(v: ir.Value | None, x: ir.Value) -> list[ir.Node] | None:
        p = producer(v, "Pow")
        if p is not None and p.inputs[0] is x and near(p.inputs[1], 3.0):
            return [p]
        m = producer(v, "Mul")
        if m is None:
            return None
        sq = next((producer(w, "Mul") for w in m.inputs if producer(w, "Mul") is not None), None)
        if sq is not None and list(sq.inputs) == [x, x] and other(m, sq.outputs[0]) is x:
            return [sq, m]
        return None

    root_2_pi = float(np.sqrt(2.0 / np.pi))
    done = 0
    for tanh in list(graph):
        if tanh.op_type != "Tanh" or tanh.domain not in ("", "ai.onnx") or tanh.graph is None:
            continue
        scaled = producer(tanh.inputs[0], "Mul")
        if scaled is None:
            continue
        inner = next((v for v in scaled.inputs if near(other(scaled, v), root_2_pi)), None)
        add = producer(inner, "Add")
        if add is None:
            continue
        for x in add.inputs:
            cubic = producer(other(add, x), "Mul")
            if x is None or cubic is None:
                continue
            cube_v = next((v for v in cubic.inputs if near(other(cubic, v), 0.044715)), None)
            cube = cube_of(cube_v, x)
            if cube is not None:
                break
        else:
            continue
        one = only(tanh, "Add")
        if one is None or not near(other(one, tanh.outputs[0]), 1.0):
            continue
        m1 = only(one, "Mul")
        if m1 is None:
            continue
        rest = other(m1, one.outputs[0])
        half = producer(rest, "Mul")
        if half is not None and x in half.inputs and near(other(half, x), 0.5):  # (0.5 * x) * (1 + tanh)
            tail, out = [half, m1], m1
        elif rest is x and only(m1, "Mul") is not None and near(other(only(m1, "Mul"), m1.outputs[0]), 0.5):
            out = only(m1, "Mul")  # (x * (1 + tanh)) * 0.5
            tail = [m1, out]
        elif near(rest, 0.5) and only(m1, "Mul") is not None and other(only(m1, "Mul"), m1.outputs[0]) is x:
            out = only(m1, "Mul")  # ((1 + tanh) * 0.5) * x
            tail = [m1, out]
        else:
            continue
        assert out is not None
        chain = [*cube, cubic, add, scaled, tanh, one, *tail]
        inside = set(chain)
        if any(o.is_graph_output() or any(u.node not in inside for u in o.uses())
               for n in chain if n is not out for o in n.outputs):
            continue  # an intermediate is read elsewhere: the chain is not GELU alone
        if static_shape(out.outputs[0]) != static_shape(x):  # a [1, 1, ..] constant raised the rank
            continue
        b = Builder(graph, RULE)
        gelu = b.op("Gelu", [x], {"approximate": "tanh"}, domain="", dtype=x.dtype, shape=static_shape(x))
        replace(graph, out, chain, b.nodes, [out.outputs[0]], [gelu.outputs[0]])
        done += 1
    return done


def _unflip_concat(graph: ir.Graph) -> int:
    """Concat(Slice(C, h:), Slice(C, :h)) of C = Concat(P1, P2) along one axis, each slice one part ->
    Concat(P2, P1) (diffusers' flip_sin_to_cos, as the exporters write it)."""

    done = 0
    for node in list(graph):
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        slices = [producer(v, "Slice") for v in node.inputs]
        if not slices or any(s is None for s in slices):
            continue
        src = slices[0].inputs[0]  # type: ignore[union-attr]
        cat = producer(src, "Concat")
        shape = static_shape(src)
        if cat is None or shape is None or any(s.inputs[0] is not src for s in slices):  # type: ignore[union-attr]
            continue
        rank = len(shape)
        axis = attr(cat, "axis", 0) % rank
        if attr(node, "axis", 0) % rank != axis:
            continue
        bounds, start = [], 0
        for part in cat.inputs:
            part_shape = static_shape(part)
            if part_shape is None:
                break
            bounds.append((start, start + part_shape[axis]))
            start += part_shape[axis]
        picked = []
        for sl in slices:
            vals = [const(v) if v is not None else None for v in sl.inputs[1:]]  # type: ignore[union-attr]
            if len(vals) < 3 or any(v is None or v.size != 1 for v in vals[:3]):
                break
            steps = vals[3] if len(vals) > 3 and vals[3] is not None else np.ones(1)
            s0, e0, ax = (int(np.asarray(v).reshape(())) for v in vals[:3])
            if ax % rank != axis or int(np.asarray(steps).reshape(())) != 1:
                break
            span = (s0 % shape[axis] if s0 < 0 else s0, min(e0 if e0 >= 0 else e0 + shape[axis], shape[axis]))
            if span not in bounds:
                break
            picked.append(cat.inputs[bounds.index(span)])
        else:
            b = Builder(graph, RULE)
            new = b.op("Concat", picked, {"axis": axis}, dtype=node.outputs[0].dtype,
                       shape=static_shape(node.outputs[0]))
            replace(graph, node, [node], b.nodes, [node.outputs[0]], [new.outputs[0]])
            done += 1
    return done


def _sincos(graph: ir.Graph) -> int:
    """Concat(Sin(a) | Cos(a), ...) along the last axis with a = Mul(x, f), f a constant along that axis ->
    Sin(Mul(x, f') + phase), f' the parts' f side by side and phase pi/2 where a part is a cosine."""

    done = 0
    for node in list(graph):
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        out_shape = static_shape(node.outputs[0])
        if out_shape is None or attr(node, "axis", 0) % len(out_shape) != len(out_shape) - 1:
            continue
        trig = [producer(v, "Sin") or producer(v, "Cos") for v in node.inputs]
        if any(t is None for t in trig):
            continue
        arg = trig[0].inputs[0]  # type: ignore[union-attr]
        mul = producer(arg, "Mul")
        if mul is None or any(t.inputs[0] is not arg for t in trig):  # type: ignore[union-attr]
            continue
        x, f = (mul.inputs if const(mul.inputs[1]) is not None else reversed(mul.inputs))  # type: ignore[misc]
        fv, x_shape, a_shape = const(f), static_shape(x), static_shape(arg)
        if fv is None or x_shape is None or a_shape is None or x.dtype != ir.DataType.FLOAT:
            continue
        d = a_shape[-1]
        if fv.shape[-1:] != (d,) or any(s != 1 for s in fv.shape[:-1]) or (x_shape and x_shape[-1] != 1):
            continue
        if len(fv.shape) > len(a_shape) or tuple(a_shape[:-1]) != tuple(np.broadcast_shapes(x_shape, fv.shape)[:-1]):
            continue
        freqs = np.concatenate([fv.reshape(-1)] * len(trig)).astype(np.float32)
        phase = np.concatenate([np.full(d, np.pi / 2 if t.op_type == "Cos" else 0.0)  # type: ignore[union-attr]
                                for t in trig]).astype(np.float32)
        shape = [1] * (len(fv.shape) - 1) + [len(freqs)]
        b = Builder(graph, RULE)
        scaled = b.op("Mul", [x, b.const(freqs.reshape(shape), "sinusoid_freqs")], dtype=x.dtype, shape=out_shape)
        shifted = b.op("Add", [scaled.outputs[0], b.const(phase.reshape(shape), "sinusoid_phase")], dtype=x.dtype,
                       shape=out_shape)
        y = b.op("Sin", [shifted.outputs[0]], dtype=x.dtype, shape=out_shape)
        replace(graph, node, [node], b.nodes, [node.outputs[0]], [y.outputs[0]])
        done += 1
    return done


def _scalar_broadcast(graph: ir.Graph) -> int:
    """A chain of Reshape/Expand nodes from a one-element tensor (the timestep) -> one Expand."""
    chain_ops = ("Reshape", "Expand")
    done = 0
    for node in list(graph):
        if node.op_type not in chain_ops or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        out = node.outputs[0]
        if any(u.node.op_type in chain_ops for u in out.uses()):
            continue  # not the end of its chain
        src, length = node.inputs[0], 1
        while src is not None and src.producer() is not None and src.producer().op_type in chain_ops \
                and src.producer().domain in ("", "ai.onnx"):  # type: ignore[union-attr]
            src = src.producer().inputs[0]  # type: ignore[union-attr]
            length += 1
        shape, src_shape = static_shape(out), static_shape(src)
        if length < 2 or shape is None or src_shape is None or int(np.prod(src_shape)) != 1 \
                or len(src_shape) > len(shape):
            continue
        b = Builder(graph, RULE)
        new = b.op("Expand", [src, b.const(np.asarray(shape, np.int64), "shape")], dtype=out.dtype, shape=shape)
        replace(graph, node, [node], b.nodes, [out], [new.outputs[0]])
        done += 1
    return done


def _expand_into_constant(graph: ir.Graph) -> int:
    """Mul/Add(Expand(s), c) with ``s`` one value and ``c`` a small constant -> Mul/Add(s, c broadcast to the
    result's shape), the broadcast done once offline: the UNet's timestep expanded to the batch, times the
    sinusoid's frequencies, is one CPU node instead of two. The same numbers (each element is s op c)."""

    done = 0
    for node in list(graph):
        if node.op_type not in ("Mul", "Add") or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        out_shape = static_shape(node.outputs[0])
        for i in (0, 1):
            e, c = producer(node.inputs[i], "Expand"), node.inputs[1 - i]
            if e is None or c is None or const(c) is None or out_shape is None or int(np.prod(out_shape)) > 1 << 16:
                continue
            src, src_shape = e.inputs[0], static_shape(e.inputs[0])
            if src is None or src_shape is None or int(np.prod(src_shape)) != 1 or len(src_shape) > len(out_shape):
                continue
            if len(e.outputs[0].uses()) != 1 or e.outputs[0].is_graph_output():
                continue
            b = Builder(graph, RULE)
            big = b.derived(c, [step("broadcast", shape=list(out_shape))], list(out_shape), f"{c.name}_b")
            operands = [src, big] if i == 0 else [big, src]
            new = b.op(node.op_type, operands, dtype=node.outputs[0].dtype, shape=out_shape)
            replace(graph, node, [node], b.nodes, [node.outputs[0]], [new.outputs[0]])
            done += 1
            break
    return done


def _crop_constants(graph: ir.Graph, cropped: list[str]) -> int:
    """A Reshape or Slice (steps of one) of a constant, with constant parameters, becomes a constant derived
    from it (``Builder.derived``: made as the model is saved, its provenance kept), however large the source:
    SD3's position-embedding table [1, P*P, C] cropped to the image's [1, h*w, C] under static shapes. The
    small folder above leaves it (it never folds a weight-sized tensor); the crop is smaller than its source."""
    done = 0
    for node in list(graph):
        if node.graph is None or node.op_type not in ("Reshape", "Slice") or node.domain not in ("", "ai.onnx"):
            continue
        x, out = node.inputs[0], node.outputs[0]
        shape, out_shape = static_shape(x), static_shape(out)
        if x is None or x.const_value is None or shape is None or out_shape is None or out.is_graph_output():
            continue
        if any(v is not None and v.const_value is None for v in node.inputs[1:]):
            continue
        if node.op_type == "Reshape":
            steps = [provenance.step("reshape", shape=list(out_shape))]
        else:
            starts, ends = const(node.inputs[1]), const(node.inputs[2])
            axes = const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
            steps_in = const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
            if steps_in is not None and np.any(steps_in != 1):
                continue
            axes = axes if axes is not None else np.arange(starts.size)  # type: ignore[union-attr]
            steps = []
            for a, lo, hi in zip(axes.reshape(-1), starts.reshape(-1), ends.reshape(-1), strict=True):  # type: ignore[union-attr]
                a = int(a) % len(shape)
                n = shape[a]
                lo = min(max(int(lo) + n if lo < 0 else int(lo), 0), n)
                hi = min(max(int(hi) + n if hi < 0 else int(hi), 0), n)
                steps.append(provenance.step("slice", axis=a, start=lo, stop=hi))
            if len(steps) != len(axes.reshape(-1)):
                continue
        b = Builder(graph, RULE)
        folded = b.derived(x, steps, out_shape, f"{x.name}_crop")
        out.replace_all_uses_with(folded)
        if node.op_type == "Slice":
            expr = provenance.origin(x)
            while "x" in expr:
                expr = expr["x"]
            cropped.append(str(expr.get("init", x.name)))
        done += 1
    return done


def bind_input_shapes(model: ir.Model, shapes: dict[str, list[int]]) -> None:
    """Give graph inputs static shapes (an NPU needs them; optimum exports dynamic axes). Shape inference
    in ``canonicalize`` then carries them through the graph."""

    inputs = {v.name: v for v in model.graph.inputs}
    for name, dims in shapes.items():
        if name not in inputs:
            raise SdnpuError(f"the model has no input {name!r}", hint=f"its inputs: {', '.join(inputs)}")
        old = inputs[name].shape
        if old is not None and len(old) != len(dims):
            raise SdnpuError(f"input {name!r} has rank {len(old)}, not {len(dims)}")
        for have, want in zip(old or [], dims):
            if isinstance(have, int) and have != want:
                raise SdnpuError(f"input {name!r} is fixed at {list(old)}; cannot make it {dims}")  # type: ignore
        inputs[name].shape = ir.Shape(list(dims))
    # Shapes the exporter wrote in terms of the dynamic axes would otherwise survive inference: drop them.
    for node in model.graph:
        for out in node.outputs:
            if out.shape is not None and not out.shape.is_static():
                out.shape = None
    for out in model.graph.outputs:
        if out.shape is not None and not out.shape.is_static():
            out.shape = None


def canonicalize(model: ir.Model) -> PassResult:
    counts: Counter[str] = Counter()
    opset = model.opset_imports.get("", 0)
    if opset < TARGET_OPSET:
        model.opset_imports[""] = TARGET_OPSET
        model.graph.opset_imports[""] = TARGET_OPSET
        counts[f"opset {opset} -> {TARGET_OPSET}"] = 1
    n_before = len(model.graph)
    lift = common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)
    provenance.mark_inputs(model.graph)
    counts["Constant nodes -> initializers"] += int(lift(model).modified)
    provenance.mark_inputs(model.graph)  # the input's Constant nodes, now initializers of the same name
    # TorchScript graphs carry no shapes for intermediates; the folder needs them to fold shape
    # arithmetic, and every rule needs static shapes.
    common.ShapeInferencePass(strict_mode=False)(model)
    foldable = provenance.constant_subgraph(model.graph)
    with np.errstate(all="ignore"):  # the graph's own arithmetic (T5's Log(0) = -inf in a branch Where drops)
        counts["constant subgraphs folded"] += int(onnxscript.optimizer.fold_constants(model).modified)
    counts["Constant nodes -> initializers"] += int(lift(model).modified)
    provenance.mark_folded(model.graph, foldable)
    _sync_constant_shapes(model.graph)
    for _ in range(10):  # folding one node can make the next one's inputs constant, or shapes known
        common.ShapeInferencePass(strict_mode=False)(model)
        n = _fold_small(model.graph)
        counts["small constants folded"] += n
        if not n:
            break
    counts["identities dropped"] = _drop_identities(model.graph)
    # every node named: CPU reasons and regions refer to nodes by name
    counts["nodes and values named"] = int(common.NameFixPass()(model).modified)
    common.ShapeInferencePass(strict_mode=False)(model)
    counts["squeeze/unsqueeze/flatten -> reshape"] = _to_reshape(model.graph)
    counts["transpose perm written out"] = _explicit_perm(model.graph)
    counts["x*1, x/1, x+0 removed"] = _drop_neutral(model.graph)
    counts["Erf GELU -> Gelu"] = _erf_gelu(model.graph)
    counts["tanh GELU -> Gelu"] = _tanh_gelu(model.graph)
    counts["Pad merged into Conv"] = _pad_into_conv(model.graph)
    counts["sin/cos halves reordered"] = _unflip_concat(model.graph)
    counts["sinusoids -> one Sin"] = _sincos(model.graph)
    counts["broadcast chains -> Expand"] = _scalar_broadcast(model.graph)
    remove_dead_nodes(model.graph)  # the sinusoids' old halves still read the timestep's Expand
    counts["expands folded into constants"] = _expand_into_constant(model.graph)
    remove_dead_nodes(model.graph)
    cropped: list[str] = []
    for _ in range(8):  # a chain of crops, one node a round
        n = _crop_constants(model.graph, cropped)
        counts["crops of constants folded"] += n
        remove_dead_nodes(model.graph)
        if not n:
            break
    if cropped:
        model.metadata_props[SIZED_CONSTANTS_KEY] = ",".join(sorted({c for c in cropped}))
    common.RemoveUnusedNodesPass()(model)
    counts["nodes removed"] = max(0, n_before - len(model.graph))
    # shape annotations alone (ShapeInferencePass) do not count as a change
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
