"""``sdnpu pack``: a deployable copy of a dispatch model, its weights in AMD's physical formats.

``dd/replaced.onnx`` keeps its weights in the layout AMD's packer takes (SDConv OHWI bf16 plus an fp32 bias,
SDGemm [K, N] bf16 plus a bias) and runs anywhere through its reference bodies. AMD's kernels read packed
blobs instead: bfp16ebs8 blocks interleaved with the bias in the kernel's tile order, which depends on
per-shape layer parameters shipped with AMD's transaction binaries. So the packing is AMD's own code,
``ryzenai_dynamic_dispatch.sd`` (``conv_to_bfp16``, ``gemm_to_bfp16``, ``matmul_to_bf16``; signatures as in
DynamicDispatch src/python/bindings.cpp and src/ops/sd/wts_packing.hpp at b3051f0), called where it can be
imported; where it cannot, ``pack`` says so and writes nothing. The bf16 tensors AMD's test models store as raw
16-bit words (LayerNorm's gamma and beta, the MHA mask, constant operands) become UINT16 of the same bits.

The packed copy (``dd/packed/replaced.onnx``) carries no reference bodies: its weights are no longer what the
bodies read, so only a runtime with AMD's custom ops runs it. sdnpu has not run that path: AMD's packer and
NPU are not available where it was written, and the tests exercise the plumbing with a stand-in packer.

The copy is then written in AMD's loading format (``ddpackage``): each NPU region one ``com.ryzenai``
``DynamicDispatch`` node, its ops and packed constants in ``.cache/`` beside the model, which is what AMD's
custom-op library loads. ``pack(folder, out=...)`` writes a whole folder laid out for AMD's SD server instead:
each component's ``dd/replaced.onnx`` is the package, everything else as in ``folder``.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

from sdnpu import families
from sdnpu.errors import SdnpuError
from sdnpu.fileio import staged_dir
from sdnpu.runtime import ddpackage
from sdnpu.formats import prologue
from sdnpu.formats.keys import PACKED_KEY, TARGET_KEY
from sdnpu.formats.sizes import sizes_of
from sdnpu.ops.target import get_target

log = logging.getLogger(__name__)

PACKER_MODULE = "ryzenai_dynamic_dispatch"
PACKED_DIR = "packed"


def amd_packer() -> Any:
    """AMD's packer module (``ryzenai_dynamic_dispatch.sd``), or an SdnpuError saying it is not here."""
    try:  # `sd` is an attribute of the package (a nanobind submodule of its _DynamicDispatch extension,
        # star-imported by its __init__: DD src/python/bindings.cpp:103, 174; ryzenai_dynamic_dispatch/__init__.py),
        # not a module of its own: AMD's test models write `from ryzenai_dynamic_dispatch import fuse, sd`
        sd = getattr(importlib.import_module(PACKER_MODULE), "sd", None)
        if sd is None:
            raise ImportError(f"{PACKER_MODULE} has no `sd` packer functions")
        return sd
    except ImportError as e:
        raise SdnpuError(f"sdnpu pack needs AMD's weight packer ({PACKER_MODULE}.sd, from the Ryzen AI software), "
                         f"and it cannot be imported here: {e}",
                         hint="run it where Ryzen AI is installed; dd/replaced.onnx itself needs no packing to run "
                              "on a CPU") from e


def _bits16(a: np.ndarray) -> np.ndarray:
    """bf16 values as the uint16 words AMD's test models store."""
    return np.ascontiguousarray(np.asarray(a).astype(ml_dtypes.bfloat16)).view(np.uint16)


