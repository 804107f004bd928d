"""LoRAs applied to a converted folder without re-export or recompile: an overlay of changed weights.

For each component a LoRA changes (the UNet, the text encoders), the module weights it touches are found in
the exported graph (``<component>/parameters.json``: which graph constant holds which parameter, as it is or
transposed), merged in fp32 from the *base* values (``adapters.Adapters.merged``), and every constant of
the dispatch model computed from them is computed again by replaying its record (``dd/weights.json``,
``sdnpu.formats.weights``): the same transposes, slices, concatenations and bf16/bfp16 rounding the compiler
applied. Only those constants are written, to ``<component>/dd/lora/weights.data``, with
``dd/lora/lora.json`` naming each one's offset, dtype and shape, the LoRAs and their scales. The base files
are never written; the overlay folder is swapped in whole (``fileio.staged_dir``), so an interrupted apply
leaves the previous state, and ``remove`` (deleting the folder and the report's ``lora`` entry) returns
every file to its bytes from before.

A session reads the overlay in place: the replaced tensors' external-data entries in the model's protobuf
point at ``lora/weights.data`` (``runtime.session.relocate_to_overlay``), so onnxruntime maps it as it maps
the base data. ``sdnpu generate --lora`` computes the same tensors in memory (``compute_in_memory``) and
hands them to onnxruntime's external-initializer API (``SessionOptions.add_external_initializers``); so does
a model that is not the component's own (``sdnpu verify``'s pessimistic copy: ``overlay_initializers``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from sdnpu import families
from sdnpu.components import LORA_COMPONENTS, module_of
from sdnpu.errors import SdnpuError
from sdnpu.fileio import atomic_write_json, recover_staging, staged_dir
from sdnpu.formats import parameters, reference, weights
from sdnpu.formats.overlay import ALIGN, DATA, FORMAT, MANIFEST, OVERLAY_DIR, VERSION, base_digest, read_manifest
from sdnpu.lora.adapters import Adapters, LoraFile, LoraSpec, read_lora, sha256
from sdnpu.reports.report import write as write_report

log = logging.getLogger(__name__)

__all__ = ["Applied", "apply", "compute", "compute_in_memory", "manifest_specs", "pipeline_folder", "read_loras",
           "remove", "status"]


def pipeline_folder(path: str | Path) -> tuple[Path, list[str]]:
    """(the converted pipeline folder, the components a LoRA can change in it) for a pipeline folder or
    one of its component folders; one line where ``path`` is neither."""
    path = Path(path)
    root = path if (path / "model_index.json").is_file() else path.parent
    fam = families.named(family(root) if (root / "model_index.json").is_file() else None)
    if not fam.lora:
        raise SdnpuError(f"{root} is {fam.a_pipeline}: sdnpu applies LoRAs to SDXL, SD 1.x and Flux.1 folders "
                         "only", hint=f"LoRAs for {fam.title}'s {fam.denoiser} are not supported yet")
    able = fam.lora
    if (path / "model_index.json").is_file():
        comps = [c for c in able if (path / c / "dd" / "replaced.onnx").is_file()]
        if not comps:
            raise SdnpuError(f"{path} has no compiled {' or '.join(able)}",
                             hint="convert them first: make convert MODEL=" + ",".join(able))
        return path, comps
    if path.name in able and (path / "dd" / "replaced.onnx").is_file():
        return path.parent, [path.name]
    raise SdnpuError(f"{path} is not a converted pipeline folder (no model_index.json) or one of its "
                     f"components ({', '.join(LORA_COMPONENTS)})", hint="give the folder sdnpu convert wrote, "
                     "e.g. models/sdxl-base")


def family(folder: Path) -> str:
    """The converted pipeline's family (``sdnpu.families``' name), from its model_index.json."""
    return families.detect(json.loads((folder / "model_index.json").read_text())).name


def read_loras(folder: Path, specs: Sequence[LoraSpec]) -> list[LoraFile]:
    config = folder / "unet" / "config.json"
    unet_config = json.loads(config.read_text()) if config.is_file() else None
    loras = [read_lora(spec, family(folder), unet_config) for spec in specs]
    seen: dict[str, Path] = {}
    for lora in loras:
        if lora.sha256 in seen:
            log.warning("%s and %s are the same file: it is applied twice", seen[lora.sha256], lora.spec.path)
        seen[lora.sha256] = lora.spec.path
    return loras


@dataclass
class _Sources:
    """What a component's overlay is computed from."""

    comp_dir: Path
    parameters: dict[str, tuple[str, str]]  # module parameter -> (graph constant, identity | transpose)
    weights: dict[str, Any]  # dd/weights.json's expressions


