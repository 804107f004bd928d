"""Torch-free facts about diffusers pipelines that the export stage, the compiler driver, the runtime and the
benchmarks all read (the runtime never imports the export stage): each component's ONNX signature, the
resolution rule, the seeded sample inputs, and the outputs a pipeline reads.

Shapes, for an image of H x W pixels (``Size``; written WxH on the command line, a square as one number) and a
VAE that downsamples by ``f`` (8 for SD/SDXL):

=============== ================================================= =====================================
component       inputs                                            outputs
=============== ================================================= =====================================
text_encoder    input_ids [1, 77] int64                           last_hidden_state [1, 77, D],
                                                                  pooler_output [1, D], hidden_states.N
text_encoder_2  input_ids [1, 77] int64                           text_embeds [1, P], last_hidden_state,
                                                                  hidden_states.N
unet            sample [2, 4, H/f, W/f], timestep [] f32,          out_sample [2, 4, H/f, W/f]
                encoder_hidden_states [2, 77, X],
                text_embeds [2, P], time_ids [2, 6] (SDXL only)
unet_controlnet the UNet's, then down_block_additional_residuals.N,   out_sample [2, 4, H/f, W/f]
                mid_block_additional_residual (what a ControlNet
                writes, added where diffusers adds them)
controlnet      the UNet's, then controlnet_cond [2, 3, H, W],      down_block_res_samples.N,
                conditioning_scale [] f32                          mid_block_res_sample
vae_encoder     sample [1, 3, H, W]                                latent_parameters [1, 2L, H/f, W/f]
vae_decoder     latent_sample [1, L, H/f, W/f]                     sample [1, 3, H, W]
text_encoder_3  input_ids [1, 77] int64 (SD3's T5)                 last_hidden_state [1, 77, J]
transformer     hidden_states [2, 16, H/f, W/f], timestep [2] f32, out_sample [2, 16, H/f, W/f]
                encoder_hidden_states [2, 154, J],
                pooled_projections [2, P1 + P2] (SD3's MMDiT)
=============== ================================================= =====================================

The UNet and SD3's transformer run at batch 2 (classifier-free guidance: unconditional and conditional in one
call). A text encoder with a projection (``CLIPTextModelWithProjection``: SDXL's second, both of SD3's) gives
``text_embeds`` first. L is the VAE's latent channels (4; SD3's 16). SD3's prompt is CLIP's 77 tokens (both
CLIP encoders' hidden states side by side, zero-padded to T5's width J) then T5's 77: 154 in all, the length
AMD's SD3 NPU shapes use (diffusers defaults to 256 T5 tokens; its pipeline takes ``max_sequence_length=77``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from sdnpu.errors import SdnpuError

UNET_BATCH = 2  # classifier-free guidance runs both halves in one UNet call
SEQ_LEN = 77  # CLIP's context length
T5_SEQ_LEN = 77  # SD3's T5 tokens (diffusers' max_sequence_length)


class Size(NamedTuple):
    """An image size in pixels. Written ``WxH`` (width first, as image tools and SDXL's bucket lists write
    it: ``1152x896`` is 1152 wide, 896 high), or one number for a square."""

    height: int
    width: int

    def __str__(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def square(self) -> bool:
        return self.height == self.width

    def to_json(self) -> dict[str, int]:
        return {"height": self.height, "width": self.width}

    @classmethod
    def of(cls, res: int | str | tuple[int, int] | Size) -> Size:
        """``res`` as a Size: a side (a square), ``"WxH"`` or ``"N"``, or (height, width)."""
        if isinstance(res, cls):
            return res
        if isinstance(res, str):
            return cls.parse(res)
        if isinstance(res, tuple):
            return cls(int(res[0]), int(res[1]))
        return cls(int(res), int(res))

    @classmethod
    def parse(cls, text: str) -> Size:
        text = text.strip().lower()
        if "," in text or text in SIZE_LISTS:
            raise SdnpuError(f"{text!r} is a list of sizes; one size is taken here",
                             hint="give one size, WxH (1152x896) or a side (1024); `sdnpu convert --res` takes lists")
        m = re.fullmatch(r"(\d+)(?:\s*[x\*]\s*(\d+))?", text)
        if not m:
            raise SdnpuError(f"cannot read the size {text!r}", hint="write WxH in pixels (1152x896) or one "
                             "number for a square (1024)")
        width = int(m[1])
        return cls(int(m[2]) if m[2] else width, width)


# SDXL's standard aspect-ratio buckets (WxH), the square first: the nine of the sizes issue, each about one
# megapixel, each side a multiple of 64.
SDXL_BUCKETS = ("1024x1024", "1152x896", "896x1152", "1216x832", "832x1216", "1344x768", "768x1344",
                "1536x640", "640x1536")
SIZE_LISTS = {"sdxl-buckets": SDXL_BUCKETS}
# The components whose graphs depend on the image size: converted at every size of --res (the text encoders
# once).
SIZED = ("unet", "unet_controlnet", "vae_encoder", "vae_decoder", "controlnet", "transformer")


def parse_sizes(spec: int | str | Size | Sequence[int | str | Size]) -> list[Size]:
    """``--res`` -> the sizes, in the order given, each once: one size, a comma-separated list of them, or a
    named list (``sdxl-buckets``), which may be mixed (``sdxl-buckets,1024x576``)."""
    items: list[int | str | Size]
    if isinstance(spec, str):
        items = []
        for part in spec.split(","):
            part = part.strip().lower()
            if not part:
                continue
            items.extend(SIZE_LISTS.get(part, (part,)))
    elif isinstance(spec, (int, Size)) or (isinstance(spec, tuple) and len(spec) == 2
                                           and all(isinstance(x, int) for x in spec)):
        items = [spec]  # type: ignore[list-item]
    else:
        items = list(spec)  # type: ignore[arg-type]
    if not items:
        raise SdnpuError(f"--res {spec!r} names no size",
                         hint="WxH (1152x896), a side (1024), a comma-separated list, or " + ", ".join(SIZE_LISTS))
    sizes: list[Size] = []
    for item in items:
        size = Size.of(item)
        if size not in sizes:
            sizes.append(size)
    return sizes


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Signature:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]


def vae_scale_factor(vae_config: dict[str, Any] | None) -> int:
    if not vae_config:
        return 8
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def unet_text_time(config: dict[str, Any]) -> bool:
    return config.get("addition_embed_type") == "text_time"


def clip_projection(component: str, config: dict[str, Any]) -> bool:
    """Whether a CLIP text encoder has the projection (``CLIPTextModelWithProjection``: pooled ``text_embeds``),
    from its config's ``architectures``; a config that names none: SDXL's rule (the second has it)."""
    arch = config.get("architectures")
    if isinstance(arch, list) and arch:
        return str(arch[0]) == "CLIPTextModelWithProjection"
    return component == "text_encoder_2"


def signature(component: str, config: dict[str, Any], res: int | Size, vae_factor: int = 8) -> Signature:
    """The static ONNX signature of ``component`` at image size ``res`` for a module ``config``."""
    size = Size.of(res)
    lh, lw = size.height // vae_factor, size.width // vae_factor
    f32, i64 = "float32", "int64"
    if component in ("text_encoder", "text_encoder_2"):
        n_hidden = config["num_hidden_layers"] + 1
        hidden = tuple(f"hidden_states.{i}" for i in range(n_hidden))
        first = ("text_embeds", "last_hidden_state") if clip_projection(component, config) else (
            "last_hidden_state", "pooler_output")
        return Signature((TensorSpec("input_ids", (1, SEQ_LEN), i64),), first + hidden)
    if component == "text_encoder_3":
        return Signature((TensorSpec("input_ids", (1, T5_SEQ_LEN), i64),), ("last_hidden_state",))
    if component == "transformer":
        return Signature((
            TensorSpec("hidden_states", (UNET_BATCH, config["in_channels"], lh, lw), f32),
            TensorSpec("timestep", (UNET_BATCH,), f32),
            TensorSpec("encoder_hidden_states", (UNET_BATCH, SEQ_LEN + T5_SEQ_LEN, config["joint_attention_dim"]), f32),
            TensorSpec("pooled_projections", (UNET_BATCH, config["pooled_projection_dim"]), f32),
        ), ("out_sample",))
    if component == "unet":
        inputs = [
            TensorSpec("sample", (UNET_BATCH, config["in_channels"], lh, lw), f32),
            TensorSpec("timestep", (), f32),
            TensorSpec("encoder_hidden_states", (UNET_BATCH, SEQ_LEN, config["cross_attention_dim"]), f32),
        ]
        if unet_text_time(config):
            n_time = 6  # original size (2), crop top-left (2), target size (2)
            text_dim = config["projection_class_embeddings_input_dim"] - n_time * config["addition_time_embed_dim"]
            inputs += [TensorSpec("text_embeds", (UNET_BATCH, text_dim), f32),
                       TensorSpec("time_ids", (UNET_BATCH, n_time), f32)]
        elif config.get("addition_embed_type") is not None or config.get("class_embed_type") is not None:
            raise SdnpuError(
                f"UNet with addition_embed_type={config.get('addition_embed_type')!r} / "
                f"class_embed_type={config.get('class_embed_type')!r} is not supported",
                hint="sdnpu exports SD 1.x/2.x UNets (no added conditioning) and SDXL's text_time UNet",
            )
        return Signature(tuple(inputs), ("out_sample",))
    if component == "unet_controlnet":  # the UNet, and the residuals a ControlNet adds to it
        base = signature("unet", config, size, vae_factor)
        shapes = residual_shapes(config, lh, lw)
        names = [residual_input(n) for n in controlnet_outputs(config)]
        return Signature((*base.inputs, *(TensorSpec(n, s, f32) for n, s in zip(names, shapes, strict=True))),
                         base.outputs)
    if component == "controlnet":  # the UNet's inputs, the control image and its scale (an input: no recompile)
        base = signature("unet", config, size, vae_factor)
        inputs = [*base.inputs,
                  TensorSpec("controlnet_cond", (UNET_BATCH, config.get("conditioning_channels", 3), size.height,
                                                 size.width), f32),
                  TensorSpec("conditioning_scale", (), f32)]
        return Signature(tuple(inputs), controlnet_outputs(config))
    if component == "vae_encoder":
        return Signature((TensorSpec("sample", (1, config["in_channels"], size.height, size.width), f32),),
                         ("latent_parameters",))
    if component == "vae_decoder":
        return Signature((TensorSpec("latent_sample", (1, config["latent_channels"], lh, lw), f32),),
                         ("sample",))
    raise KeyError(component)


def controlnet_outputs(config: dict[str, Any]) -> tuple[str, ...]:
    """A ControlNet's outputs, in the order diffusers passes them to the UNet (``down_block_additional_residuals``
    then ``mid_block_additional_residual``): one residual for conv_in, one per resnet of each down block and
    one per downsampler (every block but the last), then the mid block's."""
    n_blocks = len(config["down_block_types"])
    layers = config["layers_per_block"]
    per_block = list(layers) if isinstance(layers, (list, tuple)) else [layers] * n_blocks
    n = 1 + sum(per_block[i] + (i < n_blocks - 1) for i in range(n_blocks))
    return (*(f"down_block_res_samples.{i}" for i in range(n)), "mid_block_res_sample")


