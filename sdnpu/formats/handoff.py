"""Handoff values: graph inputs and outputs that a dispatch model keeps in the NPU's own form.

Where one dispatch model feeds another (a ControlNet's residuals entering the UNet that takes them), the
values need not leave the NPU's form between them: the producer writes them bf16 in its layout (NHWC for a
4-D activation) and the consumer reads them so, with no Transpose and no CastAvx on the CPU at either edge.
Such a graph input or output is a *handoff value*. Its form is written on the model (metadata
``sdnpu.handoff``: each name with the permutation that turns the graph's form into the fp32 graph's, e.g.
``[0, 3, 1, 2]`` for NHWC -> NCHW), so that every reader can convert between the two forms:
``to_graph`` (fp32 in the fp32 graph's layout -> the handoff form) and ``to_reference`` (back).
Running a session on such values is ``sdnpu.onnxrun.run``.

bf16 arrays are ``ml_dtypes.bfloat16`` numpy arrays; converting fp32 -> bf16 rounds to nearest even, as
CastAvx does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from sdnpu.formats.keys import HANDOFF_KEY as KEY

__all__ = ["KEY", "add", "bf16", "decode", "encode", "graph_shape", "handover", "is_bf16", "of_proto",
           "of_session", "to_graph", "to_reference"]


def bf16() -> Any:
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


def of_session(session: Any) -> dict[str, tuple[int, ...]]:
    """The handoff values of an onnxruntime session's model."""
    return decode(session.get_modelmeta().custom_metadata_map.get(KEY))


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


def handover(a: np.ndarray, produced: Sequence[int] | None, taken: Sequence[int] | None) -> np.ndarray:
    """A value one model gave (``produced``: its handoff form, None: the fp32 graph's form) in the form the
    next model takes (``taken``, likewise): as it is where the two agree (no work on the CPU), else
    converted through the fp32 graph's form."""
    if produced is not None and taken is not None and tuple(produced) == tuple(taken) and is_bf16(a):
        return a
    ref = to_reference(a, produced) if produced is not None else a
    return to_graph(ref, taken) if taken is not None else ref