def _sources(comp_dir: Path) -> _Sources:
    reference.require(comp_dir, "compute a LoRA's changes from")  # they are replayed from its constants
    params = parameters.constants_by_parameter(parameters.read_record(comp_dir))
    return _Sources(comp_dir, params, weights.read_record(comp_dir / "dd" / weights.FILE)["weights"])


def _changed_constants(src: _Sources, adapters: Adapters) -> dict[str, tuple[str, str]]:
    """graph constant -> (module, transform) for every weight the LoRAs change."""
    changed = {}
    for module in adapters.modules:
        found = src.parameters.get(adapters.weight_name(module))
        if found is None:
            raise SdnpuError(f"{adapters.component}.{module}.weight is not one constant of "
                             f"{src.comp_dir / 'model.onnx'} (parameters.json does not name it)",
                             hint="convert the component again; or fuse the LoRA at conversion: make convert LORA=...")
        changed[found[0]] = (module, found[1])
    return changed


def compute(comp_dir: Path, adapters: Adapters, reference: bool = False) -> Iterator[tuple[str, np.ndarray]]:
    """The constants the LoRAs change, one at a time: of the dispatch model (``dd/replaced.onnx``: the
    replayed records, in their storage dtype) or, with ``reference``, of the fp32 graph (``model.onnx``)."""
    src = _sources(comp_dir)
    changed = _changed_constants(src, adapters)
    model = ir.load(comp_dir / "model.onnx")
    read = weights.constant_reader(model)

    def offset(name: str) -> int:
        tensor = model.graph.initializers[name].const_value
        return tensor.offset or 0 if isinstance(tensor, ir.ExternalTensor) else 0

    # in the order the weights lie in the data file: one sequential read where it is not cached
    changed = dict(sorted(changed.items(), key=lambda item: offset(item[0])))
    yield from _compute(src, changed, adapters, read, reference)


def _compute(src: _Sources, changed: dict[str, tuple[str, str]], adapters: Adapters,
             read: Callable[[str], np.ndarray], reference: bool) -> Iterator[tuple[str, np.ndarray]]:
    import torch  # here: the overlay's readers (the runtime, verify) never import torch

    def merged(name: str) -> np.ndarray:
        """The graph constant ``name`` with the LoRAs merged, in the graph's layout (a transposed weight is
        merged through a transposed view: no copy)."""
        module, transform = changed[name]
        base = read(name)  # a copy of our own, changed in place
        w = torch.from_numpy(base)
        adapters.merge_into(module, w.t() if transform == "transpose" else w)
        return base

    if reference:
        for name in changed:
            yield name, merged(name)
        return
    order = {name: i for i, name in enumerate(changed)}
    affected = []
    for dd_name, expr in src.weights.items():
        reads = weights.leaves(expr) & changed.keys() if not expr.get("literal") else set()
        if reads:
            affected.append((min(order[r] for r in reads), dd_name, weights.leaves(expr)))
    affected.sort()
    uses: dict[str, int] = {}
    for _, _, reads in affected:
        for r in reads & changed.keys():
            uses[r] = uses.get(r, 0) + 1
    cache: dict[str, np.ndarray] = {}

    def read_merged(name: str) -> np.ndarray:
        if name not in changed:
            return read(name)
        if name not in cache:
            cache[name] = merged(name)
        return cache[name]

    for _, dd_name, reads in affected:
        yield dd_name, weights.evaluate(src.weights[dd_name], read_merged)
        for r in reads & changed.keys():
            uses[r] -= 1
            if not uses[r]:
                cache.pop(r, None)