def pack_model(source: Path, out_dir: Path, kernels: ddpackage.Kernels, prefix: str = "") -> dict[str, int]:
    """Pack ``source`` (a dd/replaced.onnx) into ``out_dir/<its name>``, in AMD's loading format for the
    model class ``kernels`` (its DynamicDispatch nodes' names start with ``prefix``); returns counts by kind."""
    sd = amd_packer()
    model = onnx.load(str(source))
    meta = {p.key: p.value for p in model.metadata_props}
    if TARGET_KEY not in meta:
        raise SdnpuError(f"{source} is not a dispatch model (no target recorded)", hint="sdnpu compile it first")
    target = get_target(meta[TARGET_KEY])
    inits = {t.name: t for t in model.graph.initializer}
    new_inits: dict[str, onnx.TensorProto] = {}
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if not target.is_dispatch(node.domain, node.op_type):
            continue
        spec = target.base_spec(node.op_type)
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}

        def array(i: int, node: onnx.NodeProto = node) -> np.ndarray:
            return numpy_helper.to_array(inits[node.input[i]]).astype(np.float32)

        if spec.op_type in ("SDConv", "SDGemm"):
            w, bias = array(1), array(2)
            if spec.op_type == "SDConv":
                _, yi, xi, _ = attrs["input_shape"]
                _, yo, xo, _ = attrs["output_shape"]
                blob = sd.conv_to_bfp16(w, bias, "SDConv", np.array([yi, xi, yo, xo], np.int32))
            else:
                blob = sd.gemm_to_bfp16(w, bias, "SDGemm", np.array(attrs["input_shape"], np.int32), True)
            name = f"{node.input[1]}_packed"
            new_inits[name] = numpy_helper.from_array(np.asarray(blob, np.uint8).reshape(-1), name)
            del node.input[2]  # the bias is inside the blob
            node.input[1] = name
            key = f"{spec.op_type} weights -> bfp16ebs8 blob"
            counts[key] = counts.get(key, 0) + 1
            continue
        if spec.op_type == "SDMatMul":
            b, m, _ = attrs["input_shape"]
            name = f"{node.input[1]}_packed"
            new_inits[name] = numpy_helper.from_array(np.asarray(sd.matmul_to_bf16(array(1), b, m), np.uint16), name)
            node.input[1] = name
            counts["SDMatMul weights -> bf16 tiles"] = counts.get("SDMatMul weights -> bf16 tiles", 0) + 1
            continue
        for i, spec_in in enumerate(spec.inputs):
            if i < len(node.input) and spec_in.packed.startswith("uint16") and node.input[i] in inits:
                name = f"{node.input[i]}_u16"
                if name not in new_inits:
                    new_inits[name] = numpy_helper.from_array(_bits16(array(i)), name)
                    counts["bf16 constants -> uint16 words"] = counts.get("bf16 constants -> uint16 words", 0) + 1
                node.input[i] = name
    used = {i for n in model.graph.node for i in n.input}
    kept = [t for t in model.graph.initializer if t.name in used] + [t for k, t in new_inits.items() if k in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    del model.functions[:]  # the bodies read the unpacked weights: only AMD's custom ops run this copy
    model.metadata_props.add(key=PACKED_KEY, value=f"{PACKER_MODULE}.sd")
    out_dir.mkdir(parents=True, exist_ok=True)
    package = ddpackage.package_model(model, out_dir, source.name, kernels, prefix)
    counts[f"DynamicDispatch nodes ({kernels.model_type}, {Path(kernels.xclbin).name})"] = len(package.nodes)
    counts["ops inside them"] = sum(package.nodes.values())
    counts["nodes left on the CPU"] = package.cpu_nodes
    big = sum(t.ByteSize() for t in model.graph.initializer) > (1 << 31) - (1 << 26)
    onnx.save(model, str(out_dir / source.name), save_as_external_data=big,
              location=f"{source.name}.data" if big else None)
    steps = prologue.of_proto(model)
    if steps is not None:  # its step prologue (CPU work, nothing to pack), beside it
        shutil.copyfile(steps.path(source), steps.path(out_dir / source.name))
        counts["step prologue copied"] = 1
    return counts


def _family(folder: Path) -> str:
    """The pipeline family (``sdnpu.families``' name) of a converted folder (or of the folder a component folder
    lies in)."""
    for where in (folder, folder.parent):
        index = where / "model_index.json"
        if index.is_file():
            try:
                return families.detect(json.loads(index.read_text())).name
            except ValueError as e:
                raise SdnpuError(f"{index} is not JSON: {e}", hint="convert the folder again") from e
    raise SdnpuError(f"{folder} has no model_index.json beside its components, so its pipeline is not known",
                     hint="give a folder written by sdnpu convert")


def _height(graph: Path, component: str) -> int:
    """The image height a dispatch model was compiled for, for the model class of SD 3's VAE (AMD's 1024-px
    kernels differ from its 512-px ones): the size recorded for it, else its first input's (the interface
    stays NCHW; a latent's times 8)."""
    for f in sizes_of(graph.parent.parent):
        if graph.name == Path(f.dispatch).name:
            return f.size.height
    model = onnx.load(str(graph), load_external_data=False)
    dims = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    if len(dims) != 4:
        return 0
    return dims[2] if component == "vae_encoder" else dims[2] * 8


def pack(folder: str | Path, out: str | Path | None = None) -> dict[str, dict[str, int] | str]:
    """Pack every component's dispatch models under ``folder`` (a converted folder or one component's) into
    ``<component>/dd/packed/`` in AMD's loading format, each folder replaced atomically; with ``out``, write a
    whole new folder laid out for AMD's SD server instead (each packed component's ``dd/`` is the package;
    every other file a hard link, or a copy, of ``folder``'s). A component converted at several sizes gets
    every size's model under its own name (``replaced.WxH.onnx``), each with its own packed weights (AMD's
    packing follows per-shape layer parameters) and its own DynamicDispatch nodes (named after the size) in
    the one ``.cache``. Components AMD has no NPU model class for (the text encoders, which AMD runs on the
    CPU; pipelines other than SD 1.5, SDXL and SD 3) are left as they are, with the reason. Returns counts
    by component (``"<component> WxH"`` for the sizes after the first), or that reason."""
    folder = Path(folder)
    sources = sorted(folder.glob("*/dd/replaced.onnx")) or sorted(folder.glob("dd/replaced.onnx"))
    if not sources:
        raise SdnpuError(f"no dispatch model (*/dd/replaced.onnx) under {folder}", hint="make convert first")
    amd_packer()  # fail before anything is written
    family = _family(folder)
    if out is not None:
        out = Path(out)
        if not (folder / "model_index.json").is_file():
            raise SdnpuError(f"--out writes a whole pipeline folder, and {folder} is not one (no model_index.json)",
                             hint="give the converted folder, or pack this component in place (without --out)")
        if out.exists() and any(out.iterdir()):
            raise SdnpuError(f"{out} exists and is not empty", hint="give a new folder for the packed copy")
        if out.resolve() == folder.resolve() or folder.resolve() in out.resolve().parents:
            raise SdnpuError(f"{out} lies inside {folder}", hint="give a folder outside the converted one")
    results: dict[str, dict[str, int] | str] = {}
    plans = []
    for source in sources:
        comp_dir = source.parent.parent
        name = comp_dir.name
        sizes = sizes_of(comp_dir)
        graphs = [(name if f.primary else f"{name} {f.tag}", comp_dir / f.dispatch,
                   "" if f.primary else f"s{f.tag}_") for f in sizes]
        graphs = graphs or [(name, source, "")]
        kernels = ddpackage.kernels_for(family, name, _height(graphs[0][1], name))
        if isinstance(kernels, str):
            for key, _, _ in graphs:
                results[key] = kernels
            log.info("[%s] not packaged: %s", name, kernels)
            continue
        plans.append((source, graphs, kernels))
    if out is None:
        for source, graphs, kernels in plans:
            with staged_dir(source.parent / PACKED_DIR) as stage:
                for key, graph, prefix in graphs:
                    results[key] = pack_model(graph, stage, kernels, prefix)
            _log(graphs, results, source.parent / PACKED_DIR)
        return results
    packed_dd = {source.parent.resolve() for source, _, _ in plans}
    root = folder
    with staged_dir(out) as stage:
        _link_tree(root, stage, skip=packed_dd)
        for source, graphs, kernels in plans:
            dd = stage / source.parent.relative_to(root)
            for key, graph, prefix in graphs:
                results[key] = pack_model(graph, dd, kernels, prefix)
            for extra in ("onnx_report.txt", "report.json"):  # what the folder's reports say of it
                if (source.parent / extra).is_file():
                    shutil.copyfile(source.parent / extra, dd / extra)
            _log(graphs, results, out / source.parent.relative_to(root))
    return results


def _log(graphs: list[tuple[str, Path, str]], results: dict[str, Any], where: Path) -> None:
    for key, _, _ in graphs:
        log.info("[%s] packed into %s: %s", key, where, ", ".join(f"{k} {v}" for k, v in results[key].items()))


def _link_tree(src: Path, dst: Path, skip: set[Path]) -> None:
    """``src``'s files under ``dst``, hard-linked where the file system allows (copied otherwise), but the
    folders in ``skip`` (the dispatch models' folders that the packages replace) and earlier packed copies."""
    for dirpath, dirnames, filenames in os.walk(src):
        here = Path(dirpath)
        if here.resolve() in skip:
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not (d == PACKED_DIR and here.name == "dd") and not d.startswith(".")]
        target = dst / here.relative_to(src)
        target.mkdir(parents=True, exist_ok=True)
        for f in filenames:
            try:
                os.link(here / f, target / f)
            except OSError:
                shutil.copy2(here / f, target / f)
