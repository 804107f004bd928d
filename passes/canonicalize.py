"""Canonicalize: one form whatever the exporter wrote, so that the rules see a single spelling.

- opset raised to 20 where lower (the reference bodies need 20's Gelu, and a model's functions must import
  the opset its graph does), each op rewritten where its form changed (onnx's version converter);
- Constant nodes become initializers; small constant subgraphs are folded (onnxscript's folder, with its
  size limits, so no large weight is ever materialized here); Identity nodes go;
- shapes and types inferred for every value (the TorchScript exporter writes none for intermediates);
- Squeeze/Unsqueeze/Flatten with static shapes become Reshape (the layout pass reasons about Reshape only);
  a Transpose without ``perm`` (it reverses the axes) gets its perm written out;
- x*1, x/1, x+0 go; so do movements that move nothing given their constant parameters (a Where whose
  condition picks one side everywhere, a one-part Split, a Pad of zeros, a ScatterElements that overwrites a
  whole constant in place; a Gather of a size-1 axis becomes a Reshape): Z-Image's and Lumina 2's token
  padding where nothing is padded, and where some rows are, a Where of a constant mask and a pad token is
  a Mul and an Add (which go to the NPU); a zero Pad in front of a Conv becomes the Conv's pads; the Erf
  form of GELU becomes one Gelu (TorchScript's and optimum's spellings), and the tanh form written out
  (transformers' ``gelu_new``, T5's) one Gelu(approximate='tanh');
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
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes import common
from sdnpu.passes import provenance
from sdnpu.errors import SdnpuError
from sdnpu.formats.weights import INLINE_LIMIT
from sdnpu.passes.irutil import Builder, attr, const, producer, remove_dead_nodes, replace, reroute, scalar, static_shape
from sdnpu.passes.provenance import step
from sdnpu.passes.manager import PassResult
from sdnpu.passes.loops import unroll
from sdnpu.passes.tables import simplify_tables

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


def _where_to_arithmetic(graph: ir.Graph) -> int:
    """``Where(mask, fill, x)`` with a constant mask and a constant fill (a pad token written over the padded
    rows: Z-Image's and Lumina 2's captions) is ``x * keep + fill * mask``, with ``keep = 1 - mask``: a Mul
    and an Add that go to the NPU, where a Where stays on the CPU with a cast each way. ``fill * mask`` is
    folded next (a constant of the output's shape). Exact where x is finite (x * 1 = x, x * 0 + fill = fill);
    either side may be the constant one."""
    done = 0
    for node in list(graph):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        cond, a, b_ = node.inputs
        c = const(cond)
        y = node.outputs[0]
        if c is None or a is None or b_ is None or y.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):
            continue
        if (a.const_value is None) == (b_.const_value is None) or c.all() or not c.any():
            continue  # both or neither constant; a mask that picks one side everywhere: _drop_noop_moves
        fill, x, fill_where = (a, b_, c) if a.const_value is not None else (b_, a, ~c)
        if fill_where.size > INLINE_LIMIT:
            continue  # its product with the fill could not be replayed from the record (LoRA overlays)
        dtype = np.float32 if y.dtype == ir.DataType.FLOAT else np.float16
        bld = Builder(graph, RULE)
        keep = bld.const((~fill_where).astype(dtype), f"{node.name}_keep")
        where = bld.const(fill_where.astype(dtype), f"{node.name}_fill_rows")
        provenance.set_origin(where, provenance.inline(fill_where.astype(dtype)))  # replays: fill * mask
        kept = bld.op("Mul", [x, keep], dtype=y.dtype, shape=None).outputs[0]
        filled = bld.op("Mul", [fill, where], dtype=y.dtype, shape=None).outputs[0]
        out = bld.op("Add", [kept, filled], dtype=y.dtype, shape=static_shape(y)).outputs[0]
        graph.insert_before(node, bld.nodes)
        reroute(graph, y, out)
        graph.remove(node, safe=True)
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
            one = helper.make_model(g, opset_imports=[helper.make_opsetid("", TARGET_OPSET)])
            try:  # the graph's own arithmetic: T5's position buckets take Log(0) = -inf in a branch Where drops
                with np.errstate(all="ignore"):
                    values = ReferenceEvaluator(one).run(None, feeds)
            except Exception:  # an op the reference evaluator lacks or limits (its GatherElements takes <= 64 rows)
                values = _fold_with_onnxruntime(one, outs, feeds)
                if values is None:  # onnxruntime cannot either: leave it to the rules
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


def _fold_with_onnxruntime(model: Any, outs: list[ir.Value], feeds: dict[str, np.ndarray]) -> list[np.ndarray] | None:
    """One node's model run in onnxruntime (its optimizations off; the outputs typed, as it needs them); None
    where it cannot."""
    import onnxruntime as ort

    if any(o.type is None for o in outs):
        return None
    for vi, o in zip(model.graph.output, outs, strict=True):
        vi.type.tensor_type.elem_type = ir.serde.serialize_type(o.type).tensor_type.elem_type  # type: ignore[arg-type]
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return list(session.run(None, feeds))
    except Exception:  # noqa: BLE001 - a node onnxruntime refuses is left as it is
        return None


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


def _drop_noop_casts(graph: ir.Graph) -> int:
    """A Cast to the type its input has already (diffusers' rotary embedding's ``x.float()`` on an fp32
    graph; a dtype round trip the exporter kept) is its input."""
    done = 0
    for node in list(graph):
        if node.op_type != "Cast" or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
            continue
        x, y = node.inputs[0], node.outputs[0]
        if x.dtype is None or int(x.dtype) != attr(node, "to") or y.is_graph_output():
            continue
        y.replace_all_uses_with(x)
        done += 1
    return done


def _noop_source(node: ir.Node) -> ir.Value | ir.Node | None:
    """What a data movement with constant parameters leaves as it is: the value it passes on unchanged, or
    for a Gather of the one row of a size-1 axis the node to become a Reshape; None where it moves data."""
    x, y = node.inputs[0] if node.inputs else None, node.outputs[0]
    sy = static_shape(y)
    if sy is None:
        return None
    op = node.op_type
    if op == "Where":  # a constant condition that picks one side everywhere (a pad mask with nothing padded)
        cond = const(node.inputs[0])
        if cond is None or cond.size == 0 or not (cond.all() or not cond.any()):
            return None
        picked = node.inputs[1] if cond.all() else node.inputs[2]
        return picked if picked is not None and static_shape(picked) == sy and picked.dtype == y.dtype else None
    if x is None or static_shape(x) is None:
        return None
    if op == "Split" and len(node.outputs) == 1:
        return x if static_shape(x) == sy else None
    if op == "Pad":
        pads = const(node.inputs[1]) if len(node.inputs) > 1 else None
        return x if pads is not None and not pads.any() and static_shape(x) == sy else None
    if op == "ScatterElements" and attr(node, "reduction", "none") == "none":
        # every element of a constant overwritten once, in place: the updates themselves (torch's
        # select_scatter into a new tensor of one row)
        data, idx, upd = node.inputs[0], const(node.inputs[1]), node.inputs[2]
        if data is None or data.const_value is None or idx is None or upd is None or static_shape(upd) != sy:
            return None
        axis = int(attr(node, "axis", 0)) % len(sy)
        iota = np.arange(sy[axis]).reshape([-1 if i == axis else 1 for i in range(len(sy))])
        return upd if idx.shape == tuple(sy) and np.array_equal(np.where(idx < 0, idx + sy[axis], idx),
                                                                 np.broadcast_to(iota, sy)) else None
    if op == "Resize" and static_shape(x) == sy and not attr(node, "antialias", 0) and \
            attr(node, "coordinate_transformation_mode", "half_pixel") != "tf_crop_and_resize":
        return x  # to the size it has: every mode samples each value at its own place (a kernel's weight 1 there)
    if op in ("DepthToSpace", "SpaceToDepth") and attr(node, "blocksize", 0) == 1:
        return x  # blocks of one value
    if op == "Gather":  # the one row of a size-1 axis: a Reshape that drops it
        idx = const(node.inputs[1])
        sx = static_shape(x)
        axis = int(attr(node, "axis", 0)) % len(sx)  # type: ignore[arg-type]
        if idx is not None and idx.size == 1 and int(idx.reshape(-1)[0]) in (0, -1) and sx[axis] == 1:  # type: ignore[index]
            return node
    return None


def _drop_noop_moves(graph: ir.Graph) -> int:
    """Data movements that move nothing, given their constant parameters: a Where whose constant condition
    picks one side everywhere, a Split into one part, a Pad of zeros, a ScatterElements that overwrites every
    element of a constant once in place, a Resize to the size it has, a DepthToSpace or SpaceToDepth of blocks of
    one, and a Gather of the one row of a size-1 axis (a Reshape, which a dispatch op reads as a view). Z-Image's and Lumina 2's token padding, at a size where nothing is padded."""
    done = 0
    for node in list(graph):
        if node.graph is None or node.domain not in ("", "ai.onnx") or node.op_type not in (
                "Where", "Split", "Pad", "ScatterElements", "Gather", "Resize", "DepthToSpace",
                "SpaceToDepth") or len(node.outputs) != 1:
            continue
        src = _noop_source(node)
        if src is None:
            continue
        y = node.outputs[0]
        if isinstance(src, ir.Node):  # the Gather -> Reshape
            b = Builder(graph, RULE)
            shape = list(static_shape(y))  # type: ignore[arg-type]
            r = b.op("Reshape", [node.inputs[0], b.const(np.asarray(shape, np.int64), "shape")], dtype=y.dtype,
                     shape=shape)
            graph.insert_before(node, b.nodes)
            reroute(graph, y, r.outputs[0])
        else:
            reroute(graph, y, src)
        graph.remove(node, safe=True)
        done += 1
    if done:
        remove_dead_nodes(graph)
    return done


def _drop_noop_expands(graph: ir.Graph) -> int:
    """An Expand whose output has its input's static shape moves nothing, nor does a Reshape (or a chain of
    them) whose literal target is the shape it started from: TorchScript's attention expands k and v to the
    [B, H, S, D] they have already and reshapes them to it (grouped-query attention's repeat, at one group per
    head), shapes that onnxscript's folder did not know yet. A target with -1 or 0 stays, as the folder leaves
    it (GroupNorm's [B, G, -1], which the norm rule reads)."""
    done = 0
    for node in list(graph):
        if node.op_type not in ("Expand", "Reshape") or node.domain not in ("", "ai.onnx") or node.inputs[0] is None:
            continue
        x, y = node.inputs[0], node.outputs[0]
        sx, sy, target = static_shape(x), static_shape(y), const(node.inputs[1])
        if sx is None or target is None or x.dtype != y.dtype:
            continue
        if node.op_type == "Reshape":  # a chain of reshapes back to the shape it started from
            start = x
            while (p := start.producer()) is not None and p.op_type == "Reshape" and p.domain in ("", "ai.onnx") \
                    and p.inputs[0] is not None and len(start.uses()) == 1 and not start.is_graph_output():
                start = p.inputs[0]
            literal = [int(d) for d in target.reshape(-1)]
            if static_shape(start) is None or literal != list(static_shape(start)):  # type: ignore[arg-type]
                continue
            x = start
        else:
            try:
                out = tuple(np.broadcast_shapes(tuple(sx), tuple(int(d) for d in target.reshape(-1))))
            except ValueError:
                continue
            if out != tuple(sx) or (sy is not None and tuple(sy) != out):
                continue
        reroute(graph, y, x)
        graph.remove(node, safe=True)
        done += 1
    if done:
        remove_dead_nodes(graph)
    return done


def _reciprocals(graph: ir.Graph) -> int:
    """Div(1, x) is Reciprocal(x): TorchScript writes an RMSNorm's 1 / sqrt(mean + eps) so, where dynamo and
    torch's own RMSNorm write Reciprocal (or x / sqrt), and the norm rule reads one form."""
    from sdnpu.passes.irutil import scalar

    done = 0
    for node in list(graph):
        if node.op_type != "Div" or node.domain not in ("", "ai.onnx") or node.graph is None or scalar(node.inputs[0]) != 1.0:
            continue
        x, y = node.inputs[1], node.outputs[0]
        if x is None or static_shape(x) != static_shape(y) or x.dtype != y.dtype:
            continue
        b = Builder(graph, RULE)
        r = b.op("Reciprocal", [x], dtype=y.dtype, shape=static_shape(y))
        replace(graph, node, [node], b.nodes, [y], [r.outputs[0]])
        done += 1
    return done


def _drop_neutral(graph: ir.Graph) -> int:
    """x * 1, x / 1 and x + 0 (a resnet's output_scale_factor of 1, as TorchScript writes it) are x. A weight
    that happens to hold ones or zeros (a seeded norm's gamma, a zero-initialized bias) is a tensor, not a
    scalar, and stays: the graph's form never depends on a parameter's values."""

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


def _drop_softmax_guards(graph: ir.Graph) -> int:
    """``Where(IsNaN(p), 0, p)`` after ``p = Softmax(s)`` (TorchScript's scaled_dot_product_attention guards a
    row whose keys are all masked) is ``p`` where no row can be: the scores are a MatMul's, maybe scaled by
    constants and offset by a finite constant (no -inf anywhere), so every row has a finite maximum and
    Softmax gives no NaN from finite inputs. A mask computed at run time keeps its guard."""
    done = 0
    for node in list(graph):
        if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        cond, zero, p = node.inputs
        isnan = cond.producer() if cond is not None else None
        sm = p.producer() if p is not None else None
        if isnan is None or isnan.op_type != "IsNaN" or isnan.inputs[0] is not p or sm is None \
                or sm.op_type != "Softmax" or scalar(zero) != 0.0 or node.outputs[0].is_graph_output():
            continue
        if static_shape(node.outputs[0]) != static_shape(p) or not _finite_scores(sm.inputs[0]):
            continue
        reroute(graph, node.outputs[0], p)  # type: ignore[arg-type]
        done += 1
    if done:
        remove_dead_nodes(graph)
    return done


def _finite_scores(v: ir.Value | None) -> bool:
    """Whether ``v`` is a MatMul's product behind scalings and finite constant offsets (no mask of -inf)."""
    while v is not None and (p := v.producer()) is not None and p.domain in ("", "ai.onnx"):
        if p.op_type == "MatMul":
            return True
        if p.op_type not in ("Mul", "Div", "Add") or len(p.inputs) != 2:
            return False
        consts = [const(x) for x in p.inputs]
        side = next((i for i, c in enumerate(consts) if c is not None), None)
        if side is None or not np.all(np.isfinite(consts[side])) or (p.op_type == "Div" and side == 0):  # type: ignore[arg-type]
            return False
        v = p.inputs[1 - side]
    return False


def _tile_repeats(graph: ir.Graph) -> int:
    """A Tile that repeats one axis of size 1 (grouped-query attention's ``k.unsqueeze(3).repeat(1, 1, 1,
    r, 1)`` for Lumina 2's key and value heads, as TorchScript writes it) is the Concat of r copies: of the input
    viewed without that axis, along the last axis of the view, which is the Tile's output in memory. The
    Concat goes to the NPU (SDConcat); the attention reads its output as the K or V it is."""
    done = 0
    for node in list(graph):
        if node.op_type != "Tile" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        x, reps = node.inputs
        sx, r, sy = static_shape(x), const(reps), static_shape(node.outputs[0])
        if x is None or sx is None or r is None or sy is None or const(x) is not None:
            continue
        axes = [i for i, k in enumerate(r.reshape(-1)) if int(k) != 1]
        if len(axes) != 1 or sx[axes[0]] != 1 or not 2 <= int(r.reshape(-1)[axes[0]]) <= 64:
            continue
        a, times = axes[0], int(r.reshape(-1)[axes[0]])
        view = [*sx[:a], int(np.prod(sx[a + 1:], dtype=np.int64))]
        b = Builder(graph, RULE)
        flat = b.op("Reshape", [x, b.const(np.asarray(view, np.int64), "shape")], dtype=x.dtype, shape=view)
        joined = [*view[:-1], view[-1] * times]
        cat = b.op("Concat", [flat.outputs[0]] * times, {"axis": len(view) - 1}, dtype=x.dtype, shape=joined)
        out = b.op("Reshape", [cat.outputs[0], b.const(np.asarray(sy, np.int64), "shape")], dtype=x.dtype,
                   shape=list(sy))
        replace(graph, node, [node], b.nodes, [node.outputs[0]], [out.outputs[0]])
        done += 1
    return done


def _einsum(graph: ir.Graph) -> int:
    """An Einsum that moves data or multiplies matrices, written as those ops: one operand with every index
    once (``nhwpqc->nchpwq``, the DiTs' unpatchify) is a Transpose; two operands with no index summed alone
    or repeated are a batched MatMul between Transposes and Reshapes (``bij,bjk->bik``, ``bhqd,bhkd->bhqk``),
    which the layout pass simplifies and the rules fuse. Anything else (an ellipsis, a diagonal, a sum over an
    index of one operand) stays an Einsum."""
    done = 0
    for node in list(graph):
        if node.op_type != "Einsum" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        eq = attr(node, "equation", "")
        eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
        if "->" not in eq or "." in eq:
            continue
        lhs, out = eq.split("->")
        terms = lhs.split(",")
        shapes = [static_shape(v) for v in node.inputs]
        y_shape = static_shape(node.outputs[0])
        if y_shape is None or any(sh is None or len(sh) != len(t) for sh, t in zip(shapes, terms, strict=False)) \
                or len(terms) != len(node.inputs) or any(len(set(t)) != len(t) for t in [*terms, out]):
            continue
        b = Builder(graph, RULE)
        x = node.inputs[0]
        assert x is not None
        if len(terms) == 1 and sorted(terms[0]) == sorted(out):
            y = b.op("Transpose", [x], {"perm": [terms[0].index(c) for c in out]}, dtype=node.outputs[0].dtype,
                     shape=y_shape).outputs[0]
        elif len(terms) == 2 and set(out) <= set(terms[0]) | set(terms[1]) \
                and not (set(terms[0]) ^ set(terms[1])) - set(out):
            y = _einsum_matmul(b, node, terms, out, shapes, y_shape)  # type: ignore[arg-type]
        else:
            continue
        replace(graph, node, [node], b.nodes, [node.outputs[0]], [y])
        done += 1
    return done


def _einsum_matmul(b: Builder, node: ir.Node, terms: list[str], out: str, shapes: list[tuple[int, ...]],
                   y_shape: tuple[int, ...]) -> ir.Value:
    a, c = terms
    dims = {ch: d for t, sh in zip(terms, shapes, strict=True) for ch, d in zip(t, sh, strict=True)}
    batch = [ch for ch in out if ch in a and ch in c]
    rows = [ch for ch in out if ch in a and ch not in c]
    cols = [ch for ch in out if ch in c and ch not in a]
    summed = [ch for ch in a if ch in c and ch not in out]
    dtype = node.outputs[0].dtype

    def arrange(v: ir.Value, term: str, order: list[str], groups: list[list[str]]) -> ir.Value:
        perm = [term.index(ch) for ch in order]
        if perm != list(range(len(perm))):
            v = b.op("Transpose", [v], {"perm": perm}, dtype=dtype, shape=[dims[ch] for ch in order]).outputs[0]
        shape = [int(np.prod([dims[ch] for ch in g])) for g in groups]
        return b.op("Reshape", [v, b.const(np.asarray(shape, np.int64), "shape")], dtype=dtype, shape=shape).outputs[0]

    left = arrange(node.inputs[0], a, batch + rows + summed, [batch, rows, summed])  # type: ignore[arg-type]
    right = arrange(node.inputs[1], c, batch + summed + cols, [batch, summed, cols])  # type: ignore[arg-type]
    n_b, n_r, n_c = (int(np.prod([dims[ch] for ch in g])) for g in (batch, rows, cols))
    prod = b.op("MatMul", [left, right], dtype=dtype, shape=[n_b, n_r, n_c]).outputs[0]
    order = batch + rows + cols
    full = b.op("Reshape", [prod, b.const(np.asarray([dims[ch] for ch in order], np.int64), "shape")], dtype=dtype,
                shape=[dims[ch] for ch in order]).outputs[0]
    perm = [order.index(ch) for ch in out]
    if perm == list(range(len(perm))):
        return full
    return b.op("Transpose", [full], {"perm": perm}, dtype=dtype, shape=list(y_shape)).outputs[0]


_SIGNED_MOVES = frozenset({"Reshape", "Transpose", "Slice", "Split", "Gather", "Neg", "Concat"})
_MAX_ROTATION = 512  # the widest last axis a signed permutation becomes a [D, D] MatMul for (a head's)


def _moved_from(y: ir.Value) -> tuple[ir.Value, list[ir.Node]] | None:
    """(x, nodes) when ``y`` is computed from the one value ``x`` of its own shape by data movement and
    negation only (Reshape, Transpose, Slice, Split, Gather, Concat with constant parameters, Neg), else None.
    ``x`` is the nearest such value: a rotation applied after the streams' Concat (Flux's joint queries) reads
    the Concat's output, not the streams."""

    def walk(stop: ir.Value | None) -> tuple[list[ir.Value], dict[int, ir.Node], list[ir.Value]]:
        nodes: dict[int, ir.Node] = {}
        sources: dict[int, ir.Value] = {}
        seen: list[ir.Value] = []
        todo = [y]
        while todo:
            v = todo.pop(0)
            seen.append(v)
            p = v.producer()
            moved = v is not stop and p is not None and p.op_type in _SIGNED_MOVES and p.domain in ("", "ai.onnx")
            data = ([*p.inputs] if p.op_type == "Concat" else [p.inputs[0]]) if moved else []  # type: ignore[union-attr]
            params = [w for w in p.inputs if w is not None and w not in data] if moved else []  # type: ignore[union-attr]
            if not moved or any(w.const_value is None for w in params) or any(w is None for w in data):
                sources[id(v)] = v
                continue
            if id(p) not in nodes:
                nodes[id(p)] = p  # type: ignore[index]
                todo += data  # type: ignore[arg-type]
        return list(sources.values()), nodes, seen

    sources, nodes, seen = walk(None)
    shape = static_shape(y)
    candidates = [None] + [v for v in seen[1:] if static_shape(v) == shape]
    for stop in candidates:
        if stop is not None:
            sources, nodes, _ = walk(stop)
        if len(sources) == 1 and nodes and static_shape(sources[0]) == shape:
            return sources[0], list(nodes.values())
    return None


def _probe(x: ir.Value, y: ir.Value, nodes: list[ir.Node]) -> np.ndarray | None:
    """``nodes`` run on x = 1, 2, 3, ... (float64, in x's shape): y's elements as signed 1-based indices of
    x's, or None where the subgraph cannot be evaluated."""
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    shape = static_shape(x)
    if shape is None or int(np.prod(shape)) > 1 << 26:
        return None
    order = {id(n): i for i, n in enumerate(x.graph or [])} if x.graph is not None else {}
    protos = [ir.serde.serialize_node(n) for n in sorted(nodes, key=lambda n: order.get(id(n), 0))]
    consts = {w.name: w.const_value.numpy() for n in nodes for w in n.inputs  # type: ignore[union-attr]
              if w is not None and w.const_value is not None}
    inits = [helper.make_tensor(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape, v.reshape(-1).tolist())
             for k, v in consts.items()]
    g = helper.make_graph(protos, "probe", [helper.make_tensor_value_info(x.name, 11, shape)],  # type: ignore[arg-type]
                          [helper.make_tensor_value_info(y.name, 0, None)], inits)  # type: ignore[arg-type]
    try:
        out = ReferenceEvaluator(helper.make_model(g, opset_imports=[helper.make_opsetid("", TARGET_OPSET)])).run(
            None, {x.name: np.arange(1, int(np.prod(shape)) + 1, dtype=np.float64).reshape(shape)})[0]
    except Exception:  # an op the reference evaluator takes otherwise: not a rotation we can read
        return None
    return np.asarray(out)


def _signed_permutations(graph: ir.Graph) -> int:
    from sdnpu.passes.tables import edge_values

    edge = edge_values(graph)  # a table the CPU makes stays as it is: as a MatMul it would cost MACs there
    return _rotations(graph, edge)


def _rotations(graph: ir.Graph, edge: set[ir.Value]) -> int:
    """A value computed from one tensor by data movement and negation alone, of the tensor's own shape and
    mixing the elements of each row of its last axis the same way for every row, is that tensor times a
    constant signed permutation matrix: the rotary embeddings' rotation (``rotate_half``: cat(-x2, x1);
    interleaved pairs: stack(-x_odd, x_even)) as a [D, D] MatMul, which the Gemm rule puts on the NPU. Found by
    running the subgraph on x = 1, 2, 3, ...: each output is plus or minus one input."""
    done = 0
    for node in list(graph):
        if node.graph is None or node.op_type not in _SIGNED_MOVES or node.domain not in ("", "ai.onnx"):
            continue
        for y in node.outputs:
            shape = static_shape(y)
            readers = [u.node for u in y.uses()]
            inner = all(r.op_type in _SIGNED_MOVES and r.domain in ("", "ai.onnx") for r in readers)
            if shape is None or not shape or (readers and inner and not y.is_graph_output()) or y.dtype != ir.DataType.FLOAT:
                continue
            found = _moved_from(y)
            if found is None or found[0] in edge:
                continue
            x, nodes = found
            if shape[-1] > _MAX_ROTATION or not any(
                    n.op_type in ("Neg", "Concat") for n in nodes):
                continue
            out = _probe(x, y, nodes)
            if out is None or out.shape != shape:
                continue
            d = shape[-1]
            src = np.abs(out).astype(np.int64).reshape(-1, d) - 1
            sign = np.sign(out).reshape(-1, d)
            row = np.arange(src.shape[0])[:, None]
            cols = src - row * d
            if np.any(src < 0) or np.any(src // d != row) or not (np.all(cols == cols[:1]) and np.all(sign == sign[:1])):
                continue
            if np.array_equal(cols[0], np.arange(d)) and np.all(sign[0] == 1):  # moved back where it was
                reroute(graph, y, x)
                done += 1
                continue
            rotation = np.zeros((d, d), np.float32)
            rotation[cols[0], np.arange(d)] = sign[0]
            b = Builder(graph, RULE)
            mm = b.op("MatMul", [x, b.const(rotation, "rotation")], dtype=y.dtype, shape=shape)
            graph.insert_before(node, b.nodes)
            reroute(graph, y, mm.outputs[0])
            done += 1
    if done:
        remove_dead_nodes(graph)
        graph.sort()
    return done


def _scatter_rows(graph: ir.Graph) -> int:
    """ScatterND with constant indices that write a block of whole rows along one axis (an in-place slice
    assignment: CogView4's ``query[:, :, text:] = rope(query[:, :, text:])``) is the Concat it is: the rows
    before the block, the updates, the rows after, whose parts the streams pass then reads apart. Found by
    running the scatter on index tensors."""
    done = 0
    for node in list(graph):
        if node.op_type != "ScatterND" or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        data, idx, upd = node.inputs[0], node.inputs[1], node.inputs[2]
        d_shape, u_shape, ix = static_shape(data), static_shape(upd), const(idx)
        if data is None or upd is None or d_shape is None or u_shape is None or ix is None or \
                attr(node, "reduction", "none") not in ("none", b"none") or int(np.prod(d_shape)) > 1 << 24:
            continue
        k = ix.shape[-1]
        probe = np.zeros(d_shape, np.int64)
        try:
            probe[tuple(np.moveaxis(ix, -1, 0))] = np.arange(1, int(np.prod(u_shape)) + 1).reshape(u_shape)
        except (IndexError, ValueError):
            continue
        written = probe > 0
        block = None
        for axis in range(min(k, len(d_shape))):
            rows = np.nonzero(np.any(written, axis=tuple(a for a in range(len(d_shape)) if a != axis)))[0]
            if rows.size == 0:
                break
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            index = [slice(None)] * len(d_shape)
            index[axis] = slice(lo, hi)
            want = np.zeros(d_shape, bool)
            want[tuple(index)] = True
            region = probe[tuple(index)]
            if np.array_equal(written, want) and np.array_equal(region.reshape(-1), np.arange(1, region.size + 1)):
                block = (axis, lo, hi, region.shape)
                break
        if block is None:
            continue
        axis, lo, hi, region_shape = block
        b = Builder(graph, RULE)
        parts = []
        for start, stop in ((0, lo), (hi, d_shape[axis])):
            if start < stop:
                piece = [*d_shape[:axis], stop - start, *d_shape[axis + 1:]]
                args = [b.const(np.asarray([x], np.int64), "rows") for x in (start, stop, axis)]
                parts.append((start, b.op("Slice", [data, *args], dtype=data.dtype, shape=piece).outputs[0]))
        middle = upd if tuple(u_shape) == tuple(region_shape) else b.op(
            "Reshape", [upd, b.const(np.asarray(region_shape, np.int64), "shape")], dtype=upd.dtype,
            shape=list(region_shape)).outputs[0]
        parts.append((lo, middle))
        parts.sort(key=lambda p: p[0])
        y = b.op("Concat", [v for _, v in parts], {"axis": axis}, dtype=node.outputs[0].dtype,
                 shape=list(d_shape)).outputs[0]
        replace(graph, node, [node], b.nodes, [node.outputs[0]], [y])
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


_AFFINE = frozenset({"Mul", "Add", "Sub", "Div"})
_CHAIN_UNARY = frozenset({"Sin", "Cos", "Neg", "Exp", "Sigmoid", "Tanh"})


def _column_chain(y: ir.Value) -> tuple[ir.Value, list[tuple[str, int, np.ndarray, ir.Value]], int] | None:
    """``y = Reshape(E(Reshape(x, [N k, 1])), [N, k F])`` with ``E`` element-wise ops whose other operand is a
    constant row [1, F] or [F] (a sinusoid's frequencies and phase), or unary (its Sin): (x, E's steps as
    (op, side of the constant or -1, its values, the constant or the unary's input), F), or None. Every
    value on the way has one reader."""
    outer = y.producer()
    v: ir.Value | None = y
    if outer is not None and outer.op_type == "Reshape" and outer.domain in ("", "ai.onnx"):
        v = outer.inputs[0]  # (a column of one, k = 1, has no Reshape either side: they were dropped)
    sy, sv = static_shape(y), static_shape(v)
    if v is None or sy is None or sv is None or len(sy) != 2 or len(sv) != 2 or (v is not y and len(v.uses()) != 1):
        return None
    f = sv[1]
    steps: list[tuple[str, int, np.ndarray, ir.Value]] = []
    while (p := v.producer()) is not None and p.op_type in _AFFINE | _CHAIN_UNARY and p.domain in ("", "ai.onnx"):
        if p.op_type in _CHAIN_UNARY:
            if p.attributes:
                return None
            steps.append((p.op_type, -1, np.zeros(0), p.inputs[0]))  # type: ignore[arg-type]
            v = p.inputs[0]
            if v is None or len(v.uses()) != 1:
                return None
            continue
        side = next((i for i, w in enumerate(p.inputs) if w is not None and w.const_value is not None), None)
        if side is None or len(p.inputs) != 2:
            return None
        c = p.inputs[side]
        cv = const(c)
        if cv is None or cv.size != f or (cv.ndim == 2 and cv.shape[0] != 1) or cv.ndim > 2:
            return None
        steps.append((p.op_type, side, cv.reshape(-1), c))  # type: ignore[arg-type]
        v = p.inputs[1 - side]
        if v is None or len(v.uses()) != 1:
            return None
    col = v
    x = v
    while (inner := x.producer()) is not None and inner.op_type == "Reshape" and inner.domain in ("", "ai.onnx") \
            and inner.inputs[0] is not None and len(x.uses()) == 1:
        x = inner.inputs[0]  # the column, through a chain of Reshapes ([N, k] -> [N k] -> [N k, 1])
    if not steps:
        return None
    sx, sc = static_shape(x), static_shape(col)
    if x is None or sx is None or len(sx) != 2 or sc != (sx[0] * sx[1], 1) or sy != (sx[0], sx[1] * f):
        return None
    return x, steps[::-1], f


def _merge_column_chains(graph: ir.Graph) -> int:
    """A Concat (along the features, 2-D) of the same element-wise chain applied to several inputs' columns,
    each flattened to [N k_i, 1], scaled by a row of constants and viewed back as [N, k_i F] (CogView4's
    original size, crop and target size sinusoids: three chains of four CPU nodes), is the chain applied once
    to the inputs' Concat: the rows of ``Concat(x_i)`` flattened are the chains' rows in the Concat's order,
    so every value is the same number. One chain of five CPU nodes instead of four per input and the Concat."""
    done = 0
    remove_dead_nodes(graph)  # readers left by the rewrites before (the sinusoids' old halves)
    for node in list(graph):
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or node.graph is None or len(
                node.inputs) < 2:
            continue
        y = node.outputs[0]
        sy = static_shape(y)
        if sy is None or len(sy) != 2 or int(attr(node, "axis", 0)) % 2 != 1:
            continue
        chains = [_column_chain(v) for v in node.inputs if v is not None]
        if len(chains) != len(node.inputs) or any(c is None for c in chains):
            continue
        first = chains[0]
        assert first is not None
        same = all(c is not None and c[2] == first[2] and len(c[1]) == len(first[1]) and all(
            a[0] == b[0] and a[1] == b[1] and np.array_equal(a[2], b[2]) for a, b in zip(c[1], first[1], strict=True))
            and c[0].dtype == first[0].dtype and static_shape(c[0])[0] == static_shape(first[0])[0]  # type: ignore[index]
            for c in chains)
        if not same:
            continue
        n, f = static_shape(first[0])[0], first[2]  # type: ignore[index]
        k = sum(static_shape(c[0])[1] for c in chains)  # type: ignore[index, union-attr]
        b = Builder(graph, RULE)
        v = b.op("Concat", [c[0] for c in chains], {"axis": 1}, dtype=first[0].dtype, shape=[n, k]).outputs[0]  # type: ignore[union-attr]
        v = b.op("Reshape", [v, b.const(np.asarray([n * k, 1], np.int64), "shape")], dtype=v.dtype,
                 shape=[n * k, 1]).outputs[0]
        for op, side, _, c in first[1]:
            ins = [v] if side < 0 else [c, v] if side == 0 else [v, c]
            v = b.op(op, ins, dtype=y.dtype, shape=[n * k, f]).outputs[0]
        v = b.op("Reshape", [v, b.const(np.asarray([n, k * f], np.int64), "shape")], dtype=y.dtype,
                 shape=[n, k * f]).outputs[0]
        graph.insert_before(node, b.nodes)
        reroute(graph, y, v)
        graph.remove(node, safe=True)
        done += 1
    if done:
        remove_dead_nodes(graph)
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
    sinusoid's frequencies, is one CPU node instead of two. The same numbers (each element is s op c). A
    Reshape of one value is the same broadcast (the timestep viewed as [1, 1] at batch 1)."""

    done = 0
    for node in list(graph):
        if node.op_type not in ("Mul", "Add") or node.domain not in ("", "ai.onnx") or node.graph is None:
            continue
        out_shape = static_shape(node.outputs[0])
        for i in (0, 1):
            e, c = producer(node.inputs[i], "Expand") or producer(node.inputs[i], "Reshape"), node.inputs[1 - i]
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


def _raise_opset(model: ir.Model, opset: int) -> None:
    """The model at opset 20 (``TARGET_OPSET``), its ops rewritten where their form changed (ReduceMean's axes
    became an input at 18, Scatter became ScatterElements at 11, ...). onnx's converter covers every opset; it
    works on a protobuf, so a model whose weights lie in external data (a full-size export: opset 17 or newer)
    goes through onnxscript's, which covers those. What a converter adds is made from attributes, never from
    a weight: its new constants are literals."""
    import onnx
    import onnx.version_converter
    import onnxscript.version_converter

    from sdnpu.errors import SdnpuError

    known = set(model.graph.initializers) | {o.name for n in model.graph for o in n.outputs if n.op_type == "Constant"}
    external = any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
    try:
        if external:
            onnxscript.version_converter.convert_version(model, TARGET_OPSET)
        else:
            proto = onnx.version_converter.convert_version(ir.serde.serialize_model(model), TARGET_OPSET)
            converted = ir.serde.deserialize_model(proto)
            model.graph = converted.graph
            model.functions.clear()
            model.functions.update(converted.functions)
    except Exception as e:
        raise SdnpuError(f"the model's opset {opset} cannot be raised to {TARGET_OPSET} (the compiler's): "
                         f"{type(e).__name__}: {' '.join(str(e).split())[:300]}",
                         hint=f"export the model at opset {TARGET_OPSET} (torch.onnx.export(..., opset_version="
                         f"{TARGET_OPSET}))") from e
    model.opset_imports[""] = TARGET_OPSET
    model.graph.opset_imports[""] = TARGET_OPSET
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    for name, value in model.graph.initializers.items():
        if name not in known:
            provenance.set_origin(value, provenance.LITERAL)


def _keep_output_names(graph: ir.Graph, names: list[str | None]) -> None:
    """The graph outputs keep the names they came with (a folded If hands its branch's output name up): a
    dispatch model's signature is its graph's."""
    for value, name in zip(graph.outputs, names, strict=True):
        if name is None or value.name == name:
            continue
        holder = next((v for n in graph for v in n.outputs if v.name == name and v is not value), None)
        holder = holder or next((v for v in graph.inputs if v.name == name), None)
        if holder is not None:
            holder.name = f"{name}_inner"
        value.name = name


def canonicalize(model: ir.Model) -> PassResult:
    counts: Counter[str] = Counter()
    opset = model.opset_imports.get("", 0)
    if opset < TARGET_OPSET:
        _raise_opset(model, opset)
        counts[f"opset {opset} -> {TARGET_OPSET}"] = 1
    n_before = len(model.graph)
    outputs = [v.name for v in model.graph.outputs]
    lift = common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)
    provenance.mark_inputs(model.graph)
    counts["Constant nodes -> initializers"] += int(lift(model).modified)
    provenance.mark_inputs(model.graph)  # the input's Constant nodes, now initializers of the same name
    # TorchScript graphs carry no shapes for intermediates; the folder needs them to fold shape
    # arithmetic, and every rule needs static shapes.
    common.ShapeInferencePass(strict_mode=False)(model)
    foldable = provenance.constant_subgraph(model.graph)
    with np.errstate(all="ignore"):  # the graph's own arithmetic (T5's Log(0) = -inf in a branch Where drops)
        try:
            counts["constant subgraphs folded"] += int(onnxscript.optimizer.fold_constants(model).modified)
        except Exception as e:  # an op its folder cannot evaluate (ONNX's SplitToSequence test): ours go on
            log.warning("onnxscript's constant folder stopped (%s: %s); folding with sdnpu's own only",
                        type(e).__name__, str(e)[:200])
    counts["Constant nodes -> initializers"] += int(lift(model).modified)
    provenance.mark_folded(model.graph, foldable)
    _sync_constant_shapes(model.graph)
    common.ShapeInferencePass(strict_mode=False)(model)
    counts["Where over constant rows -> Mul, Add"] = _where_to_arithmetic(model.graph)
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
    counts["casts to the same type dropped"] = _drop_noop_casts(model.graph)
    counts["expands and reshapes to the same shape dropped"] = _drop_noop_expands(model.graph)
    counts["movements that move nothing dropped"] = _drop_noop_moves(model.graph)
    counts["softmax NaN guards without a mask dropped"] = _drop_softmax_guards(model.graph)
    counts["tiles of a size-1 axis -> Concat"] = _tile_repeats(model.graph)
    counts["1 / x -> Reciprocal"] = _reciprocals(model.graph)
    counts["Erf GELU -> Gelu"] = _erf_gelu(model.graph)
    counts["tanh GELU -> Gelu"] = _tanh_gelu(model.graph)
    counts["Pad merged into Conv"] = _pad_into_conv(model.graph)
    counts["Einsum -> Transpose / MatMul"] = _einsum(model.graph)
    counts.update(unroll(model.graph))  # per-item loops written out, as the batched movement they are
    remove_dead_nodes(model.graph)
    counts["row-block ScatterND -> Concat"] = _scatter_rows(model.graph)
    counts["sin/cos halves reordered"] = _unflip_concat(model.graph)
    counts["sinusoids -> one Sin"] = _sincos(model.graph)
    counts["parallel column chains -> one"] = _merge_column_chains(model.graph)
    counts["broadcast chains -> Expand"] = _scalar_broadcast(model.graph)
    remove_dead_nodes(model.graph)  # the sinusoids' old halves still read the timestep's Expand
    counts["expands folded into constants"] = _expand_into_constant(model.graph)
    remove_dead_nodes(model.graph)
    counts.update(simplify_tables(model.graph))  # the CPU work on the inputs alone, in as few nodes as it takes
    counts["signed permutations (rotary embeddings) -> MatMul"] = _signed_permutations(model.graph)
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
    _keep_output_names(model.graph, outputs)
    counts["nodes removed"] = max(0, n_before - len(model.graph))
    # shape annotations alone (ShapeInferencePass) do not count as a change
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
