"""AMD's loading format for a dispatch model: one ``com.ryzenai`` ``DynamicDispatch`` node per NPU region, with
that region's ops listed in ``.cache/<node>_meta.json`` and its constants in ``.cache/<node>_<i>.const``.

AMD's custom-op library registers no standalone SD op (its one domain is ``com.ryzenai``: ``CastAvx``,
``CastMulAvx``, ``DynamicDispatch``, ``Pad``, ``DynamicPad``); the SD ops of a region run inside a
``DynamicDispatch`` node, whose kernel reads ``<model folder>/.cache/<node name>_meta.json`` at first load,
compiles it and writes its ``dd_metastate_*`` files beside the model. What is written here follows AMD's public
sources (the file and line of each fact are in docs/npu.md):

- the node as AMD's partitioner builds it (``ryzenai_onnx_utils`` ``transform/dd.py`` ``build_dd_node``): the
  region's inputs (not its initializers) and the values it writes that others read or the graph returns,
  ``input_shape_<i>`` / ``output_shape_<i>``, ``xclbin``, ``model_type`` (the SD pass's extra attribute),
  ``replaced`` (the region's node names); named after the region's first node;
- the meta.json as DynamicDispatch's ``fuse.prepare_metadata`` / ``save_tensors_to_json`` write it
  (``src/python/ryzenai_dynamic_dispatch/fuse.py``, ``onnx_graph.py``): the op list in graph order, each op's
  activation and constant arguments and its attributes as typed strings; the region's tensors packed into
  ``in`` / ``out`` / ``scratch`` / ``const`` buffers (4-byte aligned, in the order DD's ``ONNXGraph`` meets
  them); every constant's file, relative to the model's folder (DD's ``FusionRuntime::compile`` prefixes
  ``cache_dir``, which AMD's kernel sets to the model's folder);
- the constants' bytes as the model stores them: AMD's weight blobs where ``sdnpu pack`` ran AMD's packer
  first (what AMD's kernels read), bf16 words otherwise. Only the packed form is what AMD's SD kernels take
  for SDConv and SDGemm (DD ``tests/cpp/sd_gemm/model.py``: the constant is ``gemm_to_bfp16``'s blob).

Not known from public sources, and so not written: the ``dd_metastate_*`` files (AMD's library writes them on
first load, compiling each region against per-shape transaction binaries shipped with its kernels: a shape
AMD did not prepare has none). None of this has been loaded by AMD's library: neither it nor an NPU is here.
``unpackage`` reads a package back the way DD reads it (the op list, the arguments, the constant files) into
a model of standalone ops, which is how the tests check that a package carries the whole computation.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from sdnpu import families
from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import REGION_TAG, TARGET_KEY
from sdnpu.ops.target import DispatchTarget, get_target

log = logging.getLogger(__name__)

DOMAIN = "com.ryzenai"  # the one domain AMD's custom-op library registers
NODE_TYPE = "DynamicDispatch"
CACHE = ".cache"  # beside the model: AMD's SD server passes dd_cache only where cache/ or .cache/ exists
META_MAJOR, META_MINOR = 1, 1  # fuse.save_tensors_to_json
ALIGNMENT = 4  # fuse.TENSOR_PACK_ALIGNMENT (bytes)
BUFFERS = ("in", "out", "scratch", "const", "super_instr")  # their order is the fused kernel's xrt argument order

# ryzenai_onnx_utils' ModelType (kept in sync with onnx_custom_ops' external_buffers.hpp, its comment says)
MODEL_TYPES = {name: i for i, name in enumerate(
    ("UNET", "DECODER", "UNET_BFP", "DECODER_BFP", "SD15_UNET", "SD15_DECODER", "SD30_MMDIT", "SD30_VAE",
     "LLM_PREFILL", "LLM_TOKEN", "UNKNOWN"))}


@dataclass(frozen=True)
class Kernels:
    """What a DynamicDispatch node of one AMD model class says: its ``model_type`` and ``xclbin``."""

    model_type: str
    xclbin: str
    source: str


_SD15_UNET = Kernels("SD15_UNET", "/xclbin/stx/SD15_unet_2x4x4.xclbin",
                     "DD xclbin/stx/SD15_unet_2x4x4.xclbin, tests/cpp/include/test_common.hpp:311")
_SD15_VAE = Kernels("SD15_DECODER", "/xclbin/stx/SD15_vae_2x4x4.xclbin",
                    "DD xclbin/stx/SD15_vae_2x4x4.xclbin, tests/cpp/include/test_common.hpp:312")
_SDXL = "ryzenai_onnx_utils' SDXL partition test (xclbin /xclbin/stx/sdxl_unet_vae_combined_new.xclbin)"
_SDXL_UNET = Kernels("UNET", "/xclbin/stx/sdxl_unet_vae_combined_new.xclbin", _SDXL)
_SDXL_VAE = Kernels("DECODER", "/xclbin/stx/sdxl_unet_vae_combined_new.xclbin", _SDXL)
_SD3_MMDIT = Kernels("SD30_MMDIT", "/xclbin/stx/SD3_MMDIT_2x4x4.xclbin",
                     "DD xclbin/stx/SD3_MMDIT_2x4x4.xclbin, tests/cpp/include/test_common.hpp:313-315")
_SD3_VAE = Kernels("SD30_VAE", "/xclbin/stx/SD3_VAE_2x4x4.xclbin", "DD tests/cpp/include/test_common.hpp:316")
_SD3_VAE_1K = Kernels("SD30_VAE", "/xclbin/stx/SD3_1K_VAE_2x4x4.xclbin", "DD tests/cpp/include/test_common.hpp:314")


# AMD's kernels by pipeline family (``sdnpu.families``' names; AMD's knowledge, so kept with AMD's format, not
# in the family table): (the denoiser's, the VAE's below 1024 px, the VAE's at 1024 px and above)
_KERNELS: dict[str, tuple[Kernels, Kernels, Kernels]] = {
    families.SD.name: (_SD15_UNET, _SD15_VAE, _SD15_VAE),
    families.SDXL.name: (_SDXL_UNET, _SDXL_VAE, _SDXL_VAE),
    families.SD3.name: (_SD3_MMDIT, _SD3_VAE, _SD3_VAE_1K),
}


def kernels_for(family: str, component: str, height: int) -> Kernels | str:
    """The AMD model class a component of a ``family`` pipeline is packaged as, or the reason there is none
    (AMD prepared kernels for SD 1.5, SDXL and SD 3 only; it runs the text encoders on the CPU)."""
    denoiser = component in families.DENOISER_MODULES or component.startswith("controlnet")
    vae = component in ("vae_decoder", "vae_encoder")
    if not (denoiser or vae):
        return f"{component}: AMD runs the text encoders on the CPU (its ModelType has no class for them)"
    if family not in _KERNELS:
        return (f"{component}: AMD prepared NPU kernels for SD 1.5, SDXL and SD 3 only (its ModelType list), none "
                f"for a {family} pipeline")
    net, small_vae, large_vae = _KERNELS[family]
    return net if denoiser else (large_vae if height >= 1024 else small_vae)


@dataclass
class Package:
    """What ``package_model`` wrote: the DynamicDispatch nodes (with the count of ops each replaced) and the
    bytes of the constant files."""

    nodes: dict[str, int] = field(default_factory=dict)
    const_bytes: int = 0
    cpu_nodes: int = 0


def _dtype_name(elem_type: int) -> str:
    return onnx.helper.tensor_dtype_to_string(elem_type).split(".")[-1].lower()  # as DD's extract_type


def _size(elem_type: int, shape: list[int]) -> int:
    item = 2 if elem_type == onnx.TensorProto.BFLOAT16 else np.dtype(
        onnx.helper.tensor_dtype_to_np_dtype(elem_type)).itemsize
    return int(math.prod(shape)) * item


def _attr_json(attr: Any) -> dict[str, Any]:
    """An attribute as DD's ``extract_op_attrs`` writes it: a type name and a list of strings."""
    kind = attr.type
    A = onnx.AttributeProto
    if kind == A.FLOAT:
        return {"type": "float", "value": [str(attr.f)]}
    if kind == A.INT:
        return {"type": "int", "value": [str(attr.i)]}
    if kind == A.STRING:
        return {"type": "str", "value": [attr.s.decode("utf-8")]}
    if kind == A.FLOATS:
        return {"type": "float", "value": [str(v) for v in attr.floats]}
    if kind == A.INTS:
        return {"type": "int", "value": [str(v) for v in attr.ints]}
    if kind == A.STRINGS:
        return {"type": "str", "value": [v.decode("utf-8") for v in attr.strings]}
    raise SdnpuError(f"attribute {attr.name} of type {kind} cannot be written to a DD meta.json",
                     hint="DD's meta.json holds numbers and strings only")


