"""Nodes the HTP refuses for their rank, element type or form, written in a form it takes, the same values: a
reduction of rank 5 over a view of rank 4 or less, a Gather of rank-6 data over a rank-3 view, a GatherND of
bool data on int32, an Einsum QNN has no form for as the Transposes and MatMul it is; and one form QNN takes but
computes wrong: a GatherND whose slices have two or more axes, over a view whose slices have one. See
``sdnpu.passes.htp``."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.ops.target import StandardTarget
from sdnpu.passes.canonical.movement import einsum_as_ops
from sdnpu.passes.htp.common import RULE, node_name, take_place
from sdnpu.passes.irutil import Builder, attr, const, static_shape
from sdnpu.passes.manager import PassResult
from sdnpu.passes.standard import node_info

REDUCTIONS = ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
              "ReduceProd", "ReduceSum", "ReduceSumSquare")
_REDUCED_RANK = 4  # the rank every reduction is measured to compile at (ReduceL2: rank 5 refused, 3 and 4 taken)
_LEAST_RANK = 3  # ReduceL2 measured taken at ranks 3 and 4: a view of fewer axes gets leading ones
_GATHER_RANK = 5  # Gather: rank 6 refused, rank 5 taken (measured)


def _named(graph: ir.Graph, b: Builder, hint: str) -> list[ir.Node]:
    for k, n in enumerate(b.nodes):
        n.name = node_name(graph, f"{hint}_{k}")
        n.outputs[0].name = n.name
    return b.nodes


def _refused(target: StandardTarget, node: ir.Node) -> bool:
    return target.check(node.domain, node_info(node)) is not None


def _axes(node: ir.Node, rank: int) -> list[int] | None:
    """The reduced axes, normalized (all of them where none are given and that means all); None where they are
    computed."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        given = const(node.inputs[1])
        if given is None:
            return None
        axes = [int(a) for a in np.asarray(given).reshape(-1)]
    else:
        axes = [int(a) for a in (attr(node, "axes") or [])]
    if not axes:
        return None if attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    return sorted({a % rank for a in axes})


def _merged_view(shape: tuple[int, ...], reduced: list[int]) -> tuple[list[int], list[int]]:
    """``shape`` with its size-1 axes dropped and neighbours of the same kind (reduced or kept) merged: the view
    and the reduced axes in it. A reduction over it computes the same values as over ``shape``."""
    view: list[int] = []
    kinds: list[bool] = []
    for i, d in enumerate(shape):
        if d == 1:
            continue
        kind = i in reduced
        if kinds and kinds[-1] == kind:
            view[-1] *= d
        else:
            view.append(d)
            kinds.append(kind)
    pad = max(0, _LEAST_RANK - len(view))  # leading ones: the ranks measured
    return [1] * pad + view, [pad + i for i, k in enumerate(kinds) if k]


def lower_reductions(model: ir.Model, target: StandardTarget) -> PassResult:
    """A reduction the table refuses for its rank (QNN's ReduceL2 at rank 5: a 3-D VAE's ``F.normalize`` over
    channels, Qwen-Image's and Wan's) over a view of lower rank: size-1 axes dropped, neighbouring reduced axes
    merged, neighbouring kept axes merged; then viewed as the output it had. The same sums, in the same order of
    elements along each reduced run."""
    graph, opset = model.graph, model.opset_imports.get("", 17)
    done = 0
    for node in [n for n in graph if n.op_type in REDUCTIONS and n.domain in ("", "ai.onnx")]:
        x, y = node.inputs[0], node.outputs[0]
        shape, out = static_shape(x), static_shape(y)
        if shape is None or out is None or len(shape) <= _REDUCED_RANK or not _refused(target, node):
            continue
        axes = _axes(node, len(shape))
        if axes is None:
            continue
        view, new_axes = _merged_view(shape, axes)
        if len(view) > _REDUCED_RANK or not new_axes:
            continue
        b = Builder(graph, RULE)
        v = b.op("Reshape", [x, b.const(np.asarray(view, np.int64), "reduce_view")], dtype=x.dtype,
                 shape=view).outputs[0]
        attrs = {k: a.value for k, a in node.attributes.items() if k not in ("axes", "keepdims")}
        reduced_shape = [1 if i in new_axes else d for i, d in enumerate(view)]
        if opset >= 18 or (node.op_type == "ReduceSum" and opset >= 13):  # axes an input (ReduceSum: from 13)
            r = b.op(node.op_type, [v, b.const(np.asarray(new_axes, np.int64), "reduce_axes")],
                     {**attrs, "keepdims": 1}, dtype=y.dtype, shape=reduced_shape).outputs[0]
        else:
            r = b.op(node.op_type, [v], {**attrs, "axes": new_axes, "keepdims": 1}, dtype=y.dtype,
                     shape=reduced_shape).outputs[0]
        back = b.op("Reshape", [r, b.const(np.asarray(out, np.int64), "reduce_back")], dtype=y.dtype, shape=out)
        take_place(graph, node, _named(graph, b, f"{node.name}_rank{len(view)}"), back.outputs[0])
        done += 1
    return PassResult(modified=bool(done), counts={"reductions over a lower-rank view": done})


