"""One copy of the weights for many image sizes: per-size graphs that refer to a shared data file by offset.

A component converted at several sizes (``sdnpu convert --res 1024x1024,1152x896``) keeps one fp32 graph and
one dispatch model per size, but their weights do not depend on the size, only the graphs do. The first size
(the *primary*) owns the data files, ``model.onnx.data`` and ``dd/replaced.onnx.data``; each other size's
graph, ``model.WxH.onnx`` and ``dd/replaced.WxH.onnx``, lies in the same folder and points its tensors into
them (ONNX external data: location, offset, length). onnx's loader and checker and onnxruntime all refuse an
external-data location outside the model's own folder (``../``), which is why the per-size graphs sit beside
the shared file rather than in folders of their own. A tensor that no other size has (a size-dependent
constant: an attention mask, a shape) goes to the size's own small ``<graph>.data``, or stays in the graph
under 1 KB.

Tensors are matched by content: the BLAKE2b digest (128 bits) of their bytes against the digests of the
shared file's tensors, which ``.digests.json`` caches with the data file's size and modification time, so adding
a size reads the shared file only when the cache is stale. Nothing here writes into a shared data file once
it exists: ``write_sized`` writes a new size's own files (data first, then the graph), each atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from sdnpu import external
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json

log = logging.getLogger(__name__)

INLINE_MAX = 1024  # tensors up to this many bytes stay inside the graph (onnx-ir's save threshold, as ours)
ALIGN = 1 << 16  # offsets of own data, as onnx-ir aligns large tensors: onnxruntime maps them in place


@dataclass
class ShareStats:
    """What ``write_sized`` wrote: tensors (and bytes) pointed into the shared file, written to the size's
    own data file, and kept inside the graph."""

    shared: int = 0
    shared_bytes: int = 0
    own: int = 0
    own_bytes: int = 0
    inline: int = 0
    graph_bytes: int = 0

    def to_json(self) -> dict[str, int]:
        return dict(vars(self))


def data_name(graph: Path) -> str:
    return graph.name + ".data"


def _initializers(proto: Any) -> list[Any]:
    return list(proto.graph.initializer)


def _read_external(folder: Path, t: Any, handles: dict[str, Any]) -> bytes:
    location, offset, length = external.place(t)  # type: ignore[misc]
    f = handles.get(location)
    if f is None:
        f = handles[location] = open(folder / location, "rb")  # noqa: SIM115 - closed by the caller
    f.seek(offset)
    if length is None:
        length = int(np.prod(t.dims, dtype=np.int64)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    data = f.read(length)
    if len(data) != length:
        raise SdnpuError(f"{folder / location} is truncated: {t.name} needs {length:,} bytes at {offset:,}",
                         hint="the copy is incomplete: copy it again, or convert again")
    return data


def _inline_bytes(t: Any) -> bytes:
    if t.HasField("raw_data"):
        return bytes(t.raw_data)
    return bytes(numpy_helper.to_array(t).tobytes())


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def digests(graph: Path, cache: dict[str, Any] | None = None) -> dict[str, list[int]]:
    """``digest -> [offset, length]`` for the tensors that ``graph`` keeps in its own data file
    (``<graph>.data``); ``cache`` (``.digests.json``'s entry for that file) is used while the file's size and
    time match, and refreshed otherwise."""
    data = graph.with_name(data_name(graph))
    if not data.is_file():
        return {}
    if cache is not None and cache.get("stamp") == _stamp(data):
        return dict(cache["digests"])
    proto = onnx.load(str(graph), load_external_data=False)
    out: dict[str, list[int]] = {}
    with open(data, "rb") as f:
        for t in _initializers(proto):
            where = external.place(t)
            if where is None or where[0] != data.name or where[2] is None:
                continue
            offset, length = where[1], where[2]
            f.seek(offset)
            out.setdefault(_digest(f.read(length)), [offset, length])
    if cache is not None:
        cache.clear()
        cache.update({"stamp": _stamp(data), "digests": out})
    return out


def _inline(t: Any, data: bytes) -> None:
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
    for name in external.VALUE_FIELDS:
        t.ClearField(name)
    t.raw_data = data


def tensor_bytes(folder: Path, t: Any, handles: dict[str, Any]) -> bytes:
    """A tensor's bytes, from the graph or from its external data file in ``folder`` (``handles``: open
    files, kept for the next call; the caller closes them)."""
    return _read_external(folder, t, handles) if external.place(t) else _inline_bytes(t)


def write_sized(src: Path, dest: Path, shared: dict[str, list[int]] | None, shared_location: str | None
                ) -> ShareStats:
    """Write the graph at ``src`` (with its data, wherever it keeps it) to ``dest``: every tensor whose bytes
    the shared data file holds (``shared``: its digests, ``shared_location``: its name, in ``dest``'s folder)
    points there; the others go to ``dest``'s own data file (or stay in the graph under 1 KB). With
    ``shared`` None, ``dest`` owns its data: every tensor above 1 KB goes to ``<dest>.data`` (how an inline
    primary graph is made shareable). The data file is written first and the graph last, each under a
    temporary name renamed into place, so a reader sees the old graph or the whole new one."""
    proto = onnx.load(str(src), load_external_data=False)
    handles: dict[str, Any] = {}

    def place(t: Any, stats: ShareStats) -> bytes | None:
        data = tensor_bytes(src.parent, t, handles)
        hit = shared.get(_digest(data)) if shared and len(data) > INLINE_MAX else None
        if hit is not None and hit[1] == len(data) and shared_location is not None:
            external.point(t, shared_location, hit[0], hit[1])
            stats.shared += 1
            stats.shared_bytes += len(data)
            return None
        return data

    try:
        return _write(proto, dest, place)
    finally:
        for f in handles.values():
            f.close()


def write_proto(proto: Any, dest: Path) -> ShareStats:
    """Write ``proto`` (a graph whose external tensors already point into data files in ``dest``'s folder:
    a specialized size's dispatch model) to ``dest``, its tensors in the graph above 1 KB to ``dest``'s own
    data file; atomically, as ``write_sized``."""
    def place(t: Any, stats: ShareStats) -> bytes | None:
        where = external.place(t)
        if where is None:
            return _inline_bytes(t)
        if where[2] is None or not (dest.parent / where[0]).is_file() or where[0] == data_name(dest):
            raise SdnpuError(f"{t.name} points at {where[0]}, which is not a shared data file beside {dest}",
                             hint="convert the component again")
        stats.shared += 1
        stats.shared_bytes += where[2]
        return None

    return _write(proto, dest, place)


def _write(proto: Any, dest: Path, place: Any) -> ShareStats:
    """The writer of ``write_sized`` and ``write_proto``: ``place(tensor, stats)`` points a tensor that
    stays where it is and returns None, or returns its bytes (kept in the graph up to 1 KB, else written to
    ``dest``'s own data file)."""
    own = data_name(dest)
    stats = ShareStats()
    tmp_data = dest.with_name(own + ".partial")
    tmp_graph = dest.with_name(dest.name + ".partial")
    try:
        with open(tmp_data, "wb") as out:
            for t in _initializers(proto):
                if t.data_type == onnx.TensorProto.STRING:
                    stats.inline += 1
                    continue
                data = place(t, stats)
                if data is None:
                    continue
                if len(data) <= INLINE_MAX:
                    _inline(t, data)
                    stats.inline += 1
                    continue
                pad = -out.tell() % ALIGN if len(data) >= ALIGN else 0
                out.write(b"\0" * pad)
                external.point(t, own, out.tell(), len(data))
                out.write(data)
                stats.own += 1
                stats.own_bytes += len(data)
            out.flush()
            os.fsync(out.fileno())
        if stats.own:
            os.replace(tmp_data, dest.with_name(own))
        else:
            tmp_data.unlink()
            dest.with_name(own).unlink(missing_ok=True)
        blob = proto.SerializeToString()
        with open(tmp_graph, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_graph, dest)
        stats.graph_bytes = len(blob)
    finally:
        for tmp in (tmp_data, tmp_graph):
            tmp.unlink(missing_ok=True)
    return stats


def owns_its_data(graph: Path) -> bool:
    """Whether every tensor of ``graph`` above 1 KB lies in its own ``<graph>.data`` (a graph others can
    share)."""
    proto = onnx.load(str(graph), load_external_data=False)
    own = data_name(graph)
    for t in _initializers(proto):
        where = external.place(t)
        if where is not None:
            if where[0] != own:
                return False
        elif t.data_type != onnx.TensorProto.STRING and len(_inline_bytes(t)) > INLINE_MAX:
            return False
    return True


def make_shareable(graph: Path) -> bool:
    """Move ``graph``'s tensors above 1 KB into ``<graph>.data`` where they are not there yet (a small model
    keeps them inside the graph). Returns whether it rewrote the graph."""
    if owns_its_data(graph):
        return False
    log.info("%s: moving its weights into %s, so that other sizes can share them", graph, data_name(graph))
    write_sized(graph, graph, None, None)
    return True


DIGESTS = ".digests.json"  # cache: the shared data files' tensor digests (see ``digests``)


def read_digest_cache(comp_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((Path(comp_dir) / DIGESTS).read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


def write_digest_cache(comp_dir: Path, cache: dict[str, Any]) -> None:
    atomic_write_json(Path(comp_dir) / DIGESTS, cache)
