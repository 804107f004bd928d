"""Which PyTorch parameter each constant of an exported graph holds: ``<component>/parameters.json``
(its format: ``sdnpu.formats.parameters``).

The exporters keep a parameter's name where the graph reads it as it is (``unet.conv_in.weight``), but
dynamo folds a Linear's ``weight.T`` into an anonymous constant (``val_194``) and TorchScript names it
``onnx::MatMul_1234``. A LoRA is keyed by module names, so right after the export, while the module is still
loaded, each float constant of the graph is matched to the parameter (or buffer) it equals, as it is or
transposed: by name where the exporter kept it, else by shape and 192 sampled values (the first, middle
and last 64), read from the file without loading the graph's weights. A constant two parameters could
explain (equal samples: both all zeros, say) is recorded as ambiguous, with its candidates; one no parameter
explains (a constant the exporter computed) is left out. Names are the module's own, without the
wrapper's attribute (``down_blocks.0.resnets.0.conv1.weight``, ``text_model.encoder.layers.0...``).

Together with ``dd/weights.json`` (``sdnpu.formats.weights``) this takes every weight of a dispatch op back to a
module parameter and the steps that made it.
"""

from __future__ import annotations

from math import prod
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from sdnpu import external
from sdnpu.formats.parameters import make_record

SAMPLE = 64


def _spans(n: int) -> list[tuple[int, int]]:
    """The flat index ranges sampled from a tensor of ``n`` values."""
    if n <= 3 * SAMPLE:
        return [(0, n)]
    mid = n // 2
    return [(0, SAMPLE), (mid, mid + SAMPLE), (n - SAMPLE, n)]


def _array_samples(flat_at: Any, n: int) -> bytes:
    return b"".join(np.ascontiguousarray(flat_at(a, b)).tobytes() for a, b in _spans(n))


def _tensor_samples(t: Any, folder: Path) -> bytes | None:
    """The sampled values of an ONNX TensorProto, read from its external data file where it has one."""
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
    n = prod(t.dims)
    where = external.place(t)
    if where is not None:
        location, base, _ = where
        out = []
        with open(folder / location, "rb") as f:
            for a, b in _spans(n):
                f.seek(base + a * dtype.itemsize)
                out.append(f.read((b - a) * dtype.itemsize))
        return b"".join(out)
    if t.raw_data:
        flat = np.frombuffer(t.raw_data, dtype)
    else:
        flat = numpy_helper.to_array(t).reshape(-1)
    return _array_samples(lambda a, b: flat[a:b], n)


def _transposed_samples(w: np.ndarray) -> bytes:
    """Samples of ``w.T`` (2-D) without making it: flat index k of w.T [c, r] is w[k % r, k // r]."""
    r, c = w.shape

    def at(a: int, b: int) -> np.ndarray:
        k = np.arange(a, b)
        return w[k % r, k // r]

    return _array_samples(at, r * c)


def map_parameters(wrapper: Any, path: Path) -> dict[str, Any]:
    """The record for the graph at ``path`` exported from ``wrapper`` (a torch module whose only child is
    the component's module)."""
    prefix = next(iter(name for name, _ in wrapper.named_children()), "")
    tensors = dict(wrapper.named_parameters())
    tensors.update(wrapper.named_buffers())
    candidates: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
    for name, p in tensors.items():
        if not p.dtype.is_floating_point:
            continue
        w = p.detach().cpu().numpy()
        key = name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name
        candidates.setdefault((w.shape, w.dtype.str, _array_samples(lambda a, b, f=w.reshape(-1): f[a:b],
                                                                         w.size)), []).append((key, "identity"))
        if w.ndim == 2:
            candidates.setdefault((w.shape[::-1], w.dtype.str, _transposed_samples(w)), []).append(
                (key, "transpose"))
    graph = onnx.load(str(path), load_external_data=False).graph
    found: dict[str, Any] = {}
    ambiguous = 0
    for t in graph.initializer:
        if t.data_type not in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
                               onnx.TensorProto.DOUBLE):
            continue
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        if t.name in tensors and tuple(tensors[t.name].shape) == tuple(t.dims):
            stripped = t.name[len(prefix) + 1:] if prefix and t.name.startswith(prefix + ".") else t.name
            matches = [(stripped, "identity")]
        else:
            samples = _tensor_samples(t, path.parent)
            matches = candidates.get((tuple(t.dims), dtype.str, samples), [])
        if len(matches) == 1:
            found[t.name] = {"param": matches[0][0], "transform": matches[0][1]}
        elif matches:
            found[t.name] = {"param": None, "candidates": [m[0] for m in matches]}
            ambiguous += 1
    return make_record(prefix, ambiguous, found)
