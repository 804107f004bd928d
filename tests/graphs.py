"""Tiny ONNX graphs for the rule and pass tests, and the onnxruntime comparison they share."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper

OPSET = 20


def model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], outputs: dict[str, list[int] | None],
          inits: dict[str, np.ndarray] | None = None) -> onnx.ModelProto:
    """A model from nodes; shapes are inferred so every value has a static shape, as exports have."""
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, T.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, T.FLOAT, s) for n, s in outputs.items()],
        [onnx.numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m = onnx.shape_inference.infer_shapes(m, strict_mode=True, data_prop=True)
    onnx.checker.check_model(m, full_check=True)
    return m


def to_ir(m: onnx.ModelProto) -> ir.Model:
    return ir.serde.deserialize_model(m)


def to_proto(m: ir.Model) -> onnx.ModelProto:
    return ir.serde.serialize_model(m)


def ops(m: ir.Model | onnx.ModelProto) -> Counter[str]:
    nodes = m.graph.node if isinstance(m, onnx.ModelProto) else m.graph
    return Counter(n.op_type for n in nodes)


def feeds_for(m: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for vi in m.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        out[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return out


def run(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime CPU with its own graph optimizations off (they would hide our mistakes)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def with_functions(m: ir.Model, target: object = None) -> onnx.ModelProto:
    """Serialize an intermediate model (after fuse/layout) with the reference bodies it needs."""
    from sdnpu.ops.target import get_target
    from sdnpu.passes.cleanup import attach_functions

    attach_functions(m, target or get_target())  # type: ignore[arg-type]
    return to_proto(m)
