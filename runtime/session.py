"""onnxruntime sessions for converted folders: the dispatch model (``dd/replaced.onnx``) or the fp32 graph.

Where onnxruntime-vitisai is installed, ``VitisAIExecutionProvider`` is offered first (with its options
passed through) and claims the dispatch ops by name; otherwise the CPU provider runs them through the
reference bodies every dispatch model carries.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError

log = logging.getLogger(__name__)

VITISAI = "VitisAIExecutionProvider"
CPU = "CPUExecutionProvider"
DISPATCH_MODEL = Path("dd") / "replaced.onnx"
REFERENCE_MODEL = Path("model.onnx")


def providers(vitisai_options: dict[str, str] | None = None) -> list[Any]:
    """The providers to offer, best first: VitisAI where this onnxruntime has it, then the CPU."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    chosen: list[Any] = []
    if VITISAI in available:
        chosen.append((VITISAI, vitisai_options or {}))
    chosen.append(CPU)
    return chosen


@dataclass
class Component:
    """One component's session, with its input names and static shapes."""

    name: str
    path: Path
    session: Any

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


def _available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def choose_optimize(path: Path, reference: bool) -> bool:
    """Whether onnxruntime's graph optimizations fit. They make a dispatch model run about as fast as the
    fp32 graph (the reference bodies are inlined, convolutions go to onnxruntime's blocked layout) but fold
    every bf16 weight's cast into an fp32 copy: the SDXL UNet's 5.1 GB of bf16 weights peaked at 18.3 GB in
    `sdnpu verify` with them on (14.4 GB off). On where four times the weight bytes (twice for an fp32
    graph) fit in 80% of the memory available now; at 512 px the UNet ran no faster with them on anyway."""
    need = _weight_bytes(path) * (2 if reference else 4)
    available = _available_bytes()
    return available is not None and need < 0.8 * available


def open_component(folder: Path, component: str, reference: bool = False, threads: int | None = None,
                   optimize: bool | None = None, vitisai_options: dict[str, str] | None = None) -> Component:
    """``folder/<component>``'s dispatch model (or with ``reference``, its fp32 graph) in a session.
    ``optimize``: onnxruntime's graph optimizations on or off; None chooses by memory (``choose_optimize``)."""
    import onnxruntime as ort

    path = Path(folder) / component / (REFERENCE_MODEL if reference else DISPATCH_MODEL)
    if not path.is_file():
        raise SdnpuError(f"{path} not found",
                         hint=f"convert it first: make convert MODEL={component} (OUT={Path(folder)})")
    if optimize is None:
        optimize = choose_optimize(path, reference)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_ALL if optimize
                                     else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    offered = providers(vitisai_options)
    try:
        session = ort.InferenceSession(str(path), opts, providers=offered)
    except Exception as e:  # onnxruntime's own errors: a corrupt file, missing external data, ...
        raise SdnpuError(f"onnxruntime cannot open {path}: {e}") from e
    log.info("%s: %s on %s, graph optimizations %s", component, path, ", ".join(session.get_providers()),
             "on" if optimize else "off")
    return Component(component, path, session)
