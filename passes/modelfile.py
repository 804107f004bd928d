"""Reading and writing the models the compiler works on: ``load`` leaves an ONNX file's weights on disk (onnx_ir
reads external data lazily) and names a missing or short data file at once; ``save`` writes a model with its
weights inline below the protobuf limit and in one ``<name>.data`` file above (or where some are still a
source's external data). Derived weights (transposed, bf16) are computed one at a time while saving, so a
compile holds no full second copy of the weights."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import onnx_ir as ir

from sdnpu.errors import SdnpuError

PROTOBUF_LIMIT = 2**31 - 2**26
# Test/debug knob: weights go to external data when they total more than this many bytes (default: the
# protobuf limit, so only full-size models do). SDNPU_EXTERNAL_DATA_ABOVE=0 sends a tiny model's weights
# there too, which is how the tests exercise external data (and a kill during its write) in seconds.
EXTERNAL_DATA_ENV = "SDNPU_EXTERNAL_DATA_ABOVE"


def unreadable(path: Path, err: Exception) -> SdnpuError:
    """The error for a file that onnx cannot parse: truncated, or not ONNX at all."""
    return SdnpuError(f"{path} is not a readable ONNX model: {type(err).__name__}: {err}",
                      hint="re-export it; a truncated file or missing external data gives this")


def load(path: Path) -> ir.Model:
    try:
        model = ir.load(path)
    except FileNotFoundError as e:
        raise SdnpuError(f"{path} not found") from e
    except Exception as e:  # protobuf's DecodeError and friends
        raise unreadable(path, e) from e
    _check_external_data(model, path)
    return model


def _check_external_data(model: ir.Model, path: Path) -> None:
    """External data is read lazily, deep inside the compile: name a missing or short file now."""
    sizes: dict[str, int] = {}
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            data = str(tensor.path)
            if data not in sizes:
                sizes[data] = os.path.getsize(data) if os.path.isfile(data) else -1
            if sizes[data] < 0:
                raise SdnpuError(f"{path} keeps its weights in {tensor.location}, which is missing ({data})",
                                 hint=f"copy {tensor.location} beside {path.name}: the two belong together")
            end = (tensor.offset or 0) + (tensor.length if tensor.length is not None else tensor.nbytes)
            if sizes[data] < end:
                raise SdnpuError(f"{data} is truncated: {sizes[data]:,} bytes, {path.name} needs {end:,}",
                                 hint="the copy is incomplete: copy it again, or re-export the model")


def save(model: ir.Model, path: Path) -> None:
    """Write ``model`` to ``path``; its weights go to ``path.data`` past the protobuf limit, or where some are
    still the source's external data (a weight no pass changed, e.g. the text encoders' token table that
    stays with its CPU Gather): those are copied into our own file, never referenced in the source's."""
    values = [v.const_value for v in model.graph.initializers.values() if v.const_value is not None]
    total = sum(t.nbytes for t in values)
    external = any(isinstance(t, ir.ExternalTensor) for t in values)
    try:
        if external or total > int(os.environ.get(EXTERNAL_DATA_ENV, PROTOBUF_LIMIT)):
            ir.save(model, path, external_data=path.name + ".data", size_threshold_bytes=1024)
        else:
            ir.save(model, path)
    except OSError as e:
        # numpy's tofile reports a short write as "N requested and M written", without an errno
        if e.errno is None and shutil.disk_usage(path.parent).free < total:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path)) from e
        if e.errno is not None and e.filename is None:  # a failed write names no file: name the model
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
