"""Where an ONNX TensorProto keeps its bytes when they lie outside the model file (ONNX external data), and
how to point it somewhere else. Shared by the writer of per-size graphs (``sdnpu.convert.shared``), the
runtime that maps shared weights and LoRA overlays (``sdnpu.runtime.session``) and the parameter matcher."""

from __future__ import annotations

from typing import Any

import onnx

# the fields a TensorProto may hold its values in, cleared when it is pointed at external data
VALUE_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def place(t: Any) -> tuple[str, int, int | None] | None:
    """``(location, offset, length)`` of a tensor's external data (length None where the entry has none),
    or None for a tensor stored in the model file."""
    if t.data_location != onnx.TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in t.external_data}
    length = info.get("length")
    return info["location"], int(info.get("offset", 0)), int(length) if length is not None else None


def point(t: Any, location: str, offset: int, length: int) -> None:
    """Make ``t`` read its ``length`` bytes at ``offset`` of ``location`` (relative to the model's folder),
    wherever it kept them before."""
    for name in VALUE_FIELDS:
        t.ClearField(name)
    del t.external_data[:]
    t.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        item = t.external_data.add()
        item.key, item.value = key, str(value)