def lower_gathers(model: ir.Model, target: StandardTarget) -> PassResult:
    """A Gather from data of a rank the table refuses (QNN's Gather at rank 6: HiDream's rotary, ``x.reshape(...,
    -1, 1, 2)`` then ``x[..., 0]``) where that data is a Reshape read only by Gathers: each Gather over the view
    ``[before, n, after]`` of the Reshape's input (the axes before and after the gathered one merged), then a
    Reshape to its output. The same elements."""
    graph = model.graph
    done = 0
    for view in [n for n in graph if n.op_type == "Reshape" and n.domain in ("", "ai.onnx")]:
        data = view.outputs[0]
        shape = static_shape(data)
        readers = [u.node for u in data.uses()]
        if (shape is None or len(shape) <= _GATHER_RANK or data.is_graph_output() or not readers
                or any(r.op_type != "Gather" or r.inputs[0] is not data or static_shape(r.outputs[0]) is None
                       or static_shape(r.inputs[1]) is None for r in readers)
                or not any(_refused(target, r) for r in readers)):
            continue
        src = view.inputs[0]
        assert src is not None
        made: dict[int, ir.Value] = {}  # a view per gathered axis, shared by the Gathers of that axis
        for r in readers:
            axis = int(attr(r, "axis", 0)) % len(shape)
            b = Builder(graph, RULE)
            if axis not in made:
                three = [int(np.prod(shape[:axis])), shape[axis], int(np.prod(shape[axis + 1:]))]
                made[axis] = b.op("Reshape", [src, b.const(np.asarray(three, np.int64), "gather_view")],
                                  dtype=data.dtype, shape=three).outputs[0]
            three_view = made[axis]
            idx = r.inputs[1]
            idx_shape = static_shape(idx)
            assert idx is not None and idx_shape is not None
            d3 = static_shape(three_view)
            assert d3 is not None
            g = b.op("Gather", [three_view, idx], {"axis": 1}, dtype=data.dtype,
                     shape=[d3[0], *idx_shape, d3[2]]).outputs[0]
            y = r.outputs[0]
            out = static_shape(y)
            assert out is not None
            back = b.op("Reshape", [g, b.const(np.asarray(out, np.int64), "gather_back")], dtype=y.dtype, shape=out)
            take_place(graph, r, _named(graph, b, f"{r.name}_rank3"), back.outputs[0])
            done += 1
        if not data.uses():
            graph.remove(view, safe=True)
    return PassResult(modified=bool(done), counts={"Gathers of rank-6 data over a rank-3 view": done})


