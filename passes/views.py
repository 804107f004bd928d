"""Views: a Reshape in front of a dispatch op only re-views contiguous memory, so the op absorbs it. Its
attribute (``input_shape``, ``a_shape``, ...) already names the shape it reads the input as, and its
reference body reshapes the input to that view; the Reshape node goes. This is how the [B, H, W, C] output of
a GroupNorm reaches a Gemm that reads it as [B, H*W, C] without a node between them, on the NPU as in ONNX.

Only inputs the op reads through a view attribute absorb one (activations; never a weight). A Reshape that a
CPU node or a graph output also reads stays for them (a CPU node, with its reason). Each absorbed view is
recorded on the reading op (node metadata ``sdnpu.views``: ``input:tensor shape>view``) for the report, as
are the views a rule builds in (a [B, K] input read as [B, 1, K]).
"""

from __future__ import annotations

from collections import Counter

import onnx_ir as ir

from sdnpu.ops.target import DispatchTarget
from sdnpu.passes.irutil import record_views, remove_dead_nodes, static_shape
from sdnpu.passes.manager import PassResult


def _view_inputs(target: DispatchTarget, node: ir.Node) -> dict[int, list[int]]:
    spec = target.base_spec(node.op_type)
    attrs = {k: a.value for k, a in node.attributes.items()}
    return spec.input_views(attrs)


def absorb_views(model: ir.Model, target: DispatchTarget) -> PassResult:
    graph = model.graph
    counts: Counter[str] = Counter()
    for node in list(graph):
        if node.graph is None or not target.is_dispatch(node.domain, node.op_type):
            continue
        views = _view_inputs(target, node)
        for i, view in views.items():
            absorbed = False
            for _ in range(8):  # a chain of Reshapes is a chain of views
                v = node.inputs[i]
                p = v.producer() if v is not None else None
                if p is None or p.op_type != "Reshape" or p.domain not in ("", "ai.onnx"):
                    break
                src = p.inputs[0]
                if src is None or static_shape(src) is None:
                    break
                node.replace_input_with(i, src)
                absorbed = True
            if absorbed:
                counts[f"views absorbed by {node.op_type}"] += 1
        record_views(node, target)
    counts["nodes left dead"] = remove_dead_nodes(graph)
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