def _dispatch_tensors(comp_dir: Path) -> dict[str, tuple[int, list[int]]]:
    """The dispatch model's initializers: name -> (ONNX data type, shape), read without their data."""
    model = onnx.load(str(comp_dir / "dd" / "replaced.onnx"), load_external_data=False)
    return {t.name: (t.data_type, list(t.dims)) for t in model.graph.initializer}


class _Writer:
    """Appends arrays to a file from a thread of its own, so that writing (disk-bound) overlaps computing the
    next weight (CPU-bound; numpy and torch release the GIL). At most two arrays wait."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 -- closed in close()
        self.queue: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="sdnpu-overlay-writer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (data := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.file.write(data.reshape(-1).view(np.uint8).data)
                except BaseException as e:  # raised again in the computing thread
                    self.error = e

    def put(self, data: np.ndarray) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(data)

    def close(self, sync: bool) -> None:
        self.queue.put(None)
        self.thread.join()
        try:
            if self.error is not None:
                raise self.error
            if sync:
                self.file.flush()
                os.fsync(self.file.fileno())
        finally:
            self.file.close()


def _write_overlay(staging: Path, comp_dir: Path, adapters: Adapters) -> dict[str, Any]:
    """Compute the component's overlay into ``staging``; returns its manifest."""
    declared = _dispatch_tensors(comp_dir)
    tensors: dict[str, Any] = {}
    offset = 0
    writer = _Writer(staging / DATA)
    done = False
    try:
        for name, array in compute(comp_dir, adapters):
            dtype, shape = declared[name]
            if list(array.shape) != shape:
                raise SdnpuError(f"{comp_dir.name}: the replayed {name} is {list(array.shape)}, the model's is "
                                 f"{shape}", hint="the folder's records do not match its model: convert again")
            pad = -offset % ALIGN
            if pad:
                writer.put(np.zeros(pad, np.uint8))
            offset += pad
            data = np.ascontiguousarray(array)
            writer.put(data)
            tensors[name] = {"offset": offset, "length": data.nbytes, "data_type": dtype, "shape": shape,
                             "dtype": str(array.dtype)}
            offset += data.nbytes
        done = True
    finally:
        writer.close(sync=done)
    manifest = {"format": FORMAT, "version": VERSION, "component": comp_dir.name,
                "loras": [lora.describe() for lora in adapters.loras], "modules": len(adapters.modules),
                "base": {"weights.json sha256": base_digest(comp_dir)}, "data": DATA, "bytes": offset,
                "tensors": tensors}
    atomic_write_json(staging / MANIFEST, manifest)
    return manifest


def _report_entry(manifest: dict[str, Any]) -> dict[str, Any]:
    return {"applied": manifest["loras"], "modules": manifest["modules"], "tensors": len(manifest["tensors"]),
            "bytes": manifest["bytes"]}


def _update_report(comp_dir: Path, entry: dict[str, Any] | None) -> None:
    path = comp_dir / "dd" / "report.json"
    if not path.is_file():
        return
    report = json.loads(path.read_text())
    if entry is None:
        if "lora" not in report:
            return
        del report["lora"]
    else:
        report["lora"] = entry
    write_report(comp_dir / "dd", report)


@dataclass
class Applied:
    component: str
    modules: int
    tensors: int
    bytes: int
    seconds: float


