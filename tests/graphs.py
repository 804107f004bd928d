"""Tiny ONNX graphs for the rule and pass tests, and the onnxruntime comparison they share."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto as T
from onnx import helper

OPSET = 20


def model(nodes: list[onnx.NodeProto], inputs: dict[str, list[int]], outputs: dict[str, list[int] | None],
          inits: dict[str, np.ndarray] | None = None, dtype: int = T.FLOAT, opset: int = OPSET) -> onnx.ModelProto:
    """A model from nodes (inputs and outputs of ``dtype``); shapes are inferred so every value has a static
    shape, as exports have."""
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, dtype, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, dtype, s) for n, s in outputs.items()],
        [onnx.numpy_helper.from_array(np.asarray(a), n) for n, a in (inits or {}).items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
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
    """Seeded normal inputs in each input's float type (float32 unless it is float16)."""
    rng = np.random.default_rng(seed)
    out = {}
    for vi in m.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        dtype = np.float16 if vi.type.tensor_type.elem_type == T.FLOAT16 else np.float32
        out[vi.name] = rng.standard_normal(shape).astype(dtype)
    return out


def run(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """onnxruntime CPU with its own graph optimizations off (they would hide our mistakes)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3  # not its warning for each constant a rewrite left unread
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def with_functions(m: ir.Model, target: object = None) -> onnx.ModelProto:
    """Serialize an intermediate model (after fuse/layout) with the reference bodies it needs."""
    from sdnpu.ops.target import get_target
    from sdnpu.passes.cleanup import attach_functions

    attach_functions(m, target or get_target())  # type: ignore[arg-type]
    return to_proto(m)


def rewritten(m: onnx.ModelProto, *steps: Callable[[ir.Model], object], feeds: dict[str, np.ndarray] | None = None,
              ulps: float = 0.0) -> tuple[ir.Model, Counter[str]]:
    """``m`` through ``steps`` (passes: a canonical step, a ``NodeRewrite``), checked: the result passes onnx's
    full check and onnxruntime (CPU, its optimizations off) computes ``m``'s outputs on ``feeds`` (default:
    seeded normal inputs), bit for bit, or where a rewrite changes the order of float operations within
    ``ulps`` units of the output type's rounding at the output's scale (``ulps * eps * max |output|``).
    Returns the model and the steps' counts."""
    irm = to_ir(m)
    counts: Counter[str] = Counter()
    for step in steps:
        counts.update(step(irm).counts)  # type: ignore[attr-defined]
    out = to_proto(irm)
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds if feeds is not None else feeds_for(m)
    for want, got in zip(run(m, feeds), run(out, feeds), strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
        if ulps:
            bound = ulps * float(np.finfo(want.dtype).eps) * float(np.abs(want).max())
            err = float(np.abs(got.astype(np.float64) - want.astype(np.float64)).max())
            assert err <= bound, f"max |difference| {err:.3g} over {bound:.3g} ({ulps} ulps at the output's scale)"
        else:
            np.testing.assert_array_equal(got, want)
    return irm, counts
