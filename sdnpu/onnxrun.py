"""Running the graphs sdnpu writes in onnxruntime: bf16 values in and out, handoff values in either form, and a
dispatch model's step prologue first. The records these read are ``sdnpu.formats.handoff`` and
``sdnpu.formats.prologue``; the compile stage's checks, the fidelity runs and the runtime's sessions all run
through here.

onnxruntime itself is imported where a session is made or a bf16 value bound, not at import: the CLI and the
formats stay free of it until a model runs.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from onnx import TensorProto

from sdnpu.errors import SdnpuError
from sdnpu.formats import handoff, prologue

__all__ = ["is_ort_error", "open_prologue", "ort_message", "prologue_output_shapes", "run", "run_onnx", "run_prologue", "run_with_prologue"]


def run(session: Any, names: Sequence[str], feeds: Mapping[str, np.ndarray], native: bool = False
        ) -> list[np.ndarray]:
    """``session.run(names, feeds)`` for an onnxruntime session whose graph may take or give bf16 values
    (onnxruntime's Python API has no numpy type for them). A handoff input takes its handoff form, or the
    fp32 graph's form (converted); a handoff output comes back in the fp32 graph's form, or with ``native``
    in its handoff form (for the dispatch model that reads it)."""
    inputs = {i.name: i for i in session.get_inputs()}
    outputs = {o.name: o for o in session.get_outputs()}
    if not any(inputs[k].type == "tensor(bfloat16)" for k in feeds if k in inputs) and not any(
            outputs[n].type == "tensor(bfloat16)" for n in names):
        return list(session.run(list(names), dict(feeds)))
    forms = handoff.of_session(session)
    io = session.io_binding()
    keep = [_bind_input(io, k, a, inputs, forms) for k, a in feeds.items()]  # live until the run is done
    buffers = {n: _bind_output(io, n, outputs[n]) for n in names}
    session.run_with_iobinding(io)
    result = []
    for n, value in zip(names, io.get_outputs(), strict=True):
        if buffers[n] is not None or outputs[n].type == "tensor(bfloat16)":
            a = (buffers[n] if buffers[n] is not None else _bf16_copy(value)).view(handoff.bf16())
            result.append(a if native or n not in forms else handoff.to_reference(a, forms[n]))
        else:
            result.append(value.numpy())
    del keep
    return result


def _bind_input(io: Any, name: str, a: np.ndarray, inputs: Mapping[str, Any],
                forms: Mapping[str, Sequence[int]]) -> Any:
    """Bind feed ``name`` (a bf16 input in its handoff form, converted where it is given in the fp32 graph's);
    returns the OrtValue, which must live until the run is done."""
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    if name in inputs and inputs[name].type == "tensor(bfloat16)":
        a = handoff.to_graph(a, forms[name]) if name in forms else np.asarray(a).astype(handoff.bf16())
        value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(a).view(np.uint16),
                                                                TensorProto.BFLOAT16)
    else:
        value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
    io.bind_ortvalue_input(name, value)
    return value


def _bind_output(io: Any, name: str, output: Any) -> np.ndarray | None:
    """Bind output ``name``: a bf16 output of static shape into a buffer of ours (returned), else to the CPU."""
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    if output.type == "tensor(bfloat16)" and all(isinstance(d, int) for d in output.shape):
        buffer = np.empty([int(d) for d in output.shape], np.uint16)
        io.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buffer, TensorProto.BFLOAT16))
        return buffer
    io.bind_output(name, "cpu")
    return None


def _bf16_copy(value: Any) -> np.ndarray:
    """A copy (uint16) of a bf16 OrtValue that onnxruntime allocated (an output whose shape the graph leaves
    symbolic): its Python API reads no bf16 into numpy."""
    shape = tuple(value.shape())
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return np.empty(shape, np.uint16)
    raw = (ctypes.c_uint16 * n).from_address(value.data_ptr())
    return np.ctypeslib.as_array(raw).copy().reshape(shape)


def open_prologue(path: Path) -> Any:
    """A plain CPU session over a prologue (it is CPU work: the boundary cast runs its reference body)."""
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    prologue.require(path)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own errors: a truncated or corrupt file
        raise SdnpuError(f"onnxruntime cannot open the step prologue {path}: {e}",
                         hint="copy the component's dd/ folder whole again, or convert the component again") from e


def run_prologue(session: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The prologue's values for ``feeds`` (the fp32 graph's inputs), in the form the dispatch model takes
    them (bf16 where it takes bf16)."""
    names = [o.name for o in session.get_outputs()]
    wanted = [i.name for i in session.get_inputs()]
    missing = [k for k in wanted if k not in feeds]
    if missing:
        raise SdnpuError(f"the step prologue needs input {missing[0]!r}",
                         hint=f"give the fp32 graph's inputs: {', '.join(wanted)}")
    got = run(session, names, {k: feeds[k] for k in wanted}, native=True)
    return dict(zip(names, got, strict=True))


def run_with_prologue(model: Path, session: Any, feeds: Mapping[str, np.ndarray], prologue_session: Any = None
                      ) -> dict[str, np.ndarray]:
    """``feeds`` for the dispatch model at ``model`` (its onnxruntime ``session``): where it has a prologue and
    ``feeds`` lack the prologue's values, they are computed from ``feeds`` (with ``prologue_session`` where the
    caller keeps one open) and added; only the model's own inputs are kept."""
    p = prologue.of_session(session)
    out = dict(feeds)
    if p is not None and any(n not in out for n in p.outputs):
        out.update(run_prologue(prologue_session or open_prologue(p.path(model)), out))
    inputs = {i.name for i in session.get_inputs()}
    return {k: v for k, v in out.items() if k in inputs}


def prologue_output_shapes(path: Path, shapes: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The shapes of a prologue's outputs for inputs of ``shapes`` (the size a dispatch model is re-derived
    for): the prologue run once on zeros (it is a few element-wise ops and a transpose)."""
    session = open_prologue(path)
    dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    feeds = {i.name: np.zeros(shapes[i.name], dtypes.get(i.type, np.float32)) for i in session.get_inputs()}
    return {k: list(v.shape) for k, v in run_prologue(session, feeds).items()}


def run_onnx(path: Path, feeds: dict[str, np.ndarray], optimize: bool = False) -> dict[str, np.ndarray]:
    """Run a graph on onnxruntime's CPU provider; dispatch ops run through their reference bodies.
    Graph optimizations are off by default: they would fold every weight's bf16->fp32 cast into an fp32
    copy (twice the memory) and can reorder float math. Handoff values (``sdnpu.formats.handoff``) are taken
    and given in the fp32 graph's form; a step prologue (``sdnpu.formats.prologue``) runs first on the fp32
    graph's inputs."""
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    feeds = run_with_prologue(path, sess, feeds)  # a dispatch model's step prologue first, where it has one
    return dict(zip(names, run(sess, names, feeds), strict=True))


def is_ort_error(e: Exception) -> bool:
    """An exception onnxruntime raised (its own types, or a RuntimeError from inside its session)."""
    if type(e).__module__.startswith("onnxruntime"):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return isinstance(e, RuntimeError) and tb is not None and "onnxruntime" in tb.tb_frame.f_code.co_filename


def ort_message(e: Exception) -> str:
    """onnxruntime's message in one line, without its status prefix and the temporary file's path."""
    text = " ".join(str(e).split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"Load model from \S+ failed:", "loading failed: ", text)
    return text[:400]