def residual_input(output: str) -> str:
    """A ControlNet output's name as ``unet_controlnet``'s input: diffusers' argument names
    (``down_block_res_samples.3`` -> ``down_block_additional_residuals.3``)."""
    return output.replace("res_samples", "additional_residuals").replace("res_sample", "additional_residual")


def handoff_values(component: str, config: dict[str, Any]) -> frozenset[str]:
    """The graph inputs and outputs of ``component`` that another dispatch model writes or reads, kept in the
    NPU's form (``sdnpu.ops.handoff``): a ControlNet's residuals, and the residual UNet's inputs for them."""
    if component == "controlnet":
        return frozenset(controlnet_outputs(config))
    if component == "unet_controlnet":
        return frozenset(residual_input(o) for o in controlnet_outputs(config))
    return frozenset()


def prologue_inputs(component: str, config: dict[str, Any]) -> frozenset[str]:
    """The graph inputs of ``component`` whose CPU work goes into the step prologue it shares with the other
    dispatch models of a step (``sdnpu.ops.prologue``): a ControlNet's and the residual UNet's UNet inputs
    (the latents, the timestep, the text, SDXL's added conditioning), which both read each step."""
    if component not in ("controlnet", "unet_controlnet"):
        return frozenset()
    return frozenset(spec.name for spec in signature("unet", config, 512).inputs)  # names: any size will do


