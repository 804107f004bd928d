"""The family table: every model family sdnpu knows, one row each, and the questions the stages ask of it.

A *family* is the kind of pipeline a converted folder is (the diffusers pipeline that reads it): it decides the
denoiser's class and wrapper, which outputs of the text encoders the pipeline reads, the generation defaults,
the timestep the denoiser takes, which components a LoRA reaches, how the denoiser converts block by block and
which runtime loop draws with it. The rows are in the order a pipeline is told by (``detect``): the most
specific first, SD 1.x/2.x, what nothing else says, last.

========== ========== =========================== ===================== ============== ==================== ==========
name       title      denoiser                    said by               text encoders  LoRAs reach          runtime
========== ========== =========================== ===================== ============== ==================== ==========
qwen-image Qwen-Image QwenImageTransformer2DModel its class, QwenImage* Qwen2.5-VL     none yet             qwenimage
flux       Flux.1     FluxTransformer2DModel      its class, Flux*      CLIP-L, T5     transformer, CLIP-L  flux
sd3        SD3        SD3Transformer2DModel       its class, SD3*       CLIP-L, -G, T5 none yet             sd3
sdxl       SDXL       UNet2DConditionModel        text_encoder_2        CLIP-L, CLIP-G UNets, CLIP encoders text2image
sd         SD 1.x     UNet2DConditionModel        nothing else          CLIP-L         UNets, CLIP encoders text2image
========== ========== =========================== ===================== ============== ==================== ==========

Qwen-Image has its own VAE (``AutoencoderKLQwenImage``: Wan 2.1's causal 3-D VAE, one frame, its latents
normalized by per-channel ``latents_mean`` / ``latents_std``), its own wrappers (the transformer on packed latents
with the caption's mask, the VAE on 5-D tensors of one frame), its text encoder's class (Qwen2.5-VL, whose language
model's last hidden states are the prompt), ``QwenImagePipeline``'s defaults (50 steps, ``true_cfg_scale`` 4,
512 prompt tokens; a drawing size of 128 latent pixels a side), timestep (diffusers' / 1000) and block-by-block
pieces.

Flux.1 also has its own transformer wrapper (packed latents and position ids), generation defaults
(``FluxPipeline``'s 28 steps at guidance 3.5, embedded), timestep (diffusers' / 1000) and block-by-block pieces.

*Detection* (``detect``, from a ``model_index.json``): the first row that the index says, where a row is said by
its denoiser's class under its denoiser's key (a class no other row has), by the pipeline's ``_class_name``
prefix (``FluxPipeline``, ``StableDiffusion3Pipeline``: "Flux*", "SD3*" above), or by a module it alone has
among the rows left (SDXL's ``text_encoder_2``: SD3 and Flux.1 have one too, but their rows come first); else
SD 1.x/2.x (``DEFAULT``).

The modules a family has of its own are named as strings (``blockwise``, ``runtime``) and imported where they
are used (``load``), so that this module stays on the ground floor: it imports no torch and no stage, and every
stage may ask it. Family names are the currency between the stages (``sdnpu.specs.ComponentSpec.family``, the
packaging's tables); ``named`` gives the row of one, None meaning unknown, read as SD 1.x's.

Adding a family: docs/design.md's checklist ("Adding a model family").
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from sdnpu.errors import SdnpuError

_NOTHING: Mapping[str, Any] = MappingProxyType({})  # a read-only empty mapping, the rows' default


@dataclass(frozen=True, eq=False)  # one row a family: rows compare (and hash) by identity
class Family:
    name: str  # what folders, specs and the packaging call it ("sdxl")
    title: str  # how a sentence names it ("SDXL")
    article: str  # "an SDXL pipeline", "a Flux.1 pipeline": as the title is read aloud
    pipeline: str  # diffusers' pipeline class: it reads the family's LoRA files and loads them
    denoiser: str  # the denoiser's module (model_index.json's key): "unet" or "transformer"
    denoiser_class: str  # diffusers' class of the denoiser
    text_encoders: tuple[str, ...]  # the text encoders its pipeline runs, in order
    lora: tuple[str, ...]  # the components a LoRA reaches (``sdnpu lora``, ``--lora``); () takes none
    runtime: str  # the runtime loop that draws with it, "module:class" (``load``)
    pipeline_prefix: str | None = None  # a model_index.json whose ``_class_name`` starts so is of the family
    marker: str | None = None  # a module that says the family where no class does (SDXL's text_encoder_2)
    # component wrapper -> the family's own, for a module of its denoiser class (``sdnpu.components.wrapper_of``)
    wrappers: Mapping[str, str] = field(default_factory=lambda: _NOTHING)
    # what its pipeline reads of the CLIP encoders (``sdnpu.specs.pipeline_outputs``), beside the penultimate
    # hidden states and the projection's text_embeds that SDXL and SD3 read:
    clip_pooled_only: bool = False  # a CLIP encoder without a projection gives its pooled output alone (the
    # prompt is T5's: Flux.1's CLIP-L)
    clip_last_hidden: bool = False  # text_encoder's last_hidden_state is the prompt (SD 1.x/2.x; Flux.1's CLIP-L
    # where it has a projection)
    # diffusers' pipeline's defaults where they are not the usual 30 steps at guidance 5: the keyword arguments
    # of ``sdnpu.formats.generation.Generation`` (a folder's generation.json says otherwise)
    generation: Mapping[str, Any] = field(default_factory=lambda: _NOTHING)
    timestep_divisor: int = 1  # the denoiser takes diffusers' timestep divided by this (Flux.1's: 1000)
    blockwise: str | None = None  # the module of its denoiser's block-by-block pieces (``pieces``, ``whole_module``)
    vae_class: str = "AutoencoderKL"  # diffusers' class of its VAE; its ``wrappers`` apply to a VAE of its own
    # class too (``of_module_class``)
    sample_size: int | None = None  # the latent side its pipeline draws at by default, where its denoiser's config
    # names none (``QwenImagePipeline.default_sample_size``); None: the VAE's ``sample_size`` in pixels

    @property
    def a_pipeline(self) -> str:
        """"an SD3 pipeline": the family in a sentence."""
        return f"{self.article} {self.title} pipeline"

    def detects(self, index: Mapping[str, Any]) -> bool:
        """Whether ``index`` (a ``model_index.json``) says this family: by its denoiser's class, where no other
        row shares it, by the pipeline's class (``pipeline_prefix``) or by its ``marker`` module."""
        if self.denoiser_class in _OWN_CLASSES and module_class(index, self.denoiser) == self.denoiser_class:
            return True
        if self.pipeline_prefix is not None and str(index.get("_class_name", "")).startswith(self.pipeline_prefix):
            return True
        return self.marker is not None and module_class(index, self.marker) is not None