def apply(path: str | Path, specs: Sequence[LoraSpec]) -> list[Applied]:
    """Apply ``specs`` (in order, each at its scale) to the converted folder at ``path``: the whole set
    replaces what was applied before (computed from the base, never on top of an earlier LoRA). Every LoRA
    file is read and checked against every component before anything is written."""
    if not specs:
        raise SdnpuError("no LoRA given", hint="sdnpu lora apply MODELS --lora FILE[:SCALE] ...")
    folder, comps = pipeline_folder(path)
    loras = read_loras(folder, specs)
    for lora in loras:
        missing = sorted(set(lora.components) - {module_of(c) for c in comps})
        if missing:
            log.warning("%s also changes %s, which %s has not compiled: that part is not applied",
                        lora.spec.path.name, ", ".join(missing), folder)
    plans = {c: Adapters(folder, c, loras, family(folder)) for c in comps}
    for c, adapters in plans.items():
        _changed_constants(_sources(folder / c), adapters)  # every module maps to a constant, before writing
    if not any(a.modules for a in plans.values()):
        raise SdnpuError("the LoRAs change none of " + ", ".join(comps), hint="are they LoRAs for this model?")
    results, manifests = [], {}
    with contextlib.ExitStack() as stack:
        for c, adapters in plans.items():
            if not adapters.modules:
                continue
            start = time.perf_counter()
            log.info("[%s] %d modules changed by %s: computing the dispatch model's weights", c,
                     len(adapters.modules), ", ".join(lora.spec.path.name for lora in adapters.loras))
            staging = stack.enter_context(staged_dir(folder / c / "dd" / OVERLAY_DIR))
            manifests[c] = m = _write_overlay(staging, folder / c, adapters)
            results.append(Applied(c, m["modules"], len(m["tensors"]), m["bytes"], time.perf_counter() - start))
    # every overlay is in place; components the new set does not change lose theirs
    for c in comps:
        if c in manifests:
            _update_report(folder / c, _report_entry(manifests[c]))
        else:
            _remove_component(folder / c)
    return results


def _remove_component(comp_dir: Path) -> bool:
    target = comp_dir / "dd" / OVERLAY_DIR
    recover_staging(target.parent)
    removed = False
    if target.exists():
        aside = target.parent / f".{OVERLAY_DIR}.old-{os.getpid()}"
        os.rename(target, aside)  # one step: a reader sees the overlay or none
        shutil.rmtree(aside)
        removed = True
    _update_report(comp_dir, None)
    return removed


def remove(path: str | Path) -> list[str]:
    """Remove the LoRA overlays of the folder at ``path``; returns the components that had one."""
    folder, comps = pipeline_folder(path)
    return [c for c in comps if _remove_component(folder / c)]


def manifest_specs(manifest: dict[str, Any]) -> list[LoraSpec]:
    """The LoRAs an overlay was computed from, as given to ``apply``; their files must still be there,
    unchanged."""
    specs = []
    for lora in manifest["loras"]:
        path = Path(lora["file"])
        if not path.is_file():
            raise SdnpuError(f"the applied LoRA {path} is gone: the fp32 graph cannot carry it too",
                             hint="put the file back, or apply the LoRAs again")
        if sha256(path) != lora["sha256"]:
            raise SdnpuError(f"the applied LoRA {path} has changed since it was applied",
                             hint="apply the LoRAs again: sdnpu lora apply")
        specs.append(LoraSpec(path, lora["scale"]))
    return specs


def compute_in_memory(comp_dir: Path, specs: Sequence[LoraSpec], reference: bool = False
                      ) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """``specs`` applied to one component in memory (``sdnpu generate --lora``): its replaced constants
    (of the dispatch model, or with ``reference`` of the fp32 graph) and the LoRAs' descriptions."""
    folder = comp_dir.parent
    loras = read_loras(folder, specs)
    adapters = Adapters(folder, comp_dir.name, loras, family(folder))
    if not adapters.modules:
        return {}, []
    return dict(compute(comp_dir, adapters, reference)), [lora.describe() for lora in adapters.loras]


def status(path: str | Path) -> dict[str, dict[str, Any] | None]:
    """Each LoRA-capable component's overlay manifest (None: the base weights)."""
    folder, comps = pipeline_folder(path)
    return {c: read_manifest(folder / c / "dd") for c in comps}