def residual_shapes(config: dict[str, Any], lh: int, lw: int) -> list[tuple[int, ...]]:
    """The shapes of a ControlNet's residuals (``controlnet_outputs``' order) for latents of lh x lw: each down
    block's resnets at its resolution and channels, its downsampler at half, the mid block's at the last."""
    channels = list(config["block_out_channels"])
    n_blocks = len(config["down_block_types"])
    layers = config["layers_per_block"]
    per_block = list(layers) if isinstance(layers, (list, tuple)) else [layers] * n_blocks
    shapes = [(UNET_BATCH, channels[0], lh, lw)]
    h, w = lh, lw
    for i in range(n_blocks):
        shapes += [(UNET_BATCH, channels[i], h, w)] * per_block[i]
        if i < n_blocks - 1:
            h, w = -(-h // 2), -(-w // 2)
            shapes.append((UNET_BATCH, channels[i], h, w))
    return [*shapes, (UNET_BATCH, channels[-1], h, w)]


def resolution_step(component: str, config: dict[str, Any], vae_factor: int) -> int:
    """The resolution must be a multiple of this (each down block halves the latent, and the UNet's
    skip connections need the halves to line up again)."""
    if component in ("unet", "unet_controlnet", "controlnet"):
        return vae_factor * 2 ** (len(config["block_out_channels"]) - 1)
    if component == "transformer":  # latents cut into patch x patch tokens
        return vae_factor * int(config.get("patch_size", 2))
    return vae_factor


def sample_inputs(sig: Signature, config: dict[str, Any], res: int | Size, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded, realistic inputs: Gaussian latents and embeddings, a mid-schedule timestep, SDXL's
    time_ids for an uncropped image of size ``res`` (original and target (height, width), crop (0, 0), as
    diffusers writes them), and a CLIP token sequence (BOS, tokens, EOS, padding)."""
    h, w = Size.of(res)
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for spec in sig.inputs:
        if spec.name == "input_ids" and config.get("model_type") == "t5":  # tokens, </s> (1), <pad> (0)
            n = 12
            ids = np.zeros(spec.shape, dtype=np.int64)
            ids[:, :n] = rng.integers(3, min(32_000, config["vocab_size"]), size=(spec.shape[0], n))
            ids[:, n] = 1
            feeds[spec.name] = ids
        elif spec.name == "input_ids":
            vocab = config["vocab_size"]
            bos, eos = vocab - 2, vocab - 1
            ids = np.full(spec.shape, eos, dtype=np.int64)
            n = 12
            ids[:, 0] = bos
            ids[:, 1 : n + 1] = rng.integers(0, vocab - 2, size=(spec.shape[0], n))
            feeds[spec.name] = ids
        elif spec.name == "timestep":
            feeds[spec.name] = np.full(spec.shape, 500.0, dtype=np.float32)
        elif spec.name == "time_ids":
            feeds[spec.name] = np.tile(np.array([h, w, 0, 0, h, w], np.float32), (spec.shape[0], 1))
        elif spec.name == "sample" and len(spec.shape) == 4 and spec.shape[1] == 3:  # an image in [-1, 1]
            feeds[spec.name] = rng.uniform(-1, 1, size=spec.shape).astype(np.float32)
        elif spec.name == "controlnet_cond":  # a control image in [0, 1], as diffusers prepares it
            feeds[spec.name] = rng.uniform(0, 1, size=spec.shape).astype(np.float32)
        elif spec.name == "conditioning_scale":
            feeds[spec.name] = np.array(0.8, dtype=np.float32)
        else:
            feeds[spec.name] = rng.standard_normal(spec.shape, dtype=np.float32)
    return feeds


def default_resolution(unet_config: dict[str, Any] | None, vae_config: dict[str, Any] | None) -> int:
    """The resolution a pipeline was trained at, in pixels: the UNet's (or SD3 transformer's) sample size times
    the VAE's scale factor (1024 for SDXL and SD 3.5, 512 for SD 1.5); the VAE's own sample size without a
    UNet; else 1024."""
    if unet_config is not None:
        return int(unet_config["sample_size"]) * vae_scale_factor(vae_config)
    if vae_config is not None:
        return int(vae_config["sample_size"])
    return 1024


def check_resolution(res: int | Size, configs: dict[str, dict[str, Any]], vae_factor: int) -> None:
    """Stop, naming the nearest sizes that fit, when a component in ``configs`` cannot take ``res``."""
    size = Size.of(res)
    for comp, config in configs.items():
        if comp.startswith("text_encoder"):
            continue
        m = resolution_step(comp, config, vae_factor)
        if min(size) > 0 and not size.height % m and not size.width % m:
            continue
        if min(size) <= 0:
            raise SdnpuError(f"size {size} is not a positive number of pixels",
                             hint="RES is WxH in pixels (1152x896), or one number for a square (1024)")
        sides = [sorted({max(m, v // m * m), max(m, -(-v // m) * m)}) for v in (size.height, size.width)]
        near = sorted({Size(h, w) for h in sides[0] for w in sides[1]},
                      key=lambda s: (abs(s.height - size.height) + abs(s.width - size.width), s.width, s.height))
        raise SdnpuError(f"size {size} does not fit the {comp}: each side must be a multiple of {m}",
                         hint=f"the nearest that fit: {', '.join(str(s) for s in near[:4])}")


def pipeline_outputs(component: str, config: dict[str, Any], sdxl: bool) -> list[str] | None:
    """The outputs of ``component`` that a diffusers pipeline reads (None: all of them).

    The text encoders are exported with every hidden state (optimum's signature), but SDXL reads only the
    penultimate hidden states of both encoders and text_encoder_2's pooled ``text_embeds`` (SD3 the same of
    both its CLIP encoders: each has the projection); SD 1.x/2.x read ``last_hidden_state``. Every other output
    would cost a CastAvx on the CPU and, past the penultimate layer, NPU work nobody uses. The UNet, the
    transformer, SD3's T5 and the VAEs have one output.
    """
    if component not in ("text_encoder", "text_encoder_2"):
        return None
    if not sdxl and component == "text_encoder":
        return ["last_hidden_state"]
    penultimate = f"hidden_states.{int(config['num_hidden_layers']) - 1}"
    return ["text_embeds", penultimate] if clip_projection(component, config) else [penultimate]
