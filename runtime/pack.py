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
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError
from sdnpu.fileio import staged_dir
from sdnpu.formats import prologue
from sdnpu.formats.keys import PACKED_KEY, TARGET_KEY
from sdnpu.formats.sizes import sizes_of
from sdnpu.ops.target import get_target

log = logging.getLogger(__name__)

PACKER_MODULE = "ryzenai_dynamic_dispatch"
PACKED_DIR = "packed"


def amd_packer() -> Any:
    """AMD's packer module (``ryzenai_dynamic_dispatch.sd``), or an SdnpuError saying it is not here."""
    import importlib

    try:
        return importlib.import_module(f"{PACKER_MODULE}.sd")
    except ImportError as e:
        raise SdnpuError(f"sdnpu pack needs AMD's weight packer ({PACKER_MODULE}.sd, from the Ryzen AI software), "
                         f"and it cannot be imported here: {e}",
                         hint="run it where Ryzen AI is installed; dd/replaced.onnx itself needs no packing to run "
                              "on a CPU") from e


def _bits16(a: np.ndarray) -> np.ndarray:
    """bf16 values as the uint16 words AMD's test models store."""
    import ml_dtypes

    return np.ascontiguousarray(np.asarray(a).astype(ml_dtypes.bfloat16)).view(np.uint16)


def pack_model(source: Path, out_dir: Path) -> dict[str, int]:
    """Pack ``source`` (a dd/replaced.onnx) into ``out_dir/replaced.onnx``; returns counts by kind."""
    import onnx
    from onnx import numpy_helper

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
    big = sum(t.ByteSize() for t in model.graph.initializer) > (1 << 31) - (1 << 26)
    onnx.save(model, str(out_dir / source.name), save_as_external_data=big,
              location=f"{source.name}.data" if big else None)
    steps = prologue.of_proto(model)
    if steps is not None:  # its step prologue (CPU work, nothing to pack), beside it
        shutil.copyfile(steps.path(source), steps.path(out_dir / source.name))
        counts["step prologue copied"] = 1
    return counts


def pack(folder: str | Path) -> dict[str, dict[str, int]]:
    """Pack every component's dispatch models under ``folder`` (a converted folder or one component's) into
    ``<component>/dd/packed/``, each folder replaced atomically. A component converted at several sizes gets
    every size's model under its own name (``replaced.WxH.onnx``), each with its own packed weights: AMD's
    packing follows per-shape layer parameters, so one size's blobs are not assumed to fit another's.
    Returns counts by component (``"<component> WxH"`` for the sizes after the first)."""
    folder = Path(folder)
    sources = sorted(folder.glob("*/dd/replaced.onnx")) or sorted(folder.glob("dd/replaced.onnx"))
    if not sources:
        raise SdnpuError(f"no dispatch model (*/dd/replaced.onnx) under {folder}", hint="make convert first")
    amd_packer()  # fail before anything is written
    results = {}
    for source in sources:
        comp_dir = source.parent.parent
        name = comp_dir.name
        sizes = sizes_of(comp_dir)
        graphs = [(name if f.primary else f"{name} {f.size}", comp_dir / f.dispatch) for f in sizes]
        with staged_dir(source.parent / PACKED_DIR) as stage:
            for key, graph in graphs or [(name, source)]:
                results[key] = pack_model(graph, stage)
        for key, _ in graphs or [(name, source)]:
            log.info("[%s] packed into %s: %s", key, source.parent / PACKED_DIR,
                     ", ".join(f"{k} {v}" for k, v in results[key].items()))
    return results
