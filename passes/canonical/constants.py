"""Constants and opset: the canonical steps that work on the whole model, and the crops of constants.

- ``raise_opset``: the model at opset 20 (``TARGET_OPSET``; the reference bodies need 20's Gelu, and a model's
  functions must import the opset its graph does), each op rewritten where its form changed (onnx's version
  converter); then the start of the canonical form noted for ``finish`` (the graph outputs' names, the node
  count, in the graph's ``meta``, which is never saved);
- ``lift_constants``: Constant nodes become initializers, each input constant recorded as itself
  (``sdnpu.passes.provenance``);
- ``infer_shapes``: shapes and types for every value (the TorchScript exporter writes none for
  intermediates; the folders and every rule need static shapes);
- ``fold_constants``: small constant subgraphs folded by onnxscript's folder, with its size limits, so no
  large weight is ever materialized here; ``fold_small``: what that folder leaves on purpose
  (ConstantOfShape, Shape of a static value, ...), evaluated node by node with ONNX's reference evaluator
  (onnxruntime where it cannot), in rounds (``sdnpu.passes.pipeline`` declares them: one fold can make the
  next node's inputs constant, or its shapes known);
- ``name_nodes``: every node and value named (CPU reasons and regions refer to nodes by name);
- ``crop_constants``: a Reshape or Slice of a constant, however large, becomes a constant derived from it
  (SD3's position-embedding table cropped to the image), in rounds (declared in the pipeline) until a round
  crops nothing;
- ``finish``: the crops' sources recorded for the size specializer, the unused nodes and initializers
  removed, the graph outputs' names kept;
- ``bind_input_shapes``: static shapes for graph inputs with dynamic axes (not a step: the compile stage
  calls it before the passes).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnx.version_converter
import onnx_ir as ir
import onnxscript.optimizer
import onnxscript.version_converter
from onnx_ir.passes import common

from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import SIZED_CONSTANTS_KEY
from sdnpu.nodeeval import run_node, run_node_ort
from sdnpu.passes import provenance
from sdnpu.passes.canonical.driver import RULE, graph_of, node_rewrite
from sdnpu.passes.irutil import Builder, const, remove_dead_nodes, static_shape
from sdnpu.passes.manager import PassResult

log = logging.getLogger(__name__)

TARGET_OPSET = 20
_FOLD_LIMIT = 1 << 16  # elements: only shape-sized arithmetic is folded here, never a weight
_NEVER_FOLD = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                         "Bernoulli"})
# the graph's meta (never saved): what ``raise_opset`` notes for ``finish``, and the crops' sources
_OUTPUTS, _NODES, _CROPPED = "sdnpu.canonical.outputs", "sdnpu.canonical.nodes", "sdnpu.canonical.cropped"


def raise_opset(model: ir.Model) -> PassResult:
    """The model at ``TARGET_OPSET`` where it is lower; then the start of the canonical form noted for
    ``finish`` (its graph may be a new one now: the converter's)."""
    counts: dict[str, int] = {}
    opset = model.opset_imports.get("", 0)
    if opset < TARGET_OPSET:
        _raise_opset(model, opset)
        counts[f"opset {opset} -> {TARGET_OPSET}"] = 1
    graph = model.graph
    graph.meta[_OUTPUTS] = [v.name for v in graph.outputs]
    graph.meta[_NODES] = len(graph)
    graph.meta[_CROPPED] = []
    return PassResult(modified=bool(counts), counts=counts)


def _raise_opset(model: ir.Model, opset: int) -> None:
    """The model at opset 20 (``TARGET_OPSET``), its ops rewritten where their form changed (ReduceMean's axes
    became an input at 18, Scatter became ScatterElements at 11, ...). onnx's converter covers every opset; it
    works on a protobuf, so a model whose weights lie in external data (a full-size export: opset 17 or newer)
    goes through onnxscript's, which covers those. What a converter adds is made from attributes, never from
    a weight: its new constants are literals."""
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


def _lift(model: ir.Model) -> int:
    return int(common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0)(model).modified)