def _valid_filename(name: str) -> str:
    """A node name usable as a file name (the node's name is its meta.json's)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip(".") or "region"


def regions_of(model: Any, target: DispatchTarget) -> list[list[Any]]:
    """The dispatch nodes grouped by the region the partition gave them (``sdnpu.region``), each in graph order."""
    groups: dict[str, list[Any]] = {}
    for node in model.graph.node:
        if not target.is_dispatch(node.domain, node.op_type):
            continue
        props = {p.key: p.value for p in node.metadata_props}
        if REGION_TAG not in props:
            raise SdnpuError(f"dispatch op {node.name} ({node.op_type}) has no NPU region",
                             hint="the model was not partitioned: compile it with sdnpu compile")
        groups.setdefault(props[REGION_TAG], []).append(node)
    return list(groups.values())


def _shapes(model: Any) -> dict[str, tuple[int, list[int]]]:
    out: dict[str, tuple[int, list[int]]] = {}
    for vi in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        t = vi.type.tensor_type
        out[vi.name] = (t.elem_type, [d.dim_value for d in t.shape.dim])
    for init in model.graph.initializer:
        out[init.name] = (init.data_type, list(init.dims))
    return out


def package_model(model: Any, folder: Path, stem: str, kernels: Kernels, prefix: str = "") -> Package:
    """Rewrite ``model`` (an onnx ModelProto, a dispatch model or ``sdnpu pack``'s copy of one) in place into
    AMD's loading format, its meta.json and constant files written to ``folder / CACHE``; ``stem`` is the name
    the model will be saved under (its constant files' names start with ``prefix`` + the node's name, so
    several models can share one cache). The caller saves the model."""
    meta_props = {p.key: p.value for p in model.metadata_props}
    if TARGET_KEY not in meta_props:
        raise SdnpuError(f"{stem} is not a dispatch model (no target recorded)", hint="sdnpu compile it first")
    target = get_target(meta_props[TARGET_KEY])
    graph = model.graph
    shapes = _shapes(model)
    inits = {t.name: t for t in graph.initializer}
    consumers: dict[str, list[Any]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    graph_outputs = {o.name for o in graph.output}
    cache = folder / CACHE
    cache.mkdir(parents=True, exist_ok=True)
    result = Package()
    replacement: dict[int, Any] = {}  # id(first node of a region) -> its DynamicDispatch node
    dropped: set[int] = set()
    used_names: set[str] = set()
    for region in regions_of(model, target):
        members = {id(n) for n in region}
        produced = {o for n in region for o in n.output}
        inputs: list[str] = []
        outputs: list[str] = []
        consts: list[str] = []
        order: list[str] = []  # every tensor as DD's ONNXGraph meets it: each node's inputs, then its outputs
        for n in region:
            for i, name in enumerate(n.input):
                if not name:
                    raise SdnpuError(f"{n.name} ({n.op_type}) has an empty input {i}",
                                     hint="DD's meta.json has no optional arguments")
                if name not in order:
                    order.append(name)
                if name in inits:
                    if name not in consts:
                        consts.append(name)
                elif name not in produced and name not in inputs:
                    inputs.append(name)
            for name in n.output:
                if name not in order:
                    order.append(name)
                if name in graph_outputs or any(id(c) not in members for c in consumers.get(name, [])):
                    outputs.append(name)
            args = [x for x in n.input if x not in inits] + [x for x in n.input if x in inits]
            if args != list(n.input):  # DD hands an op its activations, then its constants
                raise SdnpuError(f"{n.name} ({n.op_type}) takes a constant before an activation "
                                 f"({list(n.input)}), which DD's op list cannot say",
                                 hint="a contract problem in the rule that wrote it: please report it")
        missing = [t for t in order if t not in shapes]
        if missing:
            raise SdnpuError(f"no shape recorded for {missing[0]} (region of {region[0].name})",
                             hint="the dispatch model lacks value_info: compile it again")
        name = prefix + _valid_filename(region[0].name or region[0].op_type)
        while name in used_names:
            name += "_"
        used_names.add(name)
        scratch = [t for t in order if t not in inputs and t not in outputs and t not in consts]
        tensor_map: dict[str, dict[str, Any]] = {}
        fused: dict[str, dict[str, Any]] = {}
        for arg_id, (label, names) in enumerate(zip(BUFFERS, (inputs, outputs, scratch, consts, []))):
            offset = 0
            for t in names:
                elem, shape = shapes[t]
                size = _size(elem, shape)
                tensor_map[t] = {"packed_buffer_label": label, "xrt_arg_id": arg_id, "dtype": _dtype_name(elem),
                                 "shape": shape, "size_in_bytes": size, "offset": offset}
                offset = (offset + size + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
            fused[label] = {"buffer_size": offset, "xrt_arg_id": arg_id, "packed_tensors": list(names)}
        for i, t in enumerate(consts):
            data = numpy_helper.to_array(inits[t])
            raw = np.ascontiguousarray(data).tobytes() if data.dtype != object else b""
            if inits[t].data_type == onnx.TensorProto.BFLOAT16:  # stored as 16-bit words, as DD's tofile does
                raw = np.ascontiguousarray(data).view(np.uint16).tobytes()
            rel = f"{CACHE}/{name}_{i}.const"
            (folder / rel).write_bytes(raw)
            tensor_map[t].update({"file_name": rel, "file_size": len(raw)})
            result.const_bytes += len(raw)
        op_list = [{"name": n.name, "type": n.op_type,
                    "in_args": [x for x in n.input if x not in inits],
                    "const_args": [x for x in n.input if x in inits],
                    "out_args": list(n.output),
                    "attrs": {a.name: _attr_json(a) for a in n.attribute}} for n in region]
        meta = {"dd_meta_major_version": META_MAJOR, "dd_meta_minor_version": META_MINOR, "op_list": op_list,
                "fused_tensors": fused, "tensor_map": tensor_map, "aux_info": {}}
        (cache / f"{name}_meta.json").write_text(json.dumps(meta, indent=2))
        node = onnx.helper.make_node(NODE_TYPE, inputs, outputs, name=name, domain=DOMAIN)
        for i, t in enumerate(inputs):
            node.attribute.append(onnx.helper.make_attribute(f"input_shape_{i}", shapes[t][1]))
        for i, t in enumerate(outputs):
            node.attribute.append(onnx.helper.make_attribute(f"output_shape_{i}", shapes[t][1]))
        node.attribute.append(onnx.helper.make_attribute("xclbin", kernels.xclbin))
        node.attribute.append(onnx.helper.make_attribute("model_type", MODEL_TYPES[kernels.model_type]))
        node.attribute.append(onnx.helper.make_attribute("replaced", [n.name for n in region]))
        replacement[id(region[-1])] = node  # where the region's last op was: every input is computed by then
        dropped |= members
        result.nodes[name] = len(region)
    new_nodes = []
    for n in graph.node:
        if id(n) in replacement:
            new_nodes.append(replacement[id(n)])
        elif id(n) not in dropped:
            if target.is_boundary(n.domain, n.op_type):
                n.domain = DOMAIN  # CastAvx: AMD's library registers it in com.ryzenai
            result.cpu_nodes += 1
            new_nodes.append(n)
    del graph.node[:]
    graph.node.extend(new_nodes)
    _order(graph)
    used = {x for n in graph.node for x in n.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inner = {t for t in (v.name for v in graph.value_info)} - {x for n in graph.node for x in [*n.input, *n.output]}
    kept_vi = [v for v in graph.value_info if v.name not in inner]
    del graph.value_info[:]
    graph.value_info.extend(kept_vi)
    del model.functions[:]  # the reference bodies: nothing runs them in this form
    opsets = [o for o in model.opset_import if o.domain != target.domain]
    del model.opset_import[:]
    model.opset_import.extend(opsets)
    model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, 1))
    return result


def _order(graph: Any) -> None:
    """Sort ``graph``'s nodes topologically (a region's node stands where its last op stood; a CPU node
    between two of its ops that reads an earlier one must then come after it)."""
    produced_by: dict[str, int] = {}
    for i, n in enumerate(graph.node):
        for o in n.output:
            produced_by[o] = i
    nodes = list(graph.node)
    indegree = [0] * len(nodes)
    users: dict[int, list[int]] = {}
    for i, n in enumerate(nodes):
        for x in set(n.input):
            p = produced_by.get(x)
            if p is not None and p != i:
                indegree[i] += 1
                users.setdefault(p, []).append(i)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(nodes[i])
        for u in users.get(i, []):
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, u)
    if len(out) != len(nodes):
        raise SdnpuError("the NPU regions close a cycle through the CPU", hint="a partition bug: please report it")
    del graph.node[:]
    graph.node.extend(out)


def unpackage(path: Path, functions_from: Any = None) -> Any:
    """Read a package back as DD reads it: each DynamicDispatch node's ops from its meta.json (their types,
    activation then constant arguments, attributes from the typed strings), its constants from the files the
    meta.json names, at the sizes it records. Returns a model of standalone ``com.amd`` ops (with
    ``functions_from``'s reference bodies, it runs in stock onnxruntime); a missing or short file is an error,
    as it is in DD."""
    path = Path(path)
    model = onnx.load(str(path))
    folder = path.parent
    target = get_target({p.key: p.value for p in model.metadata_props}[TARGET_KEY])
    known = set(target.ops) | set(target.bfp_variants)
    nodes = []
    inits = []
    have = {t.name for t in model.graph.initializer}  # a constant two regions (or a CPU node) share: once
    for node in model.graph.node:
        if (node.domain, node.op_type) != (DOMAIN, NODE_TYPE):
            if node.domain == DOMAIN:
                node.domain = "com.amd"
            nodes.append(node)
            continue
        meta_path = folder / CACHE / f"{node.name}_meta.json"
        if not meta_path.is_file():
            raise SdnpuError(f"no meta.json for DynamicDispatch node {node.name}: {meta_path} is missing",
                             hint="package the model again (sdnpu pack)")
        meta = json.loads(meta_path.read_text())
        tmap = meta["tensor_map"]
        for name in meta["fused_tensors"]["const"]["packed_tensors"]:
            if name in have:
                continue
            have.add(name)
            info = tmap[name]
            data = (folder / info["file_name"]).read_bytes()
            if len(data) != info["file_size"] or len(data) != info["size_in_bytes"]:
                raise SdnpuError(f"{info['file_name']}: {len(data)} bytes, the meta.json says {info['file_size']}",
                                 hint="package the model again (sdnpu pack)")
            dtype = getattr(onnx.TensorProto, info["dtype"].upper())
            if dtype == onnx.TensorProto.BFLOAT16:
                t = onnx.helper.make_tensor(name, dtype, info["shape"], data, raw=True)
            else:
                arr = np.frombuffer(data, onnx.helper.tensor_dtype_to_np_dtype(dtype)).reshape(info["shape"])
                t = numpy_helper.from_array(arr, name)
            inits.append(t)
        for op in meta["op_list"]:
            kinds = {a.name: a.type for a in target.base_spec(op["type"]).attrs} if op["type"] in known else {}
            attrs = {}
            for key, a in op["attrs"].items():
                conv = {"int": int, "float": float, "str": str}[a["type"]]
                vals = [conv(v) for v in a["value"]]  # DD's strings do not say a list of one from a scalar:
                kind = kinds.get(key, "ONE" if len(vals) == 1 else "MANY")  # the table says which, where it knows
                attrs[key] = vals if kind.endswith("S") or kind == "MANY" else vals[0]
            nodes.append(onnx.helper.make_node(op["type"], op["in_args"] + op["const_args"], op["out_args"],
                                               name=op["name"], domain="com.amd", **attrs))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.initializer.extend(inits)
    opsets = [o for o in model.opset_import if o.domain != DOMAIN]
    del model.opset_import[:]
    model.opset_import.extend([*opsets, onnx.helper.make_opsetid("com.amd", 1)])
    if functions_from is not None:
        model.functions.extend(functions_from.functions)
    _order(model.graph)
    return model


def is_package(path: Path) -> bool:
    """Whether the model at ``path`` is in this format (a DD cache beside it, and DynamicDispatch nodes)."""
    path = Path(path)
    if not (path.parent / CACHE).is_dir() or not path.is_file():
        return False
    model = onnx.load(str(path), load_external_data=False)
    return any((n.domain, n.op_type) == (DOMAIN, NODE_TYPE) for n in model.graph.node)
