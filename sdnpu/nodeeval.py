"""One ONNX node run on numpy arrays, as a model of its own: ONNX's reference evaluator, or onnxruntime where the
evaluator lacks or limits an op. The passes fold constants and read what a run of nodes computes with it
(``passes/canonical``: ``constants.fold_small``, ``tables``, ``rotary``); ``formats/weights.py`` replays a folded
constant's node on its weights with it. The graph's own arithmetic runs as written: numpy's warnings are off
(T5's position buckets take Log(0) = -inf in a branch a Where drops).

onnxruntime is imported where it runs (``run_node_ort``): the formats and the CLI's start stay free of it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

__all__ = ["node_model", "run_node", "run_node_ort"]

OPSET = 20  # the opset the passes write (passes/canonical/constants.py TARGET_OPSET)


def node_model(node: onnx.NodeProto, arrays: Sequence[np.ndarray | None], opset: int = OPSET,
               elem_types: Sequence[int] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """``node`` (a copy) as a model whose inputs are ``arrays`` (None: an absent optional input) and whose
    outputs are the node's, with the feeds that run it. The inputs take the arrays' types, or ``elem_types``
    (an array's numpy type that ONNX does not name: a string tensor); the outputs are untyped."""
    one = onnx.NodeProto()
    one.CopyFrom(node)
    names = ["" if a is None else f"in{i}" for i, a in enumerate(arrays)]
    del one.input[:]
    one.input.extend(names)
    del one.output[:]
    one.output.extend(f"out{i}" for i in range(len(node.output)))
    feeds = {n: np.asarray(a) for n, a in zip(names, arrays, strict=True) if a is not None}
    types = [elem_types[i] if elem_types is not None else helper.np_dtype_to_tensor_dtype(np.asarray(a).dtype)
             for i, a in enumerate(arrays) if a is not None]
    graph = helper.make_graph([one], "node", [helper.make_tensor_value_info(n, t, np.shape(a))
                                              for (n, a), t in zip(feeds.items(), types, strict=True)],
                              [helper.make_tensor_value_info(o, 0, None) for o in one.output])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), feeds


def run_node(node: onnx.NodeProto, arrays: Sequence[np.ndarray | None], opset: int = OPSET,
             elem_types: Sequence[int] | None = None) -> list[np.ndarray]:
    """``node`` run by ONNX's reference evaluator on ``arrays`` in place of its inputs (None: absent); one
    array per output. Raises where the evaluator cannot run it."""
    model, feeds = node_model(node, arrays, opset, elem_types)
    with np.errstate(all="ignore"):
        return [np.asarray(o) for o in ReferenceEvaluator(model).run(None, feeds)]


def run_node_ort(node: onnx.NodeProto, arrays: Sequence[np.ndarray | None], out_types: Sequence[int],
                 opset: int = OPSET, elem_types: Sequence[int] | None = None) -> list[np.ndarray] | None:
    """``node`` run by onnxruntime's CPU provider, its optimizations off (an op the reference evaluator lacks,
    or limits: its GatherElements takes at most 64 rows); onnxruntime needs the outputs' types, ``out_types``.
    None where it refuses the node."""
    import onnxruntime as ort  # where it runs: the formats and the CLI's start stay free of it

    model, feeds = node_model(node, arrays, opset, elem_types)
    for vi, t in zip(model.graph.output, out_types, strict=True):
        vi.type.tensor_type.elem_type = t
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    try:
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        return list(session.run(None, feeds))
    except Exception:  # noqa: BLE001 - a node onnxruntime refuses is the caller's to leave as it is
        return None
