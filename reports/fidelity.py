"""Fidelity of a dispatch model against its fp32 graph: the numbers the report shows, and seeded inputs
for graphs whose caller has no better ones. Shared by the compiler (convert) and ``sdnpu verify`` (runtime)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
from onnx import numpy_helper
from onnx_ir.passes import common

from sdnpu import families
from sdnpu.formats import prologue


class CannotFeed(Exception):
    """A graph input whose values the check cannot make up (a shape, axes, a size): the reason."""


# (op type, input index) -> what that input of the op is, where it is not data: its values decide shapes
_SHAPE_INPUTS = {("Reshape", 1): "a shape", ("Expand", 1): "a shape", ("Tile", 1): "repeats",
                 ("ConstantOfShape", 0): "a shape", ("Slice", 1): "starts", ("Slice", 2): "ends",
                 ("Slice", 3): "axes", ("Slice", 4): "steps", ("Pad", 1): "pads", ("Pad", 3): "axes",
                 ("Range", 0): "a range bound", ("Range", 1): "a range bound", ("Range", 2): "a range step",
                 ("TopK", 1): "k", ("OneHot", 1): "a depth", ("Squeeze", 1): "axes", ("Unsqueeze", 1): "axes",
                 ("Split", 1): "split sizes", ("Resize", 1): "a region of interest", ("CenterCropPad", 1): "a shape",
                 ("Upsample", 1): "scales", ("Trilu", 1): "a diagonal", ("CumSum", 1): "an axis",
                 ("ReduceSum", 1): "axes", ("ReduceMean", 1): "axes", ("ReduceMax", 1): "axes",
                 ("ReduceMin", 1): "axes", ("ReduceProd", 1): "axes", ("ReduceL2", 1): "axes",
                 ("ReduceL1", 1): "axes", ("ReduceLogSumExp", 1): "axes", ("ReduceSumSquare", 1): "axes"}
_INDEX_INPUTS = {("Gather", 1), ("GatherElements", 1), ("GatherND", 1), ("ScatterND", 1), ("ScatterElements", 1)}


def _dims(vi: Any) -> list[int] | None:
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in vi.type.tensor_type.shape.dim]
    return dims if vi.type.tensor_type.HasField("shape") and all(d >= 0 for d in dims) else None


def _kinds(model: Any) -> dict[str, tuple[str, Any]]:
    """How the graph reads each of its inputs where that is not as data: ("index", bound) for the indices of
    a Gather (ids into a table of ``bound`` rows), ("scales", values) / ("sizes", values) for a Resize whose
    output shape is known, ("shape", what) for every other input that decides a shape."""
    shapes = {vi.name: _dims(vi) for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]}
    shapes.update({t.name: list(t.dims) for t in model.graph.initializer})
    kinds: dict[str, tuple[str, Any]] = {}
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if not name:
                continue
            if (node.op_type, i) in _INDEX_INPUTS:
                data = shapes.get(node.input[0])
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                bound = data[axis] if data and -len(data) <= axis < len(data) else None
                old = kinds.get(name, ("index", bound))
                if old[0] == "index":
                    kinds[name] = ("index", min(b for b in (old[1], bound) if b is not None)
                                   if old[1] is not None or bound is not None else None)
            elif node.op_type == "Resize" and i in (2, 3):
                x, y = shapes.get(node.input[0]), shapes.get(node.output[0])
                # with ``axes`` (opset 18), scales and sizes hold those axes only, in that order
                axes = next((list(a.ints) for a in node.attribute if a.name == "axes"), None)
                if x and y and len(x) == len(y) and all(x) and all(-len(x) <= a < len(x) for a in axes or []):
                    pick = [a % len(x) for a in axes] if axes else list(range(len(x)))
                    kinds[name] = (("scales", [y[a] / x[a] for a in pick]) if i == 2
                                   else ("sizes", [y[a] for a in pick]))
                else:
                    kinds[name] = ("shape", "a Resize's scales" if i == 2 else "a Resize's sizes")
            elif (node.op_type, i) in _SHAPE_INPUTS:
                kinds[name] = ("shape", f"{_SHAPE_INPUTS[node.op_type, i]} ({node.op_type} {node.name or ''})".strip())
    for node in reversed(model.graph.node):  # ids that reach a Gather through a view (UMT5's Reshape) are its ids
        if node.op_type in _VIEWS and node.input and node.output and kinds.get(node.output[0], ("",))[0] == "index":
            bound = kinds[node.output[0]][1]
            old = kinds.get(node.input[0])
            if old is None or old[0] == "index":
                known = [b for b in (bound, old[1] if old else None) if b is not None]
                kinds[node.input[0]] = ("index", min(known) if known else None)
    return kinds


_VIEWS = ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Cast", "Expand")  # values kept as they are


def _test_data(path: Path, names: list[str]) -> dict[str, np.ndarray] | None:
    """The inputs of an ONNX backend test beside the model (``test_data_set_0/input_N.pb``, in the order of
    the graph's inputs), when they are there: the values the model was written for."""
    folder = path.parent / "test_data_set_0"
    files = sorted(folder.glob("input_*.pb"), key=lambda f: int(f.stem.split("_")[1])) if folder.is_dir() else []
    if len(files) != len(names):
        return None

    feeds = {}
    for name, f in zip(names, files, strict=True):
        t = onnx.TensorProto()
        try:
            t.ParseFromString(f.read_bytes())
        except Exception:  # a sequence or optional input: not a tensor file
            return None
        feeds[name] = numpy_helper.to_array(t)
    return feeds


def generic_inputs(path: Path, seed: int = 0, shapes: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """Seeded inputs from a graph's signature when the caller has no better ones: Gaussian floats, a
    mid-schedule timestep (a UNet's scalar, SD3's per batch item), token ids below 1000 (valid for any CLIP or
    T5 vocabulary) or below the table they index, masks of ones, a ControlNet's control image in [0, 1] and
    scale 1; an ONNX backend test's own inputs where they lie beside the model. An input that decides a shape
    (Reshape's, Slice's, a Resize's scales where the output shape is not known, ...) has no seeded value:
    ``CannotFeed`` says which."""
    model = onnx.load(str(path), load_external_data=False)
    inits = {i.name for i in model.graph.initializer}
    graph_inputs = [vi for vi in model.graph.input if vi.name not in inits]
    if not shapes:
        given = _test_data(path, [vi.name for vi in graph_inputs])
        if given is not None:
            return given
    kinds = _kinds(model)
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for vi in graph_inputs:
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            raise CannotFeed(f"input {vi.name!r} is not a tensor")
        shape = (shapes or {}).get(vi.name) or [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        kind, what = kinds.get(vi.name, ("data", None))
        if kind == "shape":
            raise CannotFeed(f"input {vi.name!r} is {what}: its values decide shapes, and nothing says which")
        if kind in ("scales", "sizes"):
            feeds[vi.name] = np.asarray(what, dtype=dtype).reshape(shape)
        elif dtype == np.bool_ or (np.issubdtype(dtype, np.integer) and vi.name.endswith("mask")):
            feeds[vi.name] = np.ones(shape, dtype=dtype)  # an attention mask (Qwen-Image's int64 one): every token kept
        elif kind == "index":
            feeds[vi.name] = rng.integers(0, min(what or 1000, 1000), size=shape).astype(dtype)
        elif np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, 1000, size=shape).astype(dtype)
        elif vi.name == "conditioning_scale":  # a ControlNet's: its residuals at full strength
            feeds[vi.name] = np.array(1.0, dtype=dtype)
        elif vi.name == "controlnet_cond":  # a control image, in [0, 1] as diffusers prepares it
            feeds[vi.name] = rng.uniform(0, 1, size=shape).astype(dtype)
        elif not shape or vi.name == "timestep":
            feeds[vi.name] = np.full(shape, 500.0, dtype=dtype)
        elif vi.name == "guidance":  # Flux.1 dev's embedded guidance: FluxPipeline's default
            feeds[vi.name] = np.full(shape, 3.5, dtype=dtype)
        elif vi.name in ("img_ids", "txt_ids") and len(shape) == 2 and np.issubdtype(dtype, np.floating):
            feeds[vi.name] = _position_ids(vi.name, shape, dtype)
        elif np.issubdtype(dtype, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        else:
            raise CannotFeed(f"input {vi.name!r} is {np.dtype(dtype).name}, which the check has no values for")
    return feeds


def _position_ids(name: str, shape: list[int], dtype: Any) -> np.ndarray:
    """diffusers' position ids (Flux.1 and its kin): the text's zeros, the image's (0, row, column) of the most
    nearly square grid of its tokens (a token count that is no grid: one row)."""
    ids = np.zeros(shape, dtype=dtype)
    n = shape[0]
    if name == "img_ids" and shape[1] >= 3:
        rows = next(r for r in range(int(n ** 0.5), 0, -1) if n % r == 0)
        ids[:, 1] = np.arange(n) // (n // rows)
        ids[:, 2] = np.arange(n) % (n // rows)
    return ids


# (seed, timestep) of the runs a fidelity range is taken over: three seeds, three timesteps spread across the
# schedule (noisy, middle, nearly clean). Components without a timestep take the seeds alone.
RANGE_RUNS = ((0, 999.0), (1, 500.0), (2, 1.0))


def timestep_scale(config: dict[str, Any] | None) -> float:
    """What a denoiser of module ``config`` takes of diffusers' timestep: its family's share
    (``sdnpu.families``: Flux.1's transformer a thousandth)."""
    family = families.of_class((config or {}).get("_class_name"))
    return 1.0 / family.timestep_divisor if family is not None else 1.0


def range_inputs(path: Path, seed: int, timestep: float | None, scale: float = 1.0) -> dict[str, np.ndarray]:
    """``generic_inputs`` with the timestep (a UNet's scalar, SD3's per batch item) set to ``timestep`` times
    ``scale`` (Flux.1's transformer takes diffusers' timestep / 1000: ``timestep_scale``)."""
    feeds = generic_inputs(path, seed)
    if timestep is not None and "timestep" in feeds:
        feeds["timestep"] = np.full(feeds["timestep"].shape, timestep * scale, dtype=feeds["timestep"].dtype)
    return feeds


def worst(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst of several fidelity results, output by output (lowest cosine, largest error, lowest PSNR)."""
    outputs: dict[str, dict[str, float]] = {}
    for r in results:
        for name, o in r["outputs"].items():
            w = outputs.setdefault(name, dict(o))
            w["cosine"] = min(w["cosine"], o["cosine"])
            for key in ("max_abs", "max_rel", "ref_max_abs"):
                if key in o:
                    w[key] = max(w[key], o[key])
            if "psnr_db" in o:
                w["psnr_db"] = min(w["psnr_db"], o["psnr_db"])
    return {"reference": results[0]["reference"], "outputs": outputs,
            "min_cosine": min(o["cosine"] for o in outputs.values()),
            "max_abs": max(o["max_abs"] for o in outputs.values())}


def is_image(shape: tuple[int, ...]) -> bool:
    """An RGB image tensor [B, 3, H, W] (the VAE decoder's output, the encoder's input)."""
    return len(shape) == 4 and shape[1] == 3 and shape[2] >= 8 and shape[3] >= 8


def fidelity(reference: dict[str, np.ndarray], actual: dict[str, np.ndarray]) -> dict[str, Any]:
    """Per output: max abs error, max error relative to the reference's largest magnitude, cosine, and
    PSNR for images over their [-1, 1] range (peak-to-peak 2). Non-finite outputs count as infinitely off.
    Compares the outputs ``actual`` has (a dispatch model may keep fewer outputs than its fp32 graph)."""
    outputs = {}
    for name, got in actual.items():
        if name not in reference:
            raise ValueError(f"output {name!r} is not an output of the reference")
        ref = reference[name]
        if got.shape != ref.shape:
            raise ValueError(f"output {name!r} has shape {got.shape}, the reference {ref.shape}")
        if ref.dtype.kind not in "biuf" and ref.dtype.name != "bfloat16":
            same = bool(np.array_equal(got, ref))  # strings and the like: equal or not
            outputs[name] = {"max_abs": 0.0 if same else float("inf"), "max_rel": 0.0 if same else float("inf"),
                             "cosine": 1.0 if same else 0.0, "exact": True}
            continue
        a, r = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
        finite = np.isfinite(r)
        unmeasured = int(r.size - np.count_nonzero(finite))
        if unmeasured:  # the fp32 graph itself overflows there: compare where it does not, and say so
            same = (a[~finite] == r[~finite]) | (np.isnan(a[~finite]) & np.isnan(r[~finite]))
            a, r = a[finite], r[finite]
        scale = float(np.max(np.abs(r))) if r.size else 0.0
        if not np.all(np.isfinite(a)):
            outputs[name] = {"max_abs": float("inf"), "ref_max_abs": scale, "max_rel": float("inf"), "cosine": 0.0}
            if unmeasured:
                outputs[name]["reference_not_finite"] = unmeasured
            continue
        max_abs = float(np.max(np.abs(a - r))) if r.size else 0.0
        denom = float(np.linalg.norm(a) * np.linalg.norm(r))
        outputs[name] = {
            "max_abs": max_abs,
            "ref_max_abs": scale,
            "max_rel": max_abs / scale if scale > 0 else max_abs,
            "cosine": float(a @ r / denom) if denom else (1.0 if max_abs == 0 else 0.0),
        }
        if unmeasured:
            outputs[name]["reference_not_finite"] = unmeasured
            outputs[name]["not_finite_differ"] = int(np.count_nonzero(~same))
        if is_image(ref.shape):
            clipped = np.clip(a, -1, 1) - np.clip(r, -1, 1)  # over the finite values
            mse = float(np.mean(clipped**2))
            outputs[name]["psnr_db"] = float(10 * np.log10(4.0 / mse)) if mse > 0 else float("inf")
    return {"reference": "fp32 graph (onnxruntime CPU)", "outputs": outputs,
            "min_cosine": min(o["cosine"] for o in outputs.values()),
            "max_abs": max(o["max_abs"] for o in outputs.values())}


def pessimistic_model(path: Path, out: Path) -> Path:
    """The dispatch model at ``path`` with every intermediate of every reference body rounded to bf16, as a
    kernel with bf16 internals would round it (the report's pessimistic fidelity): the bodies are inlined,
    and each float value a body computes gets Cast(bf16) -> Cast(fp32) after it. The dispatch model itself
    rounds once per op, at its output (the optimistic number). Written to ``out`` (a folder); returns the
    model's path there."""
    model = ir.load(path)
    outer = {id(node) for node in model.graph}
    common.InlinePass()(model)
    common.ShapeInferencePass(strict_mode=False)(model)
    rounded = 0
    for node in list(model.graph):
        if id(node) in outer:
            continue
        for value in node.outputs:
            readers = list(value.uses())
            if value.dtype != ir.DataType.FLOAT or not readers:
                continue
            narrow = ir.node("Cast", [value], attributes={"to": ir.DataType.BFLOAT16})
            wide = ir.node("Cast", [narrow.outputs[0]], attributes={"to": ir.DataType.FLOAT})
            narrow.outputs[0].dtype, wide.outputs[0].dtype = ir.DataType.BFLOAT16, ir.DataType.FLOAT
            narrow.outputs[0].shape = wide.outputs[0].shape = value.shape
            for use in readers:
                use.node.replace_input_with(use.idx, wide.outputs[0])
            model.graph.insert_after(node, [narrow, wide])
            rounded += 1
    model.functions.clear()
    out.mkdir(parents=True, exist_ok=True)
    target = out / path.name
    weights = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)
    if weights > (1 << 31) - (1 << 26) or any(isinstance(v.const_value, ir.ExternalTensor)
                                               for v in model.graph.initializers.values()):
        ir.save(model, target, external_data=target.name + ".data", size_threshold_bytes=1024)
    else:
        ir.save(model, target)
    steps = prologue.decode(model.metadata_props.get(prologue.KEY))
    if steps is not None:  # its step prologue, beside it as beside the dispatch model (CPU work: not rounded)
        shutil.copyfile(steps.path(path), steps.path(target))
    return target