def lift_constants(model: ir.Model) -> PassResult:
    """Constant nodes become initializers; the input's constants, and then its Constant nodes' values (now
    initializers of the same name), are recorded as themselves."""
    provenance.mark_inputs(model.graph)
    lifted = _lift(model)
    provenance.mark_inputs(model.graph)
    return PassResult(modified=bool(lifted), counts={"Constant nodes -> initializers": lifted})


def infer_shapes(model: ir.Model) -> PassResult:
    """onnx's shape inference (not strict: what it cannot infer stays unknown). Shape annotations alone do not
    count as a change."""
    common.ShapeInferencePass(strict_mode=False)(model)
    return PassResult(modified=False)


def fold_constants(model: ir.Model) -> PassResult:
    """onnxscript's constant folder (its size limits: no weight is materialized), the Constant nodes it makes
    lifted, each folded initializer given the expression that computed it (``provenance.constant_subgraph``,
    read before the folder runs) and a folded value its tensor's shape."""
    graph = model.graph
    foldable = provenance.constant_subgraph(graph)
    folded = 0
    with np.errstate(all="ignore"):  # the graph's own arithmetic (T5's Log(0) = -inf in a branch Where drops)
        try:
            folded = int(onnxscript.optimizer.fold_constants(model).modified)
        except Exception as e:  # an op its folder cannot evaluate (ONNX's SplitToSequence test): ours go on
            log.warning("onnxscript's constant folder stopped (%s: %s); folding with sdnpu's own only",
                        type(e).__name__, str(e)[:200])
    lifted = _lift(model)
    provenance.mark_folded(graph, foldable)
    _sync_constant_shapes(graph)
    return PassResult(modified=bool(folded or lifted),
                      counts={"constant subgraphs folded": folded, "Constant nodes -> initializers": lifted})


def _sync_constant_shapes(graph: ir.Graph) -> None:
    """A value that folding made constant keeps the shape the exporter declared for it, in terms of the
    dynamic axes (optimum's position ids: [batch_size, sequence_length, D]) and shape inference does not
    revisit initializers: give it its tensor's shape, or everything downstream stays symbolic."""
    for value in graph.initializers.values():
        if value.const_value is not None and (value.shape is None or not value.shape.is_static()):
            value.shape = ir.Shape(value.const_value.shape)


def fold_small(model: ir.Model) -> PassResult:
    """Evaluate small nodes whose inputs are all constant (and Shape of a static value) with ONNX's
    reference evaluator. onnxscript's folder leaves some on purpose (ConstantOfShape, to protect memory in
    general); the TorchScript exporter's padding arithmetic is made of them. A function of the whole graph:
    each node is evaluated as a model of its own, then the dead nodes go."""
    graph = model.graph
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
            proto = ir.serde.serialize_node(node)
            arrays = [v.const_value.numpy() if v is not None else None for v in node.inputs]  # type: ignore[union-attr]
            types = [_elem(v) for v in node.inputs]
            try:  # the graph's own arithmetic, warnings off (T5's Log(0) = -inf in a branch Where drops)
                values = run_node(proto, arrays, TARGET_OPSET, types)
            except Exception:  # an op the reference evaluator lacks or limits (its GatherElements takes <= 64 rows)
                out_types = [_elem(o) for o in outs]
                found = None if 0 in out_types else run_node_ort(proto, arrays, out_types, TARGET_OPSET, types)
                if found is None:  # onnxruntime cannot either: leave it to the rules
                    continue
                values = found
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
    return PassResult(modified=bool(folded), counts={"small constants folded": folded})


def _elem(v: ir.Value | None) -> int:
    """``v``'s ONNX element type (0: absent or unknown)."""
    if v is None or v.type is None:
        return 0
    return ir.serde.serialize_type(v.type).tensor_type.elem_type  # type: ignore[arg-type]


def name_nodes(model: ir.Model) -> PassResult:
    """Every node and value named: CPU reasons and regions refer to nodes by name."""
    named = int(common.NameFixPass()(model).modified)
    return PassResult(modified=bool(named), counts={"nodes and values named": named})