QWEN_IMAGE = Family(
    "qwen-image", "Qwen-Image", "a", "QwenImagePipeline", "transformer", "QwenImageTransformer2DModel",
    text_encoders=("text_encoder",),  # Qwen2.5-VL's language model
    lora=(),  # not supported yet
    runtime="sdnpu.runtime.qwenimage:QwenImagePipeline",
    pipeline_prefix="QwenImage",
    wrappers=MappingProxyType({"Transformer": "QwenImageTransformer",  # packed latents, the caption's mask
                               "VaeEncoder": "QwenImageVaeEncoder", "VaeDecoder": "QwenImageVaeDecoder"}),
    generation=MappingProxyType({"steps": 50, "guidance": 4.0}),  # QwenImagePipeline's (true_cfg_scale 4)
    timestep_divisor=1000,
    blockwise="sdnpu.convert.blockwise.qwenimage",
    vae_class="AutoencoderKLQwenImage",
    sample_size=128,  # QwenImagePipeline.default_sample_size: 1024 px at the VAE's 8
)
FLUX = Family(
    "flux", "Flux.1", "a", "FluxPipeline", "transformer", "FluxTransformer2DModel",
    text_encoders=("text_encoder", "text_encoder_2"),  # CLIP-L (pooled), T5
    lora=("text_encoder", "transformer"),  # its T5 takes none, as in diffusers
    runtime="sdnpu.runtime.flux:FluxPipeline",
    pipeline_prefix="Flux",
    wrappers=MappingProxyType({"Transformer": "FluxTransformer"}),  # packed latents, position ids
    clip_pooled_only=True,
    clip_last_hidden=True,
    generation=MappingProxyType({"steps": 28, "guidance": 3.5, "embedded_guidance": True}),  # FluxPipeline's
    timestep_divisor=1000,
    blockwise="sdnpu.convert.blockwise.flux",
)
SD3 = Family(
    "sd3", "SD3", "an", "StableDiffusion3Pipeline", "transformer", "SD3Transformer2DModel",
    text_encoders=("text_encoder", "text_encoder_2", "text_encoder_3"),  # T5 optional, as in diffusers
    lora=(),  # not supported yet
    runtime="sdnpu.runtime.sd3:SD3Pipeline",
    pipeline_prefix="StableDiffusion3",
)
SDXL = Family(
    "sdxl", "SDXL", "an", "StableDiffusionXLPipeline", "unet", "UNet2DConditionModel",
    text_encoders=("text_encoder", "text_encoder_2"),
    lora=("text_encoder", "text_encoder_2", "unet", "unet_controlnet"),
    runtime="sdnpu.runtime.text2image:Pipeline",
    marker="text_encoder_2",
)
SD = Family(
    "sd", "SD 1.x", "an", "StableDiffusionPipeline", "unet", "UNet2DConditionModel",
    text_encoders=("text_encoder",),
    lora=("text_encoder", "text_encoder_2", "unet", "unet_controlnet"),  # as SDXL's (a second CLIP, if any)
    runtime="sdnpu.runtime.text2image:Pipeline",
    clip_last_hidden=True,
)

