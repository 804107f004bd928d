"""Canonicalize: one form whatever the exporter wrote, so that the rules see a single spelling.

- opset raised to 20 where lower: the ops SD graphs use keep their meaning from 17 to 20 (opset 19 only
  added types and the Resize/Pad modes we do not use; 20 added Gelu, which our reference bodies need);
- Constant nodes become initializers; small constant subgraphs are folded (onnxscript's folder, with its
  size limits, so no large weight is ever materialized here); Identity nodes go;
- shapes and types inferred for every value (the TorchScript exporter writes none for intermediates);
- Squeeze/Unsqueeze/Flatten with static shapes become Reshape (the layout pass reasons about Reshape only).
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
import onnxscript.optimizer

from sdnpu.passes.irutil import Builder, remove_dead_nodes, replace, static_shape
from sdnpu.passes.manager import PassResult

log = logging.getLogger(__name__)

TARGET_OPSET = 20
RULE = "Canonicalize"


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


def canonicalize(model: ir.Model) -> PassResult:
    counts: Counter[str] = Counter()
    opset = model.opset_imports.get("", 0)
    if opset < TARGET_OPSET:
        model.opset_imports[""] = TARGET_OPSET
        model.graph.opset_imports[""] = TARGET_OPSET
        counts[f"opset {opset} -> {TARGET_OPSET}"] = 1
    n_before = len(model.graph)
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    # TorchScript graphs carry no shapes for intermediates; the folder needs them to fold shape
    # arithmetic, and every rule needs static shapes.
    common.ShapeInferencePass(strict_mode=False)(model)
    onnxscript.optimizer.fold_constants(model)
    common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model)
    common.IdentityEliminationPass()(model)
    common.NameFixPass()(model)  # every node named: CPU reasons and regions refer to nodes by name
    common.ShapeInferencePass(strict_mode=False)(model)
    counts["squeeze/unsqueeze/flatten -> reshape"] = _to_reshape(model.graph)
    remove_dead_nodes(model.graph)
    common.RemoveUnusedNodesPass()(model)
    counts["nodes removed"] = max(0, n_before - len(model.graph))
    return PassResult(modified=bool(sum(counts.values())), counts=dict(counts))
