"""What bf16 rounding alone does to a graph: the graph with its weights, its inputs and every node's float
output rounded to bf16 (``rounded``), run against the fp32 graph on the same inputs. The compile's fidelity
check sets a dispatch model's error beside it where the dispatch model loses more than bf16 usually loses:
within a few times that error, the graph is sensitive to bf16 itself (no rewrite is to blame: bf16 is what the
NPU computes in); far past it, a rewrite broke the numbers. ``departures`` names where bf16's error grows: the
first nodes whose outputs, rounded op by op, leave the fp32 run's.

A sinusoid's argument (the timestep times its frequencies, read by Sin or Cos) is the one value a bf16 run
keeps in fp32: PyTorch's ``get_timestep_embedding`` computes it and its Sin / Cos in float32 and casts after,
and sdnpu's compile keeps it on the CPU in fp32 (Sin and Cos have no dispatch op). ``rounded`` keeps it so too
(``fp32_arguments``): rounded to bf16, t = 500 times a frequency near 1 is off by up to 1 rad, which no bf16 run
of the module computes (Kandinsky 3's UNet, whose rounding departed first at that Cos).

Measured on the zoo (``bench/bench_zoo.py``, bench/results.md): every member's dispatch model keeps 0.12x-1.24x
the max abs error and 0.01x-1.00x the 1 - cosine of its graph rounded op by op.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper

FLOAT_TYPES = (T.FLOAT, T.FLOAT16)
# float inputs that choose the function rather than feed it (Resize's roi and scales: the output shape; Pow's
# exponent): never rounded
_SELECTING = {"Resize": (1, 2), "Pow": (1,)}


def round_bf16(a: np.ndarray) -> np.ndarray:
    """``a`` rounded to bf16 and back to its own float type (other types as they are)."""
    return a.astype(ml_dtypes.bfloat16).astype(a.dtype) if a.dtype in (np.float32, np.float16) else a


def rounded_feeds(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` as ``rounded(model)`` takes them: rounded to bf16 but the inputs a bf16 run keeps in fp32 (the
    timestep a sinusoid reads: ``fp32_arguments``)."""
    keep = fp32_arguments(model)
    return {k: v if k in keep else round_bf16(v) for k, v in feeds.items()}


