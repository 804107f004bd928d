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

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError
from sdnpu.memory import available_bytes

log = logging.getLogger(__name__)

CPU = "CPUExecutionProvider"
DISPATCH_MODEL = Path("dd") / "replaced.onnx"
REFERENCE_MODEL = Path("model.onnx")
CUSTOM_OPS_ENV = "SDNPU_CUSTOM_OPS"  # the custom-op library's path, where --custom-ops is not given
DD_CACHE_NAMES = ("cache", ".cache")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


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

    @property
    def inputs(self) -> dict[str, list[int]]:
        return {i.name: [d if isinstance(d, int) else -1 for d in i.shape] for i in self.session.get_inputs()}

    @property
    def outputs(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        for name, shape in self.inputs.items():
            if name not in feeds:
                raise SdnpuError(f"{self.name} needs input {name!r}")
            got = list(np.shape(feeds[name]))
            if len(got) != len(shape) or any(s not in (-1, g) for s, g in zip(shape, got, strict=True)):
                raise SdnpuError(f"{self.name}: input {name!r} has shape {got}, the model takes {shape}",
                                 hint="converted models have static shapes: convert again with another RES")
        names = outputs or self.outputs
        return dict(zip(names, self.session.run(names, feeds), strict=True))


def _weight_bytes(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)


def choose_optimize(path: Path, reference: bool) -> bool:
    """Whether onnxruntime's graph optimizations fit. They make a dispatch model run about as fast as the
    fp32 graph on a CPU (the reference bodies are inlined, convolutions go to onnxruntime's blocked layout)
    but fold every bf16 weight's cast into an fp32 copy: the SDXL UNet's 5.1 GB of bf16 weights peaked at
    18.3 GB in `sdnpu verify` with them on (14.4 GB off). On where four times the weight bytes (twice for an
    fp32 graph) fit in 80% of the memory available now."""
    need = _weight_bytes(path) * (2 if reference else 4)
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
    import onnxruntime as ort

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


def open_component(folder: Path, component: str, reference: bool = False,
                   options: RuntimeOptions | None = None) -> Component:
    """``folder/<component>``'s dispatch model (or with ``reference``, its fp32 graph) in a session."""
    path = Path(folder) / component / (REFERENCE_MODEL if reference else DISPATCH_MODEL)
    if not path.is_file():
        raise SdnpuError(f"{path} not found",
                         hint=f"convert it first: make convert MODEL={component} (OUT={Path(folder)})")
    return open_component_path(path, component, reference, options or RuntimeOptions())


def open_component_path(path: Path, component: str, reference: bool = False,
                        options: RuntimeOptions | None = None) -> Component:
    """A session over the model at ``path``, the component ``component`` of a converted folder."""
    import onnxruntime as ort

    options = options or RuntimeOptions(optimize=False)
    npu = options.custom_ops is not None and not reference and (
        component not in TEXT_ENCODERS or options.npu_text_encoders)
    library = options.custom_ops if npu else None
    optimize = options.optimize if options.optimize is not None else choose_optimize(path, reference)
    opts = session_options(path, library, optimize and library is None, options.threads)
    try:
        session = ort.InferenceSession(str(path), opts, providers=[CPU])
    except SdnpuError:
        raise
    except Exception as e:  # onnxruntime's own errors: a corrupt file, missing external data, ...
        raise SdnpuError(f"onnxruntime cannot open {path}: {e}") from e
    how = (f"custom ops {library.name}, graph optimizations off" if library is not None else
           f"reference bodies on the CPU, graph optimizations {'on' if optimize else 'off'}")
    log.info("%s: %s (%s)", component, path, how)
    return Component(component, path, session, opts, library)
