"""ControlNets at run time: ``sdnpu generate --controlnet DIR --control-image edges.png [--control-scale 0.8]
[--control-start 0 --control-end 1]``, one or several.

As diffusers' ControlNet pipelines do: the control image is resized to the image size (PIL, Lanczos), read as
[0, 1] RGB, NCHW, and repeated for each row of the batch (both halves of classifier-free guidance); at each
step every ControlNet runs on the UNet's batch with its scale; outside its [start, end] share of the steps
(diffusers' ``controlnet_keep``) diffusers runs it at scale 0, whose residuals are 0: it does not run, and the
UNet adds zeros (the same numbers, one ControlNet run less a step). The residuals of several ControlNets are summed
(diffusers' ``MultiControlNetModel``) and go to the UNet that takes them (``unet_controlnet``). Between the
two dispatch models the residuals stay in the NPU's form (bf16, NHWC: ``sdnpu.formats.handoff``), with no
Transpose or cast on the CPU at either edge; several ControlNets' are summed in fp32 and rounded to bf16 once.
The CPU work on the step's inputs that the ControlNets and the UNet share runs once a step (their step
prologue, ``sdnpu.formats.prologue``). The fp32 graphs (``--reference``) pass
them as they write them (NCHW, fp32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError
from sdnpu.signatures import controlnet_outputs, residual_input, residual_shapes

__all__ = ["ControlSpec", "check_compatible", "config_of", "control_image", "controlnet_folder", "keep",
           "residual_inputs"]


@dataclass(frozen=True)
class ControlSpec:
    """One ControlNet of a generation: the converted folder (``OUT`` of ``sdnpu convert --model controlnet``,
    or its ``controlnet/``), the control image, its scale, and the share of the steps it acts on."""

    folder: str | Path
    image: str | Path
    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.start < self.end <= 1.0:
            raise SdnpuError(f"--control-start {self.start:g} and --control-end {self.end:g} are not a share of "
                             "the steps", hint="0 <= start < end <= 1 (default 0 and 1: every step)")


def controlnet_folder(path: str | Path) -> Path:
    """The folder that holds a converted ControlNet in ``controlnet/``: ``path`` itself, or its parent where
    ``path`` is the ``controlnet/`` folder."""
    p = Path(path)
    if (p / "controlnet" / "model.onnx").is_file():
        return p
    if p.name == "controlnet" and (p / "model.onnx").is_file():
        return p.parent
    raise SdnpuError(f"{p} holds no converted ControlNet (no controlnet/model.onnx)",
                     hint="convert it first: sdnpu convert --source <ControlNet folder or preset> --model controlnet "
                     "--out DIR, then give --controlnet DIR")


def config_of(folder: Path, component: str) -> dict[str, Any]:
    """``folder/<component>/config.json``, or one line saying it cannot be read."""
    try:
        return json.loads((folder / component / "config.json").read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError) as e:
        raise SdnpuError(f"cannot read {folder / component / 'config.json'}: {e}",
                         hint="the converted folder keeps each module's config.json: convert it again") from e


def check_compatible(controlnet: Path, pipeline: Path) -> None:
    """Refuse a ControlNet made for another base model than the pipeline's UNet: its text width, added
    conditioning or residuals (channels per block, layers) differ, so the UNet could not take them."""
    cn, unet = config_of(controlnet, "controlnet"), config_of(pipeline, "unet_controlnet")  # the UNet that takes them
    checks = [("cross_attention_dim (the text width)", cn.get("cross_attention_dim"), unet.get("cross_attention_dim")),
              ("addition_embed_type", cn.get("addition_embed_type"), unet.get("addition_embed_type")),
              ("residuals (channels and count per block)", residual_shapes(cn, 8, 8), residual_shapes(unet, 8, 8))]
    for what, theirs, ours in checks:
        if theirs != ours:
            raise SdnpuError(f"the ControlNet in {controlnet} was made for another base model: its {what} is "
                             f"{theirs}, the UNet of {pipeline} has {ours}",
                             hint="give a ControlNet trained for this base model (SDXL ControlNets for SDXL, SD 1.5 "
                             "ones for SD 1.5)")


def control_image(path: str | Path, size: tuple[int, int]) -> np.ndarray:
    """The control image for one row of the ControlNet's batch (the pipeline repeats it for each): [1, 3, H, W]
    float32 in [0, 1] for ``size`` (height, width). An image of another aspect ratio is refused (resizing would
    distort it); one of the same ratio is resized as diffusers does."""
    from PIL import Image, UnidentifiedImageError  # PIL at first use: the CLI starts without it (10 ms)

    h, w = size
    try:
        with Image.open(path) as im:
            picture = im.convert("RGB")
    except (OSError, UnidentifiedImageError) as e:
        raise SdnpuError(f"cannot read the control image {path}: {e}", hint="give a PNG or JPEG file") from e
    pw, ph = picture.size
    if abs(pw * h - ph * w) > 0.01 * ph * w:
        raise SdnpuError(f"the control image {path} is {pw}x{ph}, the image is {w}x{h}: another aspect ratio",
                         hint=f"crop it to {w}:{h}, or generate at its size (--width {pw} --height {ph}, converted "
                         "with --res)")
    if (pw, ph) != (w, h):
        picture = picture.resize((w, h), Image.Resampling.LANCZOS)
    pixels = np.asarray(picture, np.float32).transpose(2, 0, 1)[None] / 255.0
    return pixels.astype(np.float32)


def keep(step: int, steps: int, spec: ControlSpec) -> float:
    """1 where ``spec`` acts on ``step`` of ``steps``, else 0 (diffusers' ``controlnet_keep``)."""
    return 1.0 - float(step / steps < spec.start or (step + 1) / steps > spec.end)


def residual_inputs(config: dict[str, Any]) -> dict[str, str]:
    """ControlNet output -> the ``unet_controlnet`` input it feeds, in diffusers' order."""
    return {o: residual_input(o) for o in controlnet_outputs(config)}
