"""The component table: every component sdnpu converts, one row each, and the questions the stages ask of it.

A *component* is one exported graph of a pipeline; its *module* is the diffusers/transformers module it is
exported from (the VAE's encoder and decoder are two components of one module, and the UNet that takes a
ControlNet's residuals is the UNet). The rows are in the canonical order: the order components are converted,
listed and shown in (text encoders first, the VAE, the denoisers).

=============== =============== ===== ==== ============ ==============
name            module          sized LoRA text encoder wrapper
=============== =============== ===== ==== ============ ==============
text_encoder    text_encoder          yes  yes          TextEncoder
text_encoder_2  text_encoder_2        yes  yes          TextEncoder
text_encoder_3  text_encoder_3             yes          T5Encoder
vae_encoder     vae             yes                     VaeEncoder
vae_decoder     vae             yes                     VaeDecoder
unet            unet            yes   yes               UNet
unet_controlnet unet            yes   yes               UNetResiduals
controlnet      controlnet      yes                     ControlNet
transformer     transformer     yes   yes               Transformer
=============== =============== ===== ==== ============ ==============

A module of another class under the same key takes another wrapper (``wrapper_of``): Flux.1's
``text_encoder_2`` is T5 (``T5Encoder``), Qwen-Image's ``text_encoder`` Qwen2.5-VL (``QwenTextEncoder``), a
family's own denoiser or VAE takes its family's own (Flux.1's ``FluxTransformer``, Qwen-Image's
``QwenImageTransformer`` and its VAE's: the family's ``wrappers``, ``sdnpu.families``).

*sized*: its graph depends on the image size (converted at every size of ``--res``; the text encoders once).
*LoRA*: a LoRA can change it (``sdnpu lora``, ``--lora``) in a pipeline whose family takes LoRAs (the
family's ``lora``, ``sdnpu.families``: SDXL's and SD 1.x's UNet and CLIP encoders, Flux.1's transformer and
CLIP-L).
*wrapper*: the torch wrapper that gives its module
a positional, tuple-returning ``forward`` (``sdnpu.convert.wrappers``), and so its ONNX signature
(``sdnpu.signatures``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sdnpu import families
from sdnpu.errors import SdnpuError


@dataclass(frozen=True)
class ComponentRow:
    name: str
    module: str  # the pipeline module it is exported from (model_index.json's key)
    sized: bool  # its graph depends on the image size
    lora: bool  # a LoRA can change it
    text_encoder: bool
    wrapper: str  # the class in sdnpu.convert.wrappers; it also names the signature in sdnpu.signatures


TABLE: tuple[ComponentRow, ...] = (
    ComponentRow("text_encoder", "text_encoder", sized=False, lora=True, text_encoder=True, wrapper="TextEncoder"),
    ComponentRow("text_encoder_2", "text_encoder_2", sized=False, lora=True, text_encoder=True,
                 wrapper="TextEncoder"),
    ComponentRow("text_encoder_3", "text_encoder_3", sized=False, lora=False, text_encoder=True,
                 wrapper="T5Encoder"),  # SD3's T5
    ComponentRow("vae_encoder", "vae", sized=True, lora=False, text_encoder=False, wrapper="VaeEncoder"),
    ComponentRow("vae_decoder", "vae", sized=True, lora=False, text_encoder=False, wrapper="VaeDecoder"),
    ComponentRow("unet", "unet", sized=True, lora=True, text_encoder=False, wrapper="UNet"),
    ComponentRow("unet_controlnet", "unet", sized=True, lora=True, text_encoder=False,
                 wrapper="UNetResiduals"),  # the UNet taking a ControlNet's residuals
    ComponentRow("controlnet", "controlnet", sized=True, lora=False, text_encoder=False, wrapper="ControlNet"),
    ComponentRow("transformer", "transformer", sized=True, lora=True, text_encoder=False,
                 wrapper="Transformer"),  # SD3's MMDiT, Flux.1's transformer (LoRAs: Flux.1's)
)
_ROWS = {r.name: r for r in TABLE}

COMPONENTS: tuple[str, ...] = tuple(r.name for r in TABLE)  # every component, in the canonical order
SIZED: tuple[str, ...] = tuple(r.name for r in TABLE if r.sized)
LORA_COMPONENTS: tuple[str, ...] = tuple(r.name for r in TABLE if r.lora)
TEXT_ENCODERS: tuple[str, ...] = tuple(r.name for r in TABLE if r.text_encoder)
CLIP_ENCODERS: tuple[str, ...] = tuple(r.name for r in TABLE if r.wrapper == "TextEncoder")
MODULES: tuple[str, ...] = tuple(dict.fromkeys(r.module for r in TABLE))  # the pipeline modules, each once
LORA_MODULES: tuple[str, ...] = tuple(dict.fromkeys(r.module for r in TABLE if r.lora))  # what a LoRA file has parts for


def row(name: str) -> ComponentRow:
    """The row of component ``name``, or one line listing the valid ones."""
    try:
        return _ROWS[name]
    except KeyError:
        raise SdnpuError(f"unknown component {name!r}", hint=f"valid components: {', '.join(COMPONENTS)}") from None


def module_of(name: str) -> str:
    """The pipeline module component ``name`` is exported from."""
    return row(name).module


# text encoders that are no CLIP, by their config's model_type: T5 (SD3's third, Flux.1's second), Qwen2.5-VL
# (Qwen-Image's: its language model alone)
_TEXT_WRAPPERS = {"t5": "T5Encoder", "qwen2_5_vl": "QwenTextEncoder"}


def wrapper_of(name: str, config: dict[str, Any] | None = None) -> str:
    """The wrapper of component ``name`` for a module of ``config`` (its row's, unless the config names another
    class under the same key: T5 as Flux.1's ``text_encoder_2``; a family's own denoiser wrapper, Flux.1's)."""
    wrapper = row(name).wrapper
    if config is None:
        return wrapper
    if wrapper == "TextEncoder" and config.get("model_type") in _TEXT_WRAPPERS:
        return _TEXT_WRAPPERS[str(config["model_type"])]
    family = families.of_module_class(config.get("_class_name"))
    return family.wrappers.get(wrapper, wrapper) if family is not None else wrapper


_POSITION = {c: i for i, c in enumerate(COMPONENTS)}


def order_key(name: str) -> tuple[int, str]:
    """Sorts names in the canonical (display) order; names that are not components last, alphabetically."""
    return _POSITION.get(name, len(_POSITION)), name


def ordered(names: Iterable[str]) -> list[str]:
    """``names`` in the canonical (display) order (``order_key``)."""
    return sorted(names, key=order_key)
