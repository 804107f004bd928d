"""fp16 headroom: how close each tensor of a float32 graph comes to fp16's largest value (65504) on the check's
inputs, for a target that computes in fp16 (Qualcomm's HTP v73+).

``magnitudes`` runs the graph once in onnxruntime's CPU provider with every float tensor's largest and
smallest value added as graph outputs (ReduceMax and ReduceMin over all axes: two scalars a tensor, no
full-size temporary, so it runs wherever the graph runs); ``near_limit`` keeps the tensors within
``FACTOR`` of the limit, largest first. The report lists them with the guard that covers each one
(``sdnpu.passes.htp``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

FP16_MAX = 65504.0
FACTOR = 4.0  # a tensor within 4x of fp16's largest value is listed: fp16's headroom is that thin there
_PREFIX = "sdnpu_absmax__"


def magnitudes(path: Path, feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """Tensor name -> its largest magnitude when ``path`` runs on ``feeds`` (fp32, onnxruntime's CPU provider).
    Only float32 and float16 tensors that a node writes are measured (the weights are the compiler's, not the
    activations')."""
    return measure(path, feeds)[0]


def measure(path: Path, feeds: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """``magnitudes`` and the graph's own outputs, from the one run (a full-size graph's fp32 run is minutes and
    gigabytes: SD 3.5's transformer at 1024 px holds 3.5 GB of attention scores a layer)."""
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    infos = {vi.name: vi for vi in [*graph.value_info, *graph.output]}
    if len(infos) < sum(len(n.output) for n in graph.node):
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
        infos = {vi.name: vi for vi in [*inferred.graph.value_info, *inferred.graph.output]}
    floats = (TensorProto.FLOAT, TensorProto.FLOAT16)
    n_own = len(graph.output)
    names: dict[str, str] = {}
    nodes = []
    for node in list(graph.node):
        nodes.append(node)
        for out in node.output:
            vi = infos.get(out)
            if not out or vi is None or vi.type.tensor_type.elem_type not in floats:
                continue
            key = f"{_PREFIX}{len(names)}"
            names[key] = out
            for op in ("ReduceMax", "ReduceMin"):
                nodes.append(helper.make_node(op, [out], [f"{key}_{op}"], name=f"{key}_{op}", keepdims=0))
                graph.output.append(helper.make_tensor_value_info(f"{key}_{op}", vi.type.tensor_type.elem_type, []))
    # each reduction right after the node that writes its tensor, and onnxruntime told to keep this order: in its
    # default order the reductions ran late and kept the activations alive until then (sd-turbo's UNet at 512 px:
    # 11.8 GB against 4.3 GB for its plain fp32 run, 4.4 GB so; SDXL's at 1024 px was killed at 24 GB)
    del graph.node[:]
    graph.node.extend(nodes)
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    with tempfile.NamedTemporaryFile(suffix=".onnx", dir=path.parent, delete=True) as tmp:
        onnx.save(model, tmp.name)  # beside the graph: its external data is found by the same relative name
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        so.execution_order = ort.ExecutionOrder.PRIORITY_BASED  # the nodes' order, reductions next to their tensors
        sess = ort.InferenceSession(tmp.name, so, providers=["CPUExecutionProvider"])
        own = [o.name for o in graph.output[:n_own]]
        wanted = [*own, *(f"{k}_{op}" for k in names for op in ("ReduceMax", "ReduceMin"))]
        inputs = {i.name for i in sess.get_inputs()}
        values = dict(zip(wanted, sess.run(wanted, {k: v for k, v in feeds.items() if k in inputs}), strict=True))
    out = {}
    for key, name in names.items():
        hi, lo = float(values[f"{key}_ReduceMax"]), float(values[f"{key}_ReduceMin"])
        out[name] = max(abs(hi), abs(lo))
    return out, {k: values[k] for k in own}


def near_limit(mags: dict[str, float], limit: float = FP16_MAX, factor: float = FACTOR) -> list[dict[str, Any]]:
    """The tensors whose largest magnitude is within ``factor`` of ``limit`` (or past it), largest first."""
    near = [(n, m) for n, m in mags.items() if not np.isfinite(m) or m * factor >= limit]
    near.sort(key=lambda kv: -kv[1] if np.isfinite(kv[1]) else -np.inf)
    return [{"tensor": n, "max_abs": m, "of_fp16_max": m / limit} for n, m in near]
