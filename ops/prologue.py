"""Step prologues: the CPU work on a denoising step's inputs that several dispatch models share, as a model of
its own.

Each step, a ControlNet and the UNet that takes its residuals (``unet_controlnet``) read the same inputs:
the latents (NCHW fp32, which both turn NHWC and cast to bf16), the timestep and SDXL's time ids (both turn
them into the same sinusoids on the CPU, then cast), the text embeddings (cast). Left in each graph, that
work runs once per model per step. The prologue pass (``sdnpu.passes.prologue``) moves it out of such a
dispatch model into ``dd/prologue.onnx``: the dispatch model then takes the prologue's outputs (named
``prologue.<input>``) as its inputs, and the model records the prologue (metadata ``sdnpu.prologue``: its
file, beside the model, the graph inputs it reads, the values it gives, and a digest of what it computes).
Two dispatch models whose prologues have the same digest compute the same values from the same inputs: the
runtime runs that prologue once per step and hands its values to both (``sdnpu.runtime.pipeline``). A
dispatch model run alone runs its own prologue first (``run_with``), so every caller can give it the fp32
graph's inputs, as before.

The prologue is plain CPU work (the boundary cast's reference body is onnx's Cast, which rounds to nearest
even as CastAvx does); its shapes are symbolic, so every size of a component shares one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError

KEY = "sdnpu.prologue"
FILE = "prologue.onnx"
PREFIX = "prologue."


@dataclass(frozen=True)
class Prologue:
    """What a dispatch model records of its prologue."""

    file: str  # beside the dispatch model
    digest: str  # of what it computes: equal digests, equal values from equal inputs
    inputs: tuple[str, ...]  # the graph inputs (the fp32 graph's) it reads
    outputs: tuple[str, ...]  # the values it gives, inputs of the dispatch model

    def encode(self) -> str:
        return json.dumps({"file": self.file, "digest": self.digest, "inputs": list(self.inputs),
                           "outputs": list(self.outputs)})

    def path(self, model: str | Path) -> Path:
        """The prologue's file for the dispatch model at ``model``."""
        return Path(model).parent / self.file


def decode(text: str | None) -> Prologue | None:
    if not text:
        return None
    d = json.loads(text)
    return Prologue(d["file"], d["digest"], tuple(d["inputs"]), tuple(d["outputs"]))


def of_proto(model: Any) -> Prologue | None:
    """The prologue of an ``onnx.ModelProto``; None where it has none."""
    return decode(next((p.value for p in model.metadata_props if p.key == KEY), None))


def of_session(session: Any) -> Prologue | None:
    """The prologue of an onnxruntime session's model; None where it has none."""
    return decode(session.get_modelmeta().custom_metadata_map.get(KEY))


def require(path: Path) -> Path:
    """``path``, a prologue's file, or one line saying it is missing."""
    if not path.is_file():
        raise SdnpuError(f"{path} not found: the dispatch model beside it takes the values it computes",
                         hint="copy the component's dd/ folder whole, or convert the component again")
    return path


def open_session(path: Path) -> Any:
    """A plain CPU session over a prologue (it is CPU work: the boundary cast runs its reference body)."""
    import onnxruntime as ort

    require(path)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own errors: a truncated or corrupt file
        raise SdnpuError(f"onnxruntime cannot open the step prologue {path}: {e}",
                         hint="copy the component's dd/ folder whole again, or convert the component again") from e


def run(session: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The prologue's values for ``feeds`` (the fp32 graph's inputs), in the form the dispatch model takes
    them (bf16 where it takes bf16)."""
    from sdnpu.ops import handoff

    names = [o.name for o in session.get_outputs()]
    wanted = [i.name for i in session.get_inputs()]
    missing = [k for k in wanted if k not in feeds]
    if missing:
        raise SdnpuError(f"the step prologue needs input {missing[0]!r}",
                         hint=f"give the fp32 graph's inputs: {', '.join(wanted)}")
    got = handoff.run(session, names, {k: feeds[k] for k in wanted}, native=True)
    return dict(zip(names, got, strict=True))


def run_with(model: Path, session: Any, feeds: Mapping[str, np.ndarray], prologue_session: Any = None
             ) -> dict[str, np.ndarray]:
    """``feeds`` for the dispatch model at ``model`` (its onnxruntime ``session``): where it has a prologue and
    ``feeds`` lack the prologue's values, they are computed from ``feeds`` (with ``prologue_session`` where the
    caller keeps one open) and added; only the model's own inputs are kept."""
    p = of_session(session)
    out = dict(feeds)
    if p is not None and any(n not in out for n in p.outputs):
        out.update(run(prologue_session or open_session(p.path(model)), out))
    inputs = {i.name for i in session.get_inputs()}
    return {k: v for k, v in out.items() if k in inputs}


def output_shapes(path: Path, shapes: Mapping[str, list[int]]) -> dict[str, list[int]]:
    """The shapes of a prologue's outputs for inputs of ``shapes`` (the size a dispatch model is re-derived
    for): the prologue run once on zeros (it is a few element-wise ops and a transpose)."""
    session = open_session(path)
    dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}
    feeds = {i.name: np.zeros(shapes[i.name], dtypes.get(i.type, np.float32)) for i in session.get_inputs()}
    return {k: list(v.shape) for k, v in run(session, feeds).items()}
