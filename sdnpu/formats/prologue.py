"""The step-prologue record: what a dispatch model says of the model its CPU work on the step's inputs went to.

Each step, a ControlNet and the UNet that takes its residuals (``unet_controlnet``) read the same inputs:
the latents (NCHW fp32, which both turn NHWC and cast to bf16), the timestep and SDXL's time ids (both turn
them into the same sinusoids on the CPU, then cast), the text embeddings (cast). Left in each graph, that
work runs once per model per step. The prologue pass (``sdnpu.passes.prologue``) moves it out of such a
dispatch model into ``dd/prologue.onnx``: the dispatch model then takes the prologue's outputs (named
``prologue.<input>``) as its inputs, and the model records the prologue (metadata ``sdnpu.prologue``: its
file, beside the model, the graph inputs it reads, the values it gives, and a digest of what it computes).
Two dispatch models whose prologues have the same digest compute the same values from the same inputs: the
runtime runs that prologue once per step and hands its values to both (``sdnpu.runtime.text2image``). A
dispatch model run alone runs its own prologue first (``sdnpu.onnxrun.run_with_prologue``), so every caller
can give it the fp32 graph's inputs, as before.

Flux.1's transformer has one too: its rotary tables, computed from the position ids alone (``img_ids``,
``txt_ids``: the same every step of a generation). The runtime runs that prologue once a generation and hands
its tables to every step (``sdnpu.runtime.flux``); converted block by block, the stitched dispatch model's
prologue is cut after stitching (in a piece the tables are a graph output).

The prologue is plain CPU work (the boundary cast's reference body is onnx's Cast, which rounds to nearest
even as CastAvx does); its shapes are symbolic, so every size of a component shares one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdnpu.errors import SdnpuError
from sdnpu.formats.keys import PROLOGUE_KEY as KEY

__all__ = ["FILE", "KEY", "PREFIX", "Prologue", "decode", "of_proto", "of_session", "require"]

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
