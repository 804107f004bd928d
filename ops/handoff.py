"""Handoff values: graph inputs and outputs that a dispatch model keeps in the NPU's own form.

Where one dispatch model feeds another (a ControlNet's residuals entering the UNet that takes them), the
values need not leave the NPU's form between them: the producer writes them bf16 in its layout (NHWC for a
4-D activation) and the consumer reads them so, with no Transpose and no CastAvx on the CPU at either edge.
Such a graph input or output is a *handoff value*. Its form is written on the model (metadata
``sdnpu.handoff``: each name with the permutation that turns the graph's form into the fp32 graph's, e.g.
``[0, 3, 1, 2]`` for NHWC -> NCHW), so that every reader can convert between the two forms:
``to_graph`` (fp32 in the fp32 graph's layout -> the handoff form) and ``to_reference`` (back).

bf16 arrays are ``ml_dtypes.bfloat16`` numpy arrays; converting fp32 -> bf16 rounds to nearest even, as
CastAvx does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

KEY = "sdnpu.handoff"


def bf16() -> Any:
    import ml_dtypes

    return ml_dtypes.bfloat16


def is_bf16(a: Any) -> bool:
    return getattr(a, "dtype", None) is not None and a.dtype.name == "bfloat16"


def encode(forms: Mapping[str, Sequence[int]]) -> str:
    return json.dumps({k: {"to_reference": [int(i) for i in v]} for k, v in sorted(forms.items())})


def decode(text: str | None) -> dict[str, tuple[int, ...]]:
    """The metadata's value -> {name: the permutation to the fp32 graph's layout}; {} where there is none."""
    if not text:
        return {}
    return {k: tuple(int(i) for i in v["to_reference"]) for k, v in json.loads(text).items()}


def of_proto(model: Any) -> dict[str, tuple[int, ...]]:
    """The handoff values of an ``onnx.ModelProto``."""
    return decode(next((p.value for p in model.metadata_props if p.key == KEY), None))


def graph_shape(shape: Sequence[int], to_reference: Sequence[int]) -> list[int]:
    """The handoff form's shape of a value whose fp32 graph shape is ``shape``."""
    inverse = np.argsort(to_reference)
    return [int(shape[i]) for i in inverse]


def to_graph(a: np.ndarray, to_reference: Sequence[int]) -> np.ndarray:
    """A value in the fp32 graph's form -> its handoff form (bf16, the graph's layout)."""
    if is_bf16(a):
        return a
    return np.ascontiguousarray(np.transpose(np.asarray(a, np.float32), np.argsort(to_reference))).astype(bf16())


def to_reference(a: np.ndarray, to_reference: Sequence[int]) -> np.ndarray:
    """A value in its handoff form -> the fp32 graph's form (fp32, its layout)."""
    if not is_bf16(a):
        return a
    return np.ascontiguousarray(np.transpose(a.astype(np.float32), tuple(to_reference)))


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b in their own dtype, computed in fp32 (bf16 rounded once, as an NPU's add rounds)."""
    if is_bf16(a) or is_bf16(b):
        return (a.astype(np.float32) + b.astype(np.float32)).astype(bf16())
    return a + b


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
    import onnxruntime as ort
    from onnx import TensorProto

    forms = decode(session.get_modelmeta().custom_metadata_map.get(KEY))
    io = session.io_binding()
    keep: list[Any] = []  # the buffers behind the bound values live until the run is done
    for k, a in feeds.items():
        if k in inputs and inputs[k].type == "tensor(bfloat16)":
            a = to_graph(a, forms[k]) if k in forms else np.asarray(a).astype(bf16())
            value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                np.ascontiguousarray(a).view(np.uint16), TensorProto.BFLOAT16)
        else:
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a))
        keep.append(value)
        io.bind_ortvalue_input(k, value)
    buffers: dict[str, np.ndarray] = {}
    for n in names:
        static = all(isinstance(d, int) for d in outputs[n].shape)
        if outputs[n].type == "tensor(bfloat16)" and static:
            buffers[n] = np.empty([int(d) for d in outputs[n].shape], np.uint16)
            io.bind_ortvalue_output(n, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buffers[n],
                                                                                        TensorProto.BFLOAT16))
        else:
            io.bind_output(n, "cpu")
    session.run_with_iobinding(io)
    got = io.get_outputs()
    result = []
    for n, value in zip(names, got, strict=True):
        if n in buffers or outputs[n].type == "tensor(bfloat16)":
            a = (buffers[n] if n in buffers else _bf16_copy(value)).view(bf16())
            result.append(a if native or n not in forms else to_reference(a, forms[n]))
        else:
            result.append(value.numpy())
    return result


def _bf16_copy(value: Any) -> np.ndarray:
    """A copy (uint16) of a bf16 OrtValue that onnxruntime allocated (an output whose shape the graph leaves
    symbolic): its Python API reads no bf16 into numpy."""
    import ctypes

    shape = tuple(value.shape())
    n = int(np.prod(shape)) if shape else 1
    if n == 0:
        return np.empty(shape, np.uint16)
    raw = (ctypes.c_uint16 * n).from_address(value.data_ptr())
    return np.ctypeslib.as_array(raw).copy().reshape(shape)


def handover(a: np.ndarray, produced: Sequence[int] | None, taken: Sequence[int] | None) -> np.ndarray:
    """A value one model gave (``produced``: its handoff form, None: the fp32 graph's form) in the form the
    next model takes (``taken``, likewise): as it is where the two agree (no work on the CPU), else
    converted through the fp32 graph's form."""
    if produced is not None and taken is not None and tuple(produced) == tuple(taken) and is_bf16(a):
        return a
    ref = to_reference(a, produced) if produced is not None else a
    return to_graph(ref, taken) if taken is not None else ref
