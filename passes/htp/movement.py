"""Rank-6 pixel shuffles (DiT's unpatchify) as DepthToSpace: QNN has no rank-6 Reshape or Transpose. See
``sdnpu.passes.htp``."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from sdnpu.formats.keys import RULE_TAG
from sdnpu.passes.htp.common import RULE, constant, unique_name
from sdnpu.passes.manager import PassResult


# perm of [n, h, w, a, b, c] (a = b: the block) -> the DepthToSpace mode whose channel order it is
_SHUFFLES = {(0, 5, 1, 3, 2, 4): ("DCR", "hwabc"), (0, 3, 1, 4, 2, 5): ("CRD", "hwcab")}


def _permutation(node: ir.Node) -> tuple[int, ...] | None:
    if node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        return tuple(int(i) for i in perm.value) if perm is not None else None
    if node.op_type == "Einsum" and len(node.inputs) == 1:
        eq = str(node.attributes["equation"].value).replace(" ", "")
        src, _, dst = eq.partition("->")
        if "," in src or "." in src or sorted(src) != sorted(dst) or len(set(src)) != len(src):
            return None
        return tuple(src.index(c) for c in dst)
    return None


def lower_pixel_shuffles(model: ir.Model) -> PassResult:
    """Unpatchify spelled in rank 6 (DiT's ``einsum("nhwpqc->nchpwq")``, or the same permutation as a Transpose):
    QNN has no rank-6 Reshape or Transpose. A Reshape to ``[n, h, w, p, p, c]``, that permutation and a Reshape
    to ``[n, c, h*p, w*p]`` are ``DepthToSpace`` (DCR; CRD for the channel-first order ``[n, h, w, c, p, p]``)
    of the ``[n, p*p*c, h, w]`` view: a Reshape to ``[n, h, w, p*p*c]``, a Transpose, one DepthToSpace. The
    same values, moved the same way, in rank 4."""
    graph = model.graph
    done = 0
    for node in [n for n in graph if n.op_type in ("Transpose", "Einsum") and n.domain in ("", "ai.onnx")]:
        perm = _permutation(node)
        x, y = node.inputs[0], node.outputs[0]
        if perm is None or perm not in _SHUFFLES or x is None or x.shape is None or not x.shape.is_static():
            continue
        mode, _ = _SHUFFLES[perm]
        n, h, w, d3, d4, d5 = (int(d) for d in x.shape)
        block, c = (d3, d5) if mode == "DCR" else (d4, d3)
        if (d3, d4) != (block, block) and mode == "DCR" or mode == "CRD" and (d4, d5) != (block, block):
            continue
        src = x.producer()
        readers = [u.node for u in y.uses()]
        if (src is None or src.op_type != "Reshape" or len(x.uses()) != 1 or y.is_graph_output() or len(readers) != 1
                or readers[0].op_type != "Reshape"):
            continue
        after = readers[0].outputs[0]
        if after.shape is None or [int(d) for d in after.shape] != [n, c, h * block, w * block]:
            continue
        s_in = src.inputs[0]
        assert s_in is not None
        shape = constant(graph, np.asarray([n, h, w, block * block * c], np.int64), f"{node.name}_nhwc")
        nhwc = ir.node("Reshape", [s_in, shape], name=unique_name(graph, f"{node.name}_nhwc_view"))
        nchw = ir.node("Transpose", [nhwc.outputs[0]], attributes={"perm": [0, 3, 1, 2]},
                       name=unique_name(graph, f"{node.name}_nchw"))
        d2s = ir.node("DepthToSpace", [nchw.outputs[0]], attributes={"blocksize": block, "mode": mode},
                      name=unique_name(graph, f"{node.name}_depth_to_space"))
        for new, dims in ((nhwc, [n, h, w, block * block * c]), (nchw, [n, block * block * c, h, w]),
                          (d2s, [n, c, h * block, w * block])):
            new.metadata_props[RULE_TAG] = RULE
            new.outputs[0].name = new.name
            new.outputs[0].dtype, new.outputs[0].shape = after.dtype, ir.Shape(dims)
        graph.insert_before(readers[0], [nhwc, nchw, d2s])
        name = after.name
        after.replace_all_uses_with(d2s.outputs[0], replace_graph_outputs=True)
        graph.remove([readers[0], node, src], safe=True)
        d2s.outputs[0].name = name
        done += 1
    return PassResult(modified=bool(done), counts={"rank-6 pixel shuffles -> DepthToSpace": done})


def lower_rank6_movements(model: ir.Model) -> PassResult:
    """Any other rank-6 permutation between two Reshapes (patchify ``[n, c, h, p, w, q] -> [n, h, w, c, p, q]``,
    AuraFlow's, CogView4's, Lumina 2's and Z-Image's) as a few rank-4 ones: each step moves one axis to its
    place, the axes before it, between, and after merged into one each (``[A, B, x, D] -> [A, x, B, D]``), so no
    tensor of rank 6 is made; at most five steps, usually two. The same values, moved the same way."""
    graph = model.graph
    done = 0
    for node in [n for n in graph if n.op_type in ("Transpose", "Einsum") and n.domain in ("", "ai.onnx")]:
        perm = _permutation(node)
        x, y = node.inputs[0], node.outputs[0]
        if perm is None or len(perm) < 6 or x is None or x.shape is None or not x.shape.is_static():
            continue
        src = x.producer()
        readers = [u.node for u in y.uses()]
        if (src is None or src.op_type != "Reshape" or len(x.uses()) != 1 or y.is_graph_output() or not readers
                or any(r.op_type != "Reshape" for r in readers)):
            continue
        s_in = src.inputs[0]
        if s_in is None or s_in.shape is None or len(s_in.shape) > 5:
            continue
        dims = [int(d) for d in x.shape]
        value, cur = s_in, list(range(len(dims)))
        made: list[ir.Node] = []
        for k, want in enumerate(perm):
            i = cur.index(want)
            if i == k:
                continue
            groups = [cur[:k], cur[k:i], [cur[i]], cur[i + 1:]]
            view = [int(np.prod([dims[a] for a in g])) if g else 1 for g in groups]
            shape = constant(graph, np.asarray(view, np.int64), f"{node.name}_view{len(made)}")
            reshape = ir.node("Reshape", [value, shape], name=unique_name(graph, f"{node.name}_view{len(made)}"))
            move = ir.node("Transpose", [reshape.outputs[0]], attributes={"perm": [0, 2, 1, 3]},
                           name=unique_name(graph, f"{node.name}_move{len(made)}"))
            for new, out in ((reshape, view), (move, [view[0], view[2], view[1], view[3]])):
                new.metadata_props[RULE_TAG] = RULE
                new.outputs[0].name, new.outputs[0].dtype, new.outputs[0].shape = new.name, y.dtype, ir.Shape(out)
            made += [reshape, move]
            value = move.outputs[0]
            cur = groups[0] + groups[2] + groups[1] + groups[3]
        if not made:
            continue
        graph.insert_before(node, made)
        for reader in readers:  # each reads the moved values, reshaped as it asks
            reader.replace_input_with(0, value)
        graph.remove([node, src], safe=True)
        done += 1
    return PassResult(modified=bool(done), counts={"rank-6 permutations -> rank-4 steps": done})
