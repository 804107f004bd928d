"""onnxruntime sessions for converted folders: the dispatch model (``dd/replaced.onnx``) or the fp32 graph.

On any CPU, a dispatch model runs as it is: onnxruntime inlines the reference body every dispatch op carries.
On a Ryzen AI machine it is loaded the way AMD's own SD runtime loads one (lemonade-sdk/ryzenai-sd-server,
src/onnx_model.cpp): a plain session over ``dd/replaced.onnx`` with graph optimizations off, the config
entries ``dd_cache`` (the model's folder, where its ``cache`` / ``.cache`` DD cache lives) and
``onnx_custom_ops_const_key`` (the model's path) set *before* AMD's custom-op library is registered; that
library claims the ``com.amd`` ops by name. The text encoders stay on the CPU without it unless asked (AMD runs
them on the CPU). sdnpu has never run that path on an NPU: it is written from AMD's public sources and tested
here with another custom-op library (onnxruntime-extensions'), which registers and runs but claims none of
our ops. Where no library is given, nothing claims the ops and the CPU runs their reference bodies.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from sdnpu import external, onnxrun
from sdnpu.components import LORA_COMPONENTS, SIZED, TEXT_ENCODERS
from sdnpu.errors import SdnpuError
from sdnpu.formats import handoff, prologue
from sdnpu.formats import reference as fp32_graph  # ``reference`` names the argument here
from sdnpu.formats.overlay import DATA, OVERLAY_DIR, overlay_initializers, read_manifest
from sdnpu.formats.sizes import Variant, sizes_of
from sdnpu.imagesize import Size
from sdnpu.lora import overlay
from sdnpu.lora.adapters import LoraSpec
from sdnpu.memory import available_bytes
from sdnpu.runtime import ddpackage
from sdnpu.runtime.pack import PACKED_DIR
from sdnpu.signatures import batched

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
DISPATCH_MODEL = Path("dd") / "replaced.onnx"
QNN_MODEL = Path("qnn") / "ctx.onnx"  # a folder converted for Qualcomm's HTP: QNN's compiled EPContext model
REFERENCE_MODEL = Path("model.onnx")
CUSTOM_OPS_ENV = "SDNPU_CUSTOM_OPS"  # the custom-op library's path, where --custom-ops is not given
DD_CACHE_NAMES = ("cache", ".cache")


@dataclass(frozen=True)
class RuntimeOptions:
    """How sessions are made. ``custom_ops``: a custom-op library to register on dispatch-model sessions
    (AMD's ``onnx_custom_ops``; default ``$SDNPU_CUSTOM_OPS``); ``npu_text_encoders``: register it for the
    text encoders too; ``optimize``: onnxruntime's graph optimizations for CPU sessions (None: where they fit,
    ``choose_optimize``); ``threads``: intra-op threads."""

    custom_ops: Path | None = None
    npu_text_encoders: bool = False
    optimize: bool | None = None
    threads: int | None = None
    loras: tuple[Any, ...] = ()  # LoraSpecs applied as sessions open, in place of a folder's overlay
    shared_arena: bool = False  # one activation arena for every session so made (models that run in turn)

    @classmethod
    def from_env(cls, custom_ops: str | Path | None = None, **kw: Any) -> RuntimeOptions:
        path = custom_ops or os.environ.get(CUSTOM_OPS_ENV) or None
        if path is not None and not Path(path).is_file():
            raise SdnpuError(f"the custom-op library {path} does not exist",
                             hint=f"give the path of AMD's onnx_custom_ops library (--custom-ops or ${CUSTOM_OPS_ENV})")
        return cls(Path(path) if path else None, **kw)


@dataclass
class Component:
    """One component's session, with its input names and static shapes."""

    name: str
    path: Path
    session: Any
    options: Any = None  # the onnxruntime SessionOptions it was made with
    custom_ops: Path | None = None  # the library registered on it, if any
    lora: list[dict[str, Any]] | None = None  # the LoRAs its weights carry (None: the base weights)
    replaced: Any = None  # arrays handed to the external-initializer API (they must live as long as the session)
    prologue: Any = None  # the session of its step prologue (``sdnpu.formats.prologue``), where it has one

    @property
    def inputs(self) -> dict[str, list[int]]:
        return {i.name: [d if isinstance(d, int) else -1 for d in i.shape] for i in self.session.get_inputs()}

    @property
    def outputs(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    @property
    def handoff(self) -> dict[str, tuple[int, ...]]:
        """The inputs and outputs kept in the NPU's form (``sdnpu.formats.handoff``): name -> the permutation to
        the fp32 graph's layout."""
        return handoff.of_session(self.session)

    def zeros(self, name: str) -> np.ndarray:
        """Zeros for the input ``name``, in the form the model takes it (bf16 in the NPU's layout for a handoff
        input)."""
        i = next(x for x in self.session.get_inputs() if x.name == name)
        dtype = handoff.bf16() if i.type == "tensor(bfloat16)" else np.float32
        return np.zeros([int(d) for d in i.shape], dtype)

    @property
    def prologue_digest(self) -> str | None:
        """What its step prologue computes (equal digests: the same values from the same inputs); None where it
        has none."""
        spec = prologue.of_session(self.session)
        return spec.digest if spec is not None else None

    def prepare(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Its step prologue's values for ``feeds`` (the fp32 graph's inputs), to give ``run`` with them: the same
        for every model whose prologue has the same digest. {} where it has none."""
        if self.prologue is None:
            return {}
        return onnxrun.run_prologue(self.prologue, feeds)

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str] | None = None, native: bool = False
            ) -> dict[str, np.ndarray]:
        """Run on ``feeds``. A handoff input takes its handoff form (bf16) or the fp32 graph's form; a handoff
        output comes back in the fp32 graph's form, or with ``native`` as the model gives it. Where the model
        has a step prologue, ``feeds`` may hold its values (``prepare``); else it runs on the fp32 graph's
        inputs in ``feeds`` first."""
        feeds = onnxrun.run_with_prologue(self.path, self.session, feeds, self.prologue)
        forms = self.handoff
        for name, shape in self.inputs.items():
            if name not in feeds:
                raise SdnpuError(f"{self.name} needs input {name!r}")
            got = list(np.shape(feeds[name]))
            if name in forms and not handoff.is_bf16(feeds[name]):
                got = handoff.graph_shape(got, forms[name])
            if len(got) != len(shape) or any(s not in (-1, g) for s, g in zip(shape, got, strict=True)):
                raise SdnpuError(f"{self.name}: input {name!r} has shape {got}, the model takes {shape}",
                                 hint="converted models have static shapes: convert again with another RES")
        names = outputs or self.outputs
        return dict(zip(names, onnxrun.run(self.session, names, feeds, native), strict=True))


def weight_bytes(path: Path) -> int:
    """The bytes of the model at ``path`` and its external data."""
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def choose_optimize(path: Path | list[Path], reference: bool) -> bool:
    """Whether onnxruntime's graph optimizations fit. They make a dispatch model run about as fast as the
    fp32 graph on a CPU (the reference bodies are inlined, convolutions go to onnxruntime's blocked layout)
    but fold every bf16 weight's cast into an fp32 copy: the SDXL UNet's 5.1 GB of bf16 weights peaked at
    18.3 GB in `sdnpu verify` with them on (14.4 GB off). On where four times the weight bytes (twice for an
    fp32 graph) fit in 80% of the memory available now. Several models (a stage's: the UNet and its
    ControlNets, open together) count together, one choice for all: chosen one by one, each after the
    one before had opened but not yet run, the full-size ControlNet beside the UNet was given them and the
    step ran out of memory."""
    need = sum(weight_bytes(p) for p in ([path] if isinstance(path, Path) else path)) * (2 if reference else 4)
    available = available_bytes()
    return available is not None and need < 0.8 * available


def dd_cache_dir(model: Path) -> Path | None:
    """The folder to give as ``dd_cache``: the model's own, where a DD cache (``cache`` or ``.cache``) sits
    beside the model, as AMD's SD runtime looks for it; None where there is none."""
    folder = model.parent
    return folder if any((folder / name).is_dir() for name in DD_CACHE_NAMES) else None


def session_options(model: Path, custom_ops: Path | None, optimize: bool, threads: int | None = None) -> Any:
    """SessionOptions for ``model``: with ``custom_ops``, AMD's recipe (graph optimizations off, the DD
    config entries, then the library); without, onnxruntime's optimizations as ``optimize`` says."""
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    if custom_ops is None:
        opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                         else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
        return opts
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    cache = dd_cache_dir(model)
    if cache is not None:
        opts.add_session_config_entry("dd_cache", cache.as_posix())
    else:
        log.info("%s: no DD cache (%s) beside it; the library builds one", model, " or ".join(DD_CACHE_NAMES))
    opts.add_session_config_entry("onnx_custom_ops_const_key", model.as_posix())
    try:  # after the config entries: the library reads them when it registers
        opts.register_custom_ops_library(str(custom_ops))
    except Exception as e:  # onnxruntime's own error: not a library, wrong ABI, missing dependencies
        raise SdnpuError(f"onnxruntime cannot register the custom-op library {custom_ops}: {e}",
                         hint="give AMD's onnx_custom_ops library from a Ryzen AI installation") from e
    return opts


def component_path(folder: Path, component: str, reference: bool = False, size: Any = None,
                   batch: int | None = None) -> Path:
    """The graph to open for ``folder/<component>``: its dispatch model (or with ``reference``, its fp32
    graph) at ``size`` (a ``Size``; None: the primary, the folder's first) and, for a denoiser, ``batch`` (None:
    the first it has at that size). A size or batch the component was not converted at is an error listing those
    it was, with the ``--add`` that adds it."""
    comp_dir = Path(folder) / component
    have = [] if component in TEXT_ENCODERS else sizes_of(comp_dir)
    if (size is None and batch is None) or not have:  # a text encoder, the primary, or nothing converted
        path = comp_dir / (REFERENCE_MODEL if reference else DISPATCH_MODEL)
    else:
        size = Size.of(size) if size is not None else (have[0].size if have else None)
        match = next((f for f in have if f.size == size and (batch is None or f.batch in (None, batch))), None)
        if match is None:
            at = size if batch is None else Variant(size, batch)  # type: ignore[arg-type]
            listed = ", ".join(dict.fromkeys(str(f.variant if batch is not None else f.size) for f in have)) or (
                "none recorded")
            raise SdnpuError(f"{comp_dir} is not converted at {at} (converted: {listed})",
                             hint=f"add it: {add_command(Path(folder), component, size, batch)}")
        path = comp_dir / (match.model if reference else match.dispatch)
    if not reference and not path.is_file() and (comp_dir / QNN_MODEL).is_file() and (
            path.name == DISPATCH_MODEL.name and _is_primary(comp_dir, size, batch)):
        path = comp_dir / QNN_MODEL  # converted for Qualcomm's HTP (--target qnn-htp): its EPContext model
    if reference and not path.is_file():
        fp32_graph.require(comp_dir, "run (--reference runs the fp32 graphs)")
    if not path.is_file():
        raise SdnpuError(f"{path} not found",
                         hint=f"convert it first: make convert MODEL={component} (OUT={Path(folder)})")
    return path


def is_qnn_folder(folder: Path) -> bool:
    """A folder converted for Qualcomm's HTP (``--target qnn-htp``): its components have QNN's compiled models
    and no dispatch models."""
    comps = [d for d in Path(folder).iterdir() if d.is_dir()] if Path(folder).is_dir() else []
    return any((d / QNN_MODEL).is_file() for d in comps) and not any((d / DISPATCH_MODEL).is_file() for d in comps)


def _is_primary(comp_dir: Path, size: Any, batch: int | None) -> bool:
    """Whether ``size`` / ``batch`` (None: the primary's) are the component's primary graph's, the one a QNN
    folder has."""
    have = sizes_of(comp_dir)
    if not have or (size is None and batch is None):
        return True
    first = have[0]
    return (size is None or Size.of(size) == first.size) and (batch is None or first.batch in (None, batch))


def batches_at(folder: Path, component: str, size: Any = None) -> list[int]:
    """The batches ``folder/<component>`` is converted at, at ``size`` (None: the primary's), the primary's
    first; a folder that does not record them: the batch of its graph's first input."""
    have = sizes_of(Path(folder) / component)
    if not have:
        return []
    size = Size.of(size) if size is not None else have[0].size
    return list(dict.fromkeys(f.batch for f in have if f.size == size and f.batch is not None))


def add_command(folder: Path, component: str, size: Any, batch: int | None) -> str:
    """The ``sdnpu convert ... --add`` that adds ``size`` (and ``batch``) to ``folder``'s ``component``."""
    comps = _sized_components(folder, component)
    if batch is not None:
        comps = [c for c in comps if batched(c)]
    return (f"sdnpu convert --source {_source_of(folder / component)} --model {','.join(comps)} --out {folder}"
            + (f" --res {size}" if size is not None else "") + (f" --batch {batch}" if batch is not None else "")
            + " --add")


def _sized_components(folder: Path, first: str) -> list[str]:
    """The components of a converted folder whose graphs depend on the image size, ``first`` first."""
    return [first, *(c for c in SIZED if c != first and (folder / c / "export.json").is_file())]


def _source_of(comp_dir: Path) -> str:
    """The --source a component folder was converted from (its export.json), for a hint."""
    try:
        src = json.loads((comp_dir / "export.json").read_text())["source"]
        return str(src["name"] if src.get("kind") == "preset" else src["path"])
    except (OSError, ValueError, KeyError):
        return "SOURCE"


def open_component(folder: Path, component: str, reference: bool = False,
                   options: RuntimeOptions | None = None, size: Any = None,
                   shared: SharedWeights | None = None, batch: int | None = None) -> Component:
    """``folder/<component>``'s dispatch model (or with ``reference``, its fp32 graph) in a session, at
    ``size`` (None: the primary) and ``batch`` (a denoiser's; None: its first at that size); ``shared``: weights
    shared with the other sessions given the same."""
    path = component_path(folder, component, reference, size, batch)
    return open_component_path(path, component, reference, options or RuntimeOptions(),
                               comp_dir=Path(folder) / component, shared=shared)


_ARENA: list[bool] = []


def _register_shared_arena() -> None:
    """Register, once per process, a CPU arena in onnxruntime's environment that sessions opened with
    ``session.use_env_allocators`` use instead of an arena of their own (onnxruntime's way to share an
    allocator between sessions)."""
    if _ARENA:
        return
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
    ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
    _ARENA.append(True)


class SharedWeights:
    """One copy in memory of the weights that several sessions read from the same data files: the sizes of a
    component (``sdnpu.convert.shared``) point their graphs into one file, and this hands each session the
    same onnxruntime values for them (``SessionOptions.add_initializer``, onnxruntime's way to share
    initializers between sessions: the value's buffer is used in place, not copied), and one arena for their
    activations (``_register_shared_arena``). The buffers are read-only maps of the files, kept here for as
    long as this object lives, which must be as long as the sessions."""

    def __init__(self) -> None:
        self._maps: dict[str, np.ndarray] = {}
        self._values: dict[tuple[Any, ...], Any] = {}
        _register_shared_arena()

    def add_to(self, path: Path, opts: Any, skip: set[str] | frozenset[str] = frozenset()) -> int:
        """Give ``opts`` the shared value of every external initializer of the model at ``path`` (but those in
        ``skip``); returns how many."""
        import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

        proto = onnx.load(str(path), load_external_data=False)
        n = 0
        for t in proto.graph.initializer:
            where = external.place(t)
            if where is None or where[2] is None or t.name in skip:
                continue
            file = os.path.realpath(path.parent / where[0])
            offset, length = where[1], where[2]
            key = (file, offset, length, t.data_type, tuple(t.dims))
            value = self._values.get(key)
            if value is None:
                whole = self._maps.get(file)
                if whole is None:
                    whole = self._maps[file] = np.memmap(file, dtype=np.uint8, mode="r")
                raw = whole[offset:offset + length]
                if t.data_type == onnx.TensorProto.BFLOAT16:
                    value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                        raw.view(np.uint16).reshape(tuple(t.dims)), onnx.TensorProto.BFLOAT16)
                else:
                    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
                    value = ort.OrtValue.ortvalue_from_numpy(raw.view(dtype).reshape(tuple(t.dims)))
                self._values[key] = value
            opts.add_initializer(t.name, value)
            n += 1
        # one arena for the activations of every session, where each would keep its own, grown to its
        # largest run: two UNet sizes sharing the weights but not the arena peaked at 1.43x one size
        opts.add_session_config_entry("session.use_env_allocators", "1")
        return n

    @property
    def tensors(self) -> int:
        return len(self._values)


def open_component_path(path: Path, component: str, reference: bool = False,
                        options: RuntimeOptions | None = None, comp_dir: Path | None = None,
                        shared: SharedWeights | None = None) -> Component:
    """A session over the model at ``path``, the component ``component`` of a converted folder (at
    ``comp_dir``, whose LoRAs it gets; default: the folder ``path`` lies in); ``shared``: see
    ``SharedWeights``."""
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    options = options or RuntimeOptions(optimize=False)
    if not reference and path.name == QNN_MODEL.name and path.parent.name == QNN_MODEL.parent.name:
        return _open_qnn(path, component, options)
    npu = options.custom_ops is not None and not reference and (
        component not in TEXT_ENCODERS or options.npu_text_encoders)
    library = options.custom_ops if npu else None
    if comp_dir is None:
        comp_dir = path.parent if reference else path.parent.parent
    packed = path.parent / PACKED_DIR / path.name
    if npu and packed.is_file():  # sdnpu pack's copy: AMD's loading format, what AMD's library loads
        path = packed
    package = not reference and ddpackage.is_package(path)
    if package and not npu:
        raise SdnpuError(f"{path} is in AMD's loading format (DynamicDispatch nodes, sdnpu pack): only AMD's "
                         "custom-op library runs it",
                         hint="give --custom-ops (AMD's onnx_custom_ops library), or use the folder it was packed from")
    if package and (options.loras or read_manifest(comp_dir / "dd") is not None):
        raise SdnpuError(f"{component}: LoRAs do not reach AMD's packed form (its weights are in the DD cache's "
                         "constant files)",
                         hint="fuse the LoRA before packing (sdnpu convert --lora ... --pack), or run without "
                              "--custom-ops")
    optimize = options.optimize if options.optimize is not None else choose_optimize(path, reference)
    opts = session_options(path, library, optimize and library is None, options.threads)
    manifest = _overlay_beside(path, comp_dir, component, reference, options.loras)
    if manifest is not None:  # the folder's overlay, read in place: the session maps it as it maps the base
        arrays, loras, replaced = {}, manifest["loras"], len(manifest["tensors"])
    else:
        arrays, loras = lora_initializers(comp_dir, component, reference, options.loras, path)
        replaced = len(arrays)
    try:
        if manifest is not None:
            model: str | bytes = relocate_to_overlay(path, opts, manifest)
        else:
            model = replace_initializers(path, opts, arrays) if arrays else str(path)
        if shared is not None:  # after the LoRAs: the tensors they replace are not the shared ones
            shared.add_to(path, opts, skip=set(arrays) | set(manifest["tensors"] if manifest else ()))
        elif options.shared_arena:
            _register_shared_arena()
            opts.add_session_config_entry("session.use_env_allocators", "1")
        session = ort.InferenceSession(model, opts, providers=[CPU])
    except SdnpuError:
        raise
    except Exception as e:  # onnxruntime's own errors: a corrupt file, missing external data, ...
        raise SdnpuError(f"onnxruntime cannot open {path}: {e}") from e
    how = (f"custom ops {library.name}, graph optimizations off" if library is not None else
           f"reference bodies on the CPU, graph optimizations {'on' if optimize else 'off'}")
    if loras:
        names = ", ".join(f"{x['name']}:{x['scale']:g}" for x in loras)
        how += f"; LoRA {names} ({replaced} weights replaced)"
    spec = prologue.of_session(session)
    if spec is not None:
        how += f"; its step prologue {spec.file}"
    log.info("%s: %s (%s)", component, path, how)
    return Component(component, path, session, opts, library, loras, arrays,
                     onnxrun.open_prologue(spec.path(path)) if spec is not None else None)


def _open_qnn(path: Path, component: str, options: RuntimeOptions) -> Component:
    """A session over QNN's EPContext model (``--target qnn-htp``) on Qualcomm's HTP: the NPU on a Snapdragon
    machine, the emulator elsewhere (slow: seconds to minutes a call at test size, and nothing of the NPU's
    speed). It was compiled for one HTP generation, which the report beside it names."""
    # the qnn-htp backend where its target runs (onnxruntime with it): the CLI starts without them (25-45 ms)
    from sdnpu.backends import qnn_htp

    if options.loras:
        raise SdnpuError(f"{component}: LoRAs do not reach a QNN model (its weights are in QNN's context binary)",
                         hint="fuse the LoRA at conversion: sdnpu convert --target qnn-htp --lora FILE")
    if options.custom_ops is not None:
        raise SdnpuError(f"{component}: {path} is compiled for Qualcomm's HTP; --custom-ops is AMD's library",
                         hint="drop --custom-ops for a folder converted with --target qnn-htp")
    report = path.with_name("report.json")
    arch = json.loads(report.read_text()).get("qnn", {}).get("arch") if report.is_file() else None
    htp = qnn_htp.HtpOptions(qnn_htp.parse_arch(arch), fallback=True, threads=options.threads)
    try:
        session = qnn_htp.session(path, htp)
    except SdnpuError:
        raise
    except Exception as e:  # onnxruntime's or QNN's own errors: a context for another HTP, a missing binary
        raise SdnpuError(f"onnxruntime-qnn cannot open {path}: {' '.join(str(e).split())[:300]}",
                         hint="convert it again with --target qnn-htp (and the --htp-arch of this machine)") from None
    where = "the HTP emulator (x86-64: slow, not the NPU's speed)" if qnn_htp.is_emulated() else "the NPU"
    log.info("%s: %s (Qualcomm's HTP %s, on %s)", component, path, htp.arch.arch, where)
    return Component(component, path, session, None, None, None, None, None)


def _overlay_beside(path: Path, comp_dir: Path, component: str, reference: bool, specs: tuple[Any, ...]
                    ) -> dict[str, Any] | None:
    """The manifest of the overlay (``sdnpu lora apply``) that the dispatch model at ``path`` can read in
    place: the component's own ``dd/replaced.onnx`` (its ``dd/lora/`` lies below it), no LoRAs given."""
    if reference or specs or component not in LORA_COMPONENTS or path.resolve().parent != (comp_dir / "dd").resolve():
        return None
    manifest = read_manifest(comp_dir / "dd")
    if manifest is None or path.resolve() == (comp_dir / DISPATCH_MODEL).resolve():
        return manifest
    names = primary_names(comp_dir / DISPATCH_MODEL, path)  # another size: its own names for the same tensors
    return {**manifest, "tensors": {names.get(k, k): v for k, v in manifest["tensors"].items()}}


def primary_names(primary: Path, path: Path) -> dict[str, str]:
    """For a graph of another size (``path``), which shares the primary graph's data file: the primary's name
    of each tensor -> its name in ``path``, matched by the place in the shared file (by name where a tensor
    is stored inside the graph)."""
    def places(p: Path) -> dict[tuple[str, ...], str]:
        out = {}
        for t in onnx.load(str(p), load_external_data=False).graph.initializer:
            where = external.place(t)
            if where is not None:
                out[(os.path.realpath(p.parent / where[0]), str(where[1]))] = t.name
            else:
                out[("inline", t.name)] = t.name
        return out

    theirs = places(path)
    return {name: theirs[place] for place, name in places(primary).items() if place in theirs}


def relocate_to_overlay(path: Path, opts: Any, manifest: dict[str, Any]) -> bytes:
    """The model at ``path`` with each tensor the overlay replaces read from the overlay's data file instead
    (its external-data entry pointed at ``lora/weights.data``, offset and length; an initializer stored in
    the model file becomes external too). onnxruntime then maps the overlay as it maps the base data, and
    loads neither twice: opening the SDXL UNet so peaks at 0.19 GB, against 9.57 GB with the same tensors
    given through ``add_external_initializers`` (``bench/bench_lora_open.py``)."""
    proto = onnx.load(str(path), load_external_data=False)
    tensors = manifest["tensors"]
    found = 0
    for t in proto.graph.initializer:
        entry = tensors.get(t.name)
        if entry is None:
            continue
        if t.data_type != entry["data_type"] or list(t.dims) != entry["shape"]:
            raise SdnpuError(f"the LoRA overlay's {t.name} does not match {path}",
                             hint="sdnpu lora remove, then apply the LoRAs again")
        external.point(t, f"{OVERLAY_DIR}/{DATA}", entry["offset"], entry["length"])
        found += 1
    if found != len(tensors):
        raise SdnpuError(f"{path} lacks {len(tensors) - found} of the LoRA overlay's tensors",
                         hint="the overlay belongs to another compilation: sdnpu lora remove, then apply again")
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return proto.SerializeToString()


def lora_initializers(comp_dir: Path, component: str, reference: bool, specs: tuple[Any, ...],
                      path: Path | None = None) -> tuple[dict[str, np.ndarray], list[dict[str, Any]] | None]:
    """The initializers LoRAs replace in the component at ``comp_dir`` (its dispatch model, or with
    ``reference`` its fp32 graph) and the LoRAs: ``specs`` computed now, else the component's overlay
    (``sdnpu lora apply``: mapped from its file for a dispatch model; for the fp32 graph, computed again
    from the overlay's LoRA files, so that both carry the same LoRAs)."""
    if component not in LORA_COMPONENTS:
        return {}, None
    if not specs:
        manifest = read_manifest(comp_dir / "dd")
        if manifest is None:
            return {}, None
        if not reference:
            return _renamed(overlay_initializers(comp_dir / "dd")[0], comp_dir, path), manifest["loras"]
        specs = tuple(overlay.manifest_specs(manifest))
    arrays, loras = overlay.compute_in_memory(comp_dir, [s if isinstance(s, LoraSpec) else LoraSpec.parse(s)
                                                         for s in specs], reference)
    return _renamed(arrays, comp_dir, path), loras


def _renamed(arrays: dict[str, np.ndarray], comp_dir: Path, path: Path | None) -> dict[str, np.ndarray]:
    """``arrays`` (by the primary graph's names) by the names of the graph at ``path`` (another size's)."""
    if path is None or not arrays:
        return arrays
    primary = comp_dir / (REFERENCE_MODEL if path.parent.resolve() == comp_dir.resolve() else DISPATCH_MODEL)
    if path.resolve() == primary.resolve():
        return arrays
    names = primary_names(primary, path)
    return {names.get(k, k): v for k, v in arrays.items()}


def replace_initializers(path: Path, opts: Any, arrays: dict[str, np.ndarray]) -> str | bytes:
    """What to open so that ``arrays`` replace the initializers of the same names in the model at ``path``.
    Those the file keeps in external data are replaced through onnxruntime's external-initializer API
    (``add_external_initializers``: the arrays are used in place, and must outlive the session), and the
    model is opened from its path. onnxruntime refuses that for an initializer stored inside the model
    file (a small model's, or a tensor under 1 KB), so those are written into a copy of the model's
    protobuf, opened from memory with its external data still read from beside ``path``."""
    proto = onnx.load(str(path), load_external_data=False)
    inline = {t.name: t for t in proto.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL}
    missing = sorted(set(arrays) - {t.name for t in proto.graph.initializer})
    if missing:
        raise SdnpuError(f"{path} has no initializer {missing[0]!r} to replace",
                         hint="the LoRA overlay belongs to another compilation: sdnpu lora remove, then apply again")
    external = {n: a for n, a in arrays.items() if n not in inline}
    if external:
        add_initializers(opts, external)
    if not arrays.keys() & inline.keys():
        return str(path)
    for name, a in arrays.items():
        if name in inline:
            inline[name].CopyFrom(numpy_helper.from_array(np.asarray(a), name))
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return proto.SerializeToString()


def add_initializers(opts: Any, arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` replace the model's (external) initializers of the same names: onnxruntime's
    external-initializer API. The arrays are used in place and must outlive the session."""
    import onnxruntime as ort  # onnxruntime at first use: the CLI starts without it (20-30 ms)

    names, values = [], []
    for name, a in arrays.items():
        if a.dtype.name == "bfloat16":
            value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(np.uint16), TensorProto.BFLOAT16)
        else:
            value = ort.OrtValue.ortvalue_from_numpy(a)
        names.append(name)
        values.append(value)
    opts.add_external_initializers(names, values)