@node_rewrite("crops of constants folded", "Reshape", "Slice")
def crop_constants(node: ir.Node) -> bool:
    """A Reshape or Slice (steps of one) of a constant, with constant parameters, becomes a constant derived
    from it (``Builder.derived``: made as the model is saved, its provenance kept), however large the source:
    SD3's position-embedding table [1, P*P, C] cropped to the image's [1, h*w, C] under static shapes. The
    small folder leaves it (it never folds a weight-sized tensor); the crop is smaller than its source. A
    Slice's source is noted in the graph's meta (``finish`` records them for the size specializer)."""
    graph = graph_of(node)
    x, out = node.inputs[0], node.outputs[0]
    shape, out_shape = static_shape(x), static_shape(out)
    if x is None or x.const_value is None or shape is None or out_shape is None or out.is_graph_output():
        return False
    if any(v is not None and v.const_value is None for v in node.inputs[1:]):
        return False
    if node.op_type == "Reshape":
        steps = [provenance.step("reshape", shape=list(out_shape))]
    else:
        starts, ends = const(node.inputs[1]), const(node.inputs[2])
        axes = const(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        steps_in = const(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
        if steps_in is not None and np.any(steps_in != 1):
            return False
        axes = axes if axes is not None else np.arange(starts.size)  # type: ignore[union-attr]
        steps = []
        for a, lo, hi in zip(axes.reshape(-1), starts.reshape(-1), ends.reshape(-1), strict=True):  # type: ignore[union-attr]
            a = int(a) % len(shape)
            n = shape[a]
            lo = min(max(int(lo) + n if lo < 0 else int(lo), 0), n)
            hi = min(max(int(hi) + n if hi < 0 else int(hi), 0), n)
            steps.append(provenance.step("slice", axis=a, start=lo, stop=hi))
        if len(steps) != len(axes.reshape(-1)):
            return False
    b = Builder(graph, RULE)
    folded = b.derived(x, steps, out_shape, f"{x.name}_crop")
    out.replace_all_uses_with(folded)
    if node.op_type == "Slice":
        expr = provenance.origin(x)
        while "x" in expr:
            expr = expr["x"]
        graph.meta.setdefault(_CROPPED, []).append(str(expr.get("init", x.name)))
    return True


def finish_canonical_form(model: ir.Model) -> PassResult:
    """The end of the canonical form: the constants cropped for this graph's size recorded in the model's
    metadata (``SIZED_CONSTANTS_KEY``: the size specializer cannot re-derive them from another size's dispatch
    model), the unused nodes and initializers removed, the graph outputs under the names they came with (a
    folded If hands its branch's output name up: a dispatch model's signature is its graph's). Its count,
    ``nodes removed``, is the canonical steps' in all (the node count ``raise_opset`` noted, minus now)."""
    graph = model.graph
    cropped = graph.meta.pop(_CROPPED, None) or []
    written = False
    if cropped:
        value = ",".join(sorted(set(cropped)))
        written = model.metadata_props.get(SIZED_CONSTANTS_KEY) != value
        model.metadata_props[SIZED_CONSTANTS_KEY] = value
    removed = common.RemoveUnusedNodesPass()(model).modified
    outputs = graph.meta.pop(_OUTPUTS, None)
    renamed = _keep_output_names(graph, outputs) if outputs is not None else 0
    before = graph.meta.pop(_NODES, len(graph))
    return PassResult(modified=written or removed or bool(renamed),
                      counts={"nodes removed": max(0, before - len(graph))})


def _keep_output_names(graph: ir.Graph, names: list[str | None]) -> int:
    """The graph outputs keep the names they came with; returns how many were renamed back."""
    renamed = 0
    for value, name in zip(graph.outputs, names, strict=True):
        if name is None or value.name == name:
            continue
        holder = next((v for n in graph for v in n.outputs if v.name == name and v is not value), None)
        holder = holder or next((v for v in graph.inputs if v.name == name), None)
        if holder is not None:
            holder.name = f"{name}_inner"
        value.name = name
        renamed += 1
    return renamed


def bind_input_shapes(model: ir.Model, shapes: dict[str, list[int]]) -> None:
    """Give graph inputs static shapes (an NPU needs them; optimum exports dynamic axes). Shape inference
    in the canonical steps then carries them through the graph."""

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