def gather_bool_as_int32(model: ir.Model, target: StandardTarget) -> PassResult:
    """A GatherND (or Gather) of bool data the table refuses (QNN's GatherND: "Failed to create GatherND node" on
    Qwen2's padding mask; int32 data taken): the data cast to int32, gathered, and cast back to bool. The same
    truth values."""
    graph = model.graph
    done = 0
    for node in [n for n in graph if n.op_type in ("GatherND", "Gather") and n.domain in ("", "ai.onnx")]:
        data, y = node.inputs[0], node.outputs[0]
        if data is None or data.dtype != ir.DataType.BOOL or not _refused(target, node):
            continue
        b = Builder(graph, RULE)
        as_int = b.op("Cast", [data], {"to": ir.DataType.INT32}, dtype=ir.DataType.INT32,
                      shape=static_shape(data)).outputs[0]
        gathered = b.op(node.op_type, [as_int, *node.inputs[1:]], {k: a.value for k, a in node.attributes.items()},
                        dtype=ir.DataType.INT32, shape=static_shape(y)).outputs[0]
        back = b.op("Cast", [gathered], {"to": ir.DataType.BOOL}, dtype=ir.DataType.BOOL, shape=static_shape(y))
        take_place(graph, node, _named(graph, b, f"{node.name}_int32"), back.outputs[0])
        done += 1
    return PassResult(modified=bool(done), counts={"bool gathers on int32": done})


def gather_nd_flat_slices(model: ir.Model) -> PassResult:
    """A GatherND whose gathered slices have two or more axes (data ``[H, W, 1, C]`` with index pairs: dynamo's
    nearest-exact upsampling of a 3-D VAE's one frame, ``_unsafe_index``) over the view of its data whose slices
    have one (``[H, W, C]``), the output viewed back. QNN takes the first form whole and computes it wrong, with no
    error: measured here on its HTP emulator, 98-99% of the values wrong for 130 x 130 index pairs over
    ``[65, 65, 1, 8]``, for 16384 pairs over ``[64, 64, 1, 8]``, and in tiny-qwen-image's VAE decoder (cosine 0.41);
    the view's form exact at every size tried (up to 256 x 256 pairs over ``[128, 128, 32]``). The same elements."""
    graph = model.graph
    done = 0
    for node in [n for n in graph if n.op_type == "GatherND" and n.domain in ("", "ai.onnx")]:
        data, idx, y = node.inputs[0], node.inputs[1], node.outputs[0]
        shape, ishape, out = static_shape(data), static_shape(idx), static_shape(y)
        if (data is None or idx is None or shape is None or ishape is None or out is None or not ishape
                or int(attr(node, "batch_dims", 0)) != 0):
            continue
        k = ishape[-1]
        if len(shape) - k < 2:
            continue
        b = Builder(graph, RULE)
        flat = [*shape[:k], int(np.prod(shape[k:]))]
        view = b.op("Reshape", [data, b.const(np.asarray(flat, np.int64), "slices_flat")], dtype=data.dtype,
                    shape=flat).outputs[0]
        gathered = b.op("GatherND", [view, idx], dtype=data.dtype, shape=[*ishape[:-1], flat[-1]]).outputs[0]
        back = b.op("Reshape", [gathered, b.const(np.asarray(out, np.int64), "slices_back")], dtype=y.dtype,
                    shape=out)
        take_place(graph, node, _named(graph, b, f"{node.name}_flat"), back.outputs[0])
        done += 1
    return PassResult(modified=bool(done), counts={"GatherND slices viewed flat": done})


def lower_refused_einsums(model: ir.Model, target: StandardTarget) -> PassResult:
    """An Einsum the table refuses (QNN has no form for an outer product, ``i,j->ij``: Flux.1's rotary in its
    TorchScript export, ``torch.outer(pos, omega)``) written as the Transposes, Reshapes and MatMul it is
    (``sdnpu.passes.canonical.movement.einsum_as_ops``, AMD's canonical step; an outer product is a MatMul over a
    summed axis of size 1, each product exact). Einsums QNN takes stay as they are."""
    done = 0
    for node in [n for n in model.graph if n.op_type == "Einsum" and n.domain in ("", "ai.onnx")]:
        if _refused(target, node) and einsum_as_ops(node, outer_as_mul=False):
            done += 1
    return PassResult(modified=bool(done), counts={"refused Einsums -> MatMul": done})