def _elem(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def selectors(model: onnx.ModelProto) -> set[str]:
    """Float values that select rather than compute (``_SELECTING``): never rounded or perturbed."""
    return {n.input[i] for n in model.graph.node for i in _SELECTING.get(n.op_type, ()) if i < len(n.input)}


# the arithmetic that computes a sinusoid's argument from the timestep, the moves that shape it and the shape
# arithmetic they read (TorchScript expands the timestep to the batch through Where / Equal / ConstantOfShape)
_ARGUMENT_OPS = frozenset({"Mul", "Add", "Sub", "Div", "Neg", "Cast", "Unsqueeze", "Reshape", "Expand", "Squeeze",
                           "Concat", "Slice", "Gather", "Constant", "Exp", "Range", "Shape", "ConstantOfShape",
                           "Where", "Equal", "Less", "Greater", "Not", "And", "Or"})


def fp32_arguments(model: onnx.ModelProto) -> set[str]:
    """The values a bf16 run computes in fp32: what Sin and Cos read where it is computed from the graph's inputs
    and constants alone by ``_ARGUMENT_OPS`` (the timestep's sinusoid, not an activation's), with the chain before
    it: its nodes' outputs, the inputs (the pipeline hands the timestep over in float32) and the constants (the
    frequencies) it starts from (module docstring)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    leaves = {i.name for i in model.graph.input} | {t.name for t in model.graph.initializer}
    from_inputs = set(leaves)  # computed from the inputs and constants alone, in the graph's (topological) order
    for node in model.graph.node:
        if node.op_type in _ARGUMENT_OPS and all(i in from_inputs for i in node.input if i):
            from_inputs.update(o for o in node.output if o)
    keep: set[str] = set()
    todo = [n.input[0] for n in model.graph.node
            if n.op_type in ("Sin", "Cos") and n.input and n.input[0] in from_inputs]
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep.add(name)
        node = producer.get(name)
        if node is not None:
            todo.extend(i for i in node.input if i)
    return keep


def float_outputs(model: onnx.ModelProto) -> dict[str, tuple[int, list[int]]]:
    """Every node output's float type and shape (from shape inference; the graphs have static shapes)."""
    g = onnx.shape_inference.infer_shapes(model).graph
    return {vi.name: (_elem(vi), [d.dim_value for d in vi.type.tensor_type.shape.dim])
            for vi in [*g.value_info, *g.output] if _elem(vi) in FLOAT_TYPES}


def rounded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (not changed) with its float weights and every float node output rounded to bf16 (a Cast there
    and back after each) but the sinusoids' arguments (``fp32_arguments``), under the same value names: what bf16
    rounding does to this graph's result. Feed it ``rounded_feeds``."""
    m = copy.deepcopy(model)
    fp32 = fp32_arguments(m)
    keep = selectors(m) | fp32
    for i, t in enumerate(m.graph.initializer):
        if t.data_type in FLOAT_TYPES and t.name not in keep:
            m.graph.initializer[i].CopyFrom(onnx.numpy_helper.from_array(
                round_bf16(onnx.numpy_helper.to_array(t)), t.name))
    for node in m.graph.node:
        if node.op_type == "Constant" and set(node.output) & fp32:
            continue
        for a in node.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type in FLOAT_TYPES:
                a.t.CopyFrom(onnx.numpy_helper.from_array(round_bf16(onnx.numpy_helper.to_array(a.t)), a.t.name))
    return after_each_output(m, lambda exact, name, elem, _: [
        helper.make_node("Cast", [exact], [f"{name}__bf16"], to=T.BFLOAT16),
        helper.make_node("Cast", [f"{name}__bf16"], [name], to=elem)], keep=fp32)


def after_each_output(model: onnx.ModelProto, wrap: Callable[[str, str, int, list[int]], list[onnx.NodeProto]],
                      keep: set[str] | frozenset[str] = frozenset()) -> onnx.ModelProto:
    """``model`` (changed in place) with ``wrap(exact, name, type, shape)`` nodes after every float node output
    ``name``: the node now writes ``exact``, the inserted nodes write ``name``, so the readers see the changed
    value (rounded, perturbed). Values that select rather than compute (``selectors``) and those in ``keep`` are
    left alone."""
    floats = float_outputs(model)
    for name in selectors(model) | set(keep):
        floats.pop(name, None)
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        after = []
        for i, name in enumerate(node.output):
            if name and name in floats:
                node.output[i] = f"{name}__exact"
                after += wrap(f"{name}__exact", name, *floats[name])
        nodes += [node, *after]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.value_info[:]
    return model


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    ok = np.isfinite(a64) & np.isfinite(b64)
    a64, b64 = a64[ok], b64[ok]
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(a64 @ b64 / na / nb)


def _session(model: onnx.ModelProto) -> Any:
    import onnxruntime as ort  # with the run: the reports are read without onnxruntime

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # the graph's own ops, as written
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def measure(model: onnx.ModelProto, feeds: dict[str, np.ndarray], reference: dict[str, np.ndarray],
            threshold: float = 0.999, most: int = 3) -> dict[str, Any]:
    """The graph rounded to bf16 op by op (``rounded``) on ``feeds`` against ``reference`` (the fp32 graph's
    outputs): its min cosine and max abs error over the outputs, and ``departures``: the first nodes (in the
    graph's order, at most ``most``) whose output's cosine against the fp32 run falls below ``threshold``, each
    with its op type and cosine. ``model`` is the fp32 graph, weights loaded."""
    floats = float_outputs(model)
    ends = {o.name for o in model.graph.output}
    names = [o for n in model.graph.node for o in n.output if o in floats and o not in ends]
    probe = copy.deepcopy(model)
    # typed, shapes left to onnxruntime: an inferred shape it disagrees with would refuse the session
    probe.graph.output.extend(helper.make_tensor_value_info(n, floats[n][0], None) for n in names)
    exact = dict(zip([o.name for o in probe.graph.output],
                     _session(probe).run(None, feeds), strict=True))
    low = rounded(probe)
    got = dict(zip([o.name for o in low.graph.output], _session(low).run(None, rounded_feeds(probe, feeds)),
                   strict=True))
    outs = [k for k in reference if k in got]
    cos = min((_cosine(reference[k], got[k]) for k in outs), default=1.0)
    max_abs = max((float(np.nanmax(np.abs(reference[k].astype(np.float64) - got[k]))) for k in outs if got[k].size),
                  default=0.0)
    producer = {o: n for n in model.graph.node for o in n.output}
    departures = []
    for name in [o for n in model.graph.node for o in n.output if o in floats]:  # in the graph's order
        if exact[name].size and _cosine(exact[name], got[name]) < threshold:
            node = producer[name]
            departures.append({"node": node.name or name, "op_type": node.op_type,
                               "cosine": round(_cosine(exact[name], got[name]), 6)})
            if len(departures) == most:
                break
    return {"min_cosine": cos, "max_abs": max_abs, "departures": departures}