TABLE: tuple[Family, ...] = (QWEN_IMAGE, FLUX, SD3, SDXL, SD)  # the order ``detect`` asks them in
DEFAULT = SD  # the family of a folder nothing else says (and of an unknown one: ``named(None)``)
_ROWS = {f.name: f for f in TABLE}
NAMES: tuple[str, ...] = tuple(_ROWS)
# denoiser classes one row alone has: they say the family (UNet2DConditionModel is SDXL's and SD 1.x's)
_OWN_CLASSES = frozenset(c for c, n in Counter(f.denoiser_class for f in TABLE).items() if n == 1)
# the denoisers' modules, each once, the oldest family's first (a pipeline has one): the one present sets a
# pipeline's resolution (``sdnpu.specs``), and diffusers loads a LoRA into them with ``load_lora_adapter``
DENOISER_MODULES: tuple[str, ...] = tuple(dict.fromkeys(f.denoiser for f in reversed(TABLE)))


def named(name: str | None) -> Family:
    """The row of family ``name`` (None: unknown, read as ``DEFAULT``'s), or one line listing the valid ones."""
    if name is None:
        return DEFAULT
    try:
        return _ROWS[name]
    except KeyError:
        raise SdnpuError(f"unknown model family {name!r}", hint=f"valid families: {', '.join(NAMES)}") from None


def module_class(index: Mapping[str, Any], key: str) -> str | None:
    """The class ``index`` (a ``model_index.json``) gives module ``key``; None where it has none (absent, or
    ``[null, null]``)."""
    entry = index.get(key)
    return str(entry[1]) if isinstance(entry, list) and len(entry) == 2 and entry[1] else None


def detect(index: Mapping[str, Any]) -> Family:
    """The family of the pipeline a ``model_index.json`` describes: the first row it says (``Family.detects``:
    Flux.1's or SD3's transformer or pipeline class, SDXL's second CLIP encoder), else SD 1.x/2.x."""
    return next((f for f in TABLE if f.detects(index)), DEFAULT)


def marked_by(modules: Iterable[str]) -> Family | None:
    """The family that module keys alone say, without their classes (a folder of one module, named for what it
    is: ``text_encoder_2``, SDXL's), or None."""
    present = set(modules)
    return next((f for f in TABLE if f.marker is not None and f.marker in present), None)


def of_class(cls_name: str | None) -> Family | None:
    """The first family whose denoiser is of class ``cls_name`` (a module config's ``_class_name``), or None.
    Rows that share a class agree on what is asked of one (``wrappers``, ``timestep_divisor``, whether LoRAs
    reach it): the tests hold them to it."""
    return next((f for f in TABLE if f.denoiser_class == cls_name), None)


def of_module_class(cls_name: str | None) -> Family | None:
    """The family whose own module ``cls_name`` is: its denoiser's class (``of_class``), else the first row whose
    VAE is of that class (a VAE class of one family alone: Qwen-Image's ``AutoencoderKLQwenImage``). Its
    ``wrappers`` say the wrapper of such a module."""
    return of_class(cls_name) or next((f for f in TABLE if f.vae_class == cls_name), None)


def load(path: str) -> Any:
    """What a row names as a string, imported now: ``"package.module"`` or ``"package.module:attribute"``. The
    rows name the modules a family has of its own this way so that this module imports none of them."""
    module, _, attr = path.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attr) if attr else loaded
