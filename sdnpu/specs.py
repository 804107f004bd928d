"""What the stages ask of a component, built once: ``ComponentSpec`` (its signature at a size, its resolution
rule, the outputs a pipeline reads, its handoff values and step-prologue inputs) from ``PipelineConfig``, a
pipeline's module configs read once. The rules themselves are the functions below; the export stage, the
compile stage and the runtime read them through a spec, or call them where they have one config at hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdnpu import components, families
from sdnpu.errors import SdnpuError
from sdnpu.imagesize import Size
from sdnpu.signatures import (
    Signature,
    batched,
    clip_projection,
    controlnet_outputs,
    residual_input,
    sample_inputs,
    signature,
    unet_text_time,
    vae_scale_factor,
)

# Wrappers whose module is a UNet's down path (the resolution rule of its skip connections).
_UNET_LIKE = frozenset({"UNet", "UNetResiduals", "ControlNet"})
# Wrappers that run each denoising step beside another dispatch model and share the step's inputs with it.
_STEP_SHARING = frozenset({"UNetResiduals", "ControlNet"})
FLUX_TABLE_INPUTS = frozenset({"img_ids", "txt_ids"})  # Flux.1's position ids: its rotary tables' only inputs


def _wrapper(component: str, config: dict[str, Any] | None = None) -> str | None:
    """The component's wrapper for a module of ``config`` (its kind of graph); None for a name that is not a
    component (a graph compiled alone, in a folder of another name)."""
    return components.wrapper_of(component, config) if component in components.COMPONENTS else None


def resolution_step(component: str, config: dict[str, Any], vae_factor: int) -> int:
    """The resolution must be a multiple of this (each down block halves the latent, and the UNet's
    skip connections need the halves to line up again)."""
    wrapper = _wrapper(component, config)
    if wrapper in _UNET_LIKE:
        return vae_factor * 2 ** (len(config["block_out_channels"]) - 1)
    if wrapper == "Transformer":  # latents cut into patch x patch tokens
        return vae_factor * int(config.get("patch_size", 2))
    if wrapper in ("FluxTransformer", "QwenImageTransformer"):  # the pipeline packs 2 x 2 latents into a token
        return vae_factor * 2
    return vae_factor


def default_resolution(unet_config: dict[str, Any] | None, vae_config: dict[str, Any] | None,
                       family: str | None = None) -> int:
    """The resolution a pipeline was trained at, in pixels: the UNet's (or SD3 transformer's) sample size times
    the VAE's scale factor (1024 for SDXL and SD 3.5, 512 for SD 1.5); the family's latent sample size times it
    where its denoiser's config has none (Qwen-Image: ``QwenImagePipeline``'s 128, 1024 px at the VAE's 8); the
    VAE's own sample size without a UNet or where the denoiser's config has none (Flux.1's transformer: its VAE's
    1024); else 1024."""
    if unet_config is not None and "sample_size" in unet_config:
        return int(unet_config["sample_size"]) * vae_scale_factor(vae_config)
    own = families.named(family).sample_size
    if own is not None:
        return own * vae_scale_factor(vae_config)
    if vae_config is not None and "sample_size" in vae_config:
        return int(vae_config["sample_size"])
    return 1024


def check_resolution(res: int | Size, configs: dict[str, dict[str, Any]], vae_factor: int) -> None:
    """Stop, naming the nearest sizes that fit, when a component in ``configs`` cannot take ``res``."""
    size = Size.of(res)
    for comp, config in configs.items():
        if components.row(comp).text_encoder:
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


def pipeline_outputs(component: str, config: dict[str, Any], family: str | None) -> list[str] | None:
    """The outputs of ``component`` that a diffusers pipeline of ``family`` (``sdnpu.families``' names) reads
    (None: all of them; family None: unknown, read as SD 1.x's).

    The text encoders are exported with every hidden state (optimum's signature), but SDXL reads only the
    penultimate hidden states of both encoders and text_encoder_2's pooled ``text_embeds`` (SD3 the same of
    both its CLIP encoders: each has the projection); SD 1.x/2.x read ``last_hidden_state``, Flux.1 CLIP-L's
    ``pooler_output`` alone (its prompt is T5's). Every other output would cost a CastAvx on the CPU and, past
    the penultimate layer, NPU work nobody uses. The UNet, the transformers, T5 and the VAEs have one output.
    """
    if component not in components.CLIP_ENCODERS or components.wrapper_of(component, config) != "TextEncoder":
        return None  # T5, Qwen2.5-VL: one output
    row = families.named(family)
    if row.clip_pooled_only and not clip_projection(component, config):
        return ["pooler_output"]
    if row.clip_last_hidden and component == "text_encoder":
        return ["last_hidden_state"]
    penultimate = f"hidden_states.{int(config['num_hidden_layers']) - 1}"
    return ["text_embeds", penultimate] if clip_projection(component, config) else [penultimate]


def handoff_values(component: str, config: dict[str, Any]) -> frozenset[str]:
    """The graph inputs and outputs of ``component`` that another dispatch model writes or reads, kept in the
    NPU's form (``sdnpu.formats.handoff``): a ControlNet's residuals, and the residual UNet's inputs for them."""
    wrapper = _wrapper(component)
    if wrapper == "ControlNet":
        return frozenset(controlnet_outputs(config))
    if wrapper == "UNetResiduals":
        return frozenset(residual_input(o) for o in controlnet_outputs(config))
    return frozenset()


def prologue_inputs(component: str, config: dict[str, Any]) -> frozenset[str]:
    """The graph inputs of ``component`` whose CPU work goes into its prologue (``sdnpu.formats.prologue``): a
    ControlNet's and the residual UNet's UNet inputs (the latents, the timestep, the text, SDXL's added
    conditioning), which both read each step; Flux.1's position ids, whose rotary tables are the same every
    step of a generation (the runtime computes them once per generation)."""
    if _wrapper(component, config) == "FluxTransformer":
        return FLUX_TABLE_INPUTS
    if _wrapper(component) not in _STEP_SHARING:
        return frozenset()
    return frozenset(spec.name for spec in signature("unet", config, 512).inputs)  # names: any size will do


@dataclass(frozen=True)
class ComponentSpec:
    """One component of a pipeline, as every stage asks about it: built once (``PipelineConfig.spec``)."""

    name: str
    config: dict[str, Any]  # its module's config.json
    vae_factor: int  # the pipeline VAE's scale factor (8 without a VAE)
    family: str | None  # its pipeline's (``sdnpu.families``' name); None: unknown
    text_len: int | None = None  # T5's tokens where the pipeline sets them (``generation.json``); None: the default

    @property
    def row(self) -> components.ComponentRow:
        return components.row(self.name)

    @property
    def module(self) -> str:
        return self.row.module

    def signature(self, res: int | Size, batch: int | None = None) -> Signature:
        return signature(self.name, self.config, res, self.vae_factor, batch, self.text_len)

    def sample_inputs(self, res: int | Size, seed: int = 0, batch: int | None = None) -> dict[str, np.ndarray]:
        return sample_inputs(self.signature(res, batch), self.config, res, seed)

    @property
    def batched(self) -> bool:
        """Whether its graph takes the denoiser's batch (``sdnpu.signatures.batched``)."""
        return batched(self.name)

    @property
    def resolution_step(self) -> int:
        return resolution_step(self.name, self.config, self.vae_factor)

    @property
    def pipeline_outputs(self) -> list[str] | None:
        return pipeline_outputs(self.name, self.config, self.family)

    @property
    def handoff(self) -> frozenset[str]:
        return handoff_values(self.name, self.config)

    @property
    def prologue(self) -> frozenset[str]:
        return prologue_inputs(self.name, self.config)


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline's module configs, each read once (``modules``: model_index.json's key -> config.json), its
    family (``sdnpu.families``' name; None: unknown) and T5's tokens where the pipeline sets them."""

    modules: Mapping[str, dict[str, Any]]
    family: str | None = None
    text_len: int | None = None

    def config(self, component: str) -> dict[str, Any]:
        return self.modules[components.module_of(component)]

    @property
    def vae(self) -> dict[str, Any] | None:
        return self.modules.get("vae")

    @property
    def vae_factor(self) -> int:
        return vae_scale_factor(self.vae)

    def spec(self, component: str) -> ComponentSpec:
        return ComponentSpec(component, self.config(component), self.vae_factor, self.family, self.text_len)

    def default_resolution(self) -> int:
        """The resolution the pipeline was trained at (``default_resolution``: 1024 for SDXL; a ControlNet
        alone: 1024 for SDXL's, 512 for SD 1.x's)."""
        if "unet" not in self.modules and "controlnet" in self.modules:
            return 1024 if unet_text_time(self.modules["controlnet"]) else 512
        denoiser = next((m for m in families.DENOISER_MODULES if m in self.modules), None)
        return default_resolution(self.modules[denoiser] if denoiser else None, self.vae, self.family)

    def check_resolution(self, res: int | Size, names: list[str]) -> None:
        """Stop, naming the nearest sizes that fit, when one of the components ``names`` cannot take ``res``."""
        check_resolution(res, {c: self.config(c) for c in names}, self.vae_factor)
