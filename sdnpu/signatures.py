"""Torch-free facts about each component's graph, from its module's config: its ONNX signature, a ControlNet's
residuals, and seeded sample inputs. The export stage, the compiler driver, the runtime and the benchmarks all
read them (the runtime never imports the export stage); ``sdnpu.specs`` gathers them per component.

Shapes, for an image of H x W pixels (``sdnpu.imagesize.Size``) and a VAE that downsamples by ``f`` (8 for
SD/SDXL):

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
transformer     hidden_states [1, N, 4L], timestep [1] f32,          out_sample [1, N, 4L]
(Flux.1)        encoder_hidden_states [1, T, J], pooled_projections
                [1, P], img_ids [N, 3], txt_ids [T, 3],
                guidance [1] (dev only)
text_encoder    input_ids [1, 34 + T] int64 (Qwen-Image's           last_hidden_state [1, 34 + T, J]
(Qwen-Image)    Qwen2.5-VL: the prompt template's tokens)
transformer     hidden_states [2, N, 4L], timestep [2] f32,          out_sample [2, N, 4L]
(Qwen-Image)    encoder_hidden_states [2, T, J],
                encoder_hidden_states_mask [2, T] int64
vae_encoder     sample [1, 3, 1, H, W] (one frame)                 latent_parameters [1, 2L, 1, H/f, W/f]
(Qwen-Image)
vae_decoder     latent_sample [1, L, 1, H/f, W/f]                  sample [1, 3, 1, H, W]
(Qwen-Image)
=============== ================================================= =====================================

Flux.1's transformer takes the latents packed as diffusers' ``FluxPipeline`` packs them: each 2 x 2 patch of
the L-channel latents one token of 4L values, N = (H/2f) (W/2f) tokens, with their position ids (0, row,
column) and T5's T tokens' (zeros); its timestep and guidance are diffusers' (the timestep divided by 1000).
Flux.1's ``text_encoder_2`` is T5 (``input_ids [1, T]``, T 512 by default: ``generation.json``'s
``max_sequence_length``), its CLIP-L gives the pooled prompt alone.

Qwen-Image's transformer takes the latents packed as Flux.1's (``QwenImagePipeline._pack_latents``), the
prompt's T tokens (512 by default: ``generation.json``'s ``max_sequence_length``) with their mask (1 for the
prompt's tokens, 0 for the padding after them); the image's shape (its rotary tables) is the graph's, fixed at
export. Its text encoder is Qwen2.5-VL's language model over the prompt template's tokens: the template's first
34 (``QwenImagePipeline.prompt_template_encode_start_idx``), then T for the prompt; its VAE works on one frame
of a video VAE's 5-D tensors.

The UNet, a ControlNet and SD3's transformer run at the denoiser's batch (``batched``; the table shows the
default, 2: classifier-free guidance's unconditional and conditional halves in one call; 1 for a guidance-free
model; a multiple of either for several images per call). A text encoder with a projection
(``CLIPTextModelWithProjection``: SDXL's second, both of SD3's) gives ``text_embeds`` first. L is the VAE's
latent channels (4; SD3's 16). SD3's prompt is CLIP's 77 tokens (both CLIP encoders' hidden states side by
side, zero-padded to T5's width J) then T5's 77: 154 in all, the length AMD's SD3 NPU shapes use (diffusers
defaults to 256 T5 tokens; its pipeline takes ``max_sequence_length=77``). Each signature is named by the
component's wrapper (``sdnpu.components``): the wrapper's ``forward`` takes these inputs in this order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from sdnpu import components, families
from sdnpu.errors import SdnpuError
from sdnpu.imagesize import Size

CFG_BATCH = 2  # classifier-free guidance runs both halves (unconditional, conditional) in one denoiser call
# The wrappers whose graphs take a denoiser's batch (``batched``); the others run at batch 1.
_BATCHED = frozenset({"Transformer", "FluxTransformer", "QwenImageTransformer", "UNet", "UNetResiduals",
                      "ControlNet"})
SEQ_LEN = 77  # CLIP's context length
T5_SEQ_LEN = 77  # SD3's T5 tokens (diffusers' max_sequence_length)
FLUX_T5_SEQ_LEN = 512  # Flux.1's T5 tokens, FluxPipeline's default max_sequence_length
QWEN_SEQ_LEN = 512  # Qwen-Image's prompt tokens, QwenImagePipeline's default max_sequence_length
QWEN_TEMPLATE_TOKENS = 34  # QwenImagePipeline.prompt_template_encode_start_idx: the template's tokens it drops
F32, I64 = "float32", "int64"


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
    if "temperal_downsample" in vae_config:  # a video VAE (Qwen-Image's): each entry one spatial halving
        return 2 ** len(vae_config["temperal_downsample"])
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def latent_channels(vae_config: dict[str, Any]) -> int:
    """The VAE's latent channels L: ``latent_channels`` (AutoencoderKL), ``z_dim`` (Qwen-Image's)."""
    return int(vae_config["z_dim"] if "z_dim" in vae_config else vae_config["latent_channels"])


def unet_text_time(config: dict[str, Any]) -> bool:
    return config.get("addition_embed_type") == "text_time"


def clip_projection(component: str, config: dict[str, Any]) -> bool:
    """Whether a CLIP text encoder has the projection (``CLIPTextModelWithProjection``: pooled ``text_embeds``),
    from its config's ``architectures``; a config that names none: SDXL's rule (the second has it)."""
    arch = config.get("architectures")
    if isinstance(arch, list) and arch:
        return str(arch[0]) == "CLIPTextModelWithProjection"
    return component == "text_encoder_2"


@dataclass(frozen=True)
class _At:
    """What a signature is made from: the component, its module's config, the image size, the latent size."""

    component: str
    config: dict[str, Any]
    size: Size
    latent: tuple[int, int]  # (H/f, W/f)
    batch: int  # the denoiser's batch (``batched`` components)
    text_len: int | None  # T5's tokens where the pipeline sets them; None: the family's default


def _text_encoder(at: _At) -> Signature:
    hidden = tuple(f"hidden_states.{i}" for i in range(at.config["num_hidden_layers"] + 1))
    first = ("text_embeds", "last_hidden_state") if clip_projection(at.component, at.config) else (
        "last_hidden_state", "pooler_output")
    return Signature((TensorSpec("input_ids", (1, SEQ_LEN), I64),), first + hidden)


def _t5_encoder(at: _At) -> Signature:
    length = at.text_len or (FLUX_T5_SEQ_LEN if at.component == "text_encoder_2" else T5_SEQ_LEN)
    return Signature((TensorSpec("input_ids", (1, length), I64),), ("last_hidden_state",))


def _qwen_text_encoder(at: _At) -> Signature:
    length = QWEN_TEMPLATE_TOKENS + (at.text_len or QWEN_SEQ_LEN)
    return Signature((TensorSpec("input_ids", (1, length), I64),), ("last_hidden_state",))


def _qwen_transformer(at: _At) -> Signature:
    c = at.config
    n, t = flux_tokens(at.latent), at.text_len or QWEN_SEQ_LEN
    return Signature((
        TensorSpec("hidden_states", (at.batch, n, c["in_channels"]), F32),
        TensorSpec("timestep", (at.batch,), F32),
        TensorSpec("encoder_hidden_states", (at.batch, t, c["joint_attention_dim"]), F32),
        TensorSpec("encoder_hidden_states_mask", (at.batch, t), I64),
    ), ("out_sample",))


def _qwen_vae_encoder(at: _At) -> Signature:
    c = at.config
    return Signature((TensorSpec("sample", (1, c.get("input_channels", 3), 1, at.size.height, at.size.width), F32),),
                     ("latent_parameters",))


def _qwen_vae_decoder(at: _At) -> Signature:
    return Signature((TensorSpec("latent_sample", (1, latent_channels(at.config), 1, *at.latent), F32),),
                     ("sample",))


def flux_tokens(latent: tuple[int, int]) -> int:
    """The image tokens of Flux.1's packed latents (one per 2 x 2 patch) for latents of ``latent``."""
    return (latent[0] // 2) * (latent[1] // 2)


def _flux_transformer(at: _At) -> Signature:
    c = at.config
    n, t = flux_tokens(at.latent), at.text_len or FLUX_T5_SEQ_LEN
    inputs = [
        TensorSpec("hidden_states", (at.batch, n, c["in_channels"]), F32),
        TensorSpec("timestep", (at.batch,), F32),
        TensorSpec("encoder_hidden_states", (at.batch, t, c["joint_attention_dim"]), F32),
        TensorSpec("pooled_projections", (at.batch, c["pooled_projection_dim"]), F32),
        TensorSpec("img_ids", (n, 3), F32),
        TensorSpec("txt_ids", (t, 3), F32),
    ]
    if c.get("guidance_embeds"):
        inputs.append(TensorSpec("guidance", (at.batch,), F32))
    return Signature(tuple(inputs), ("out_sample",))


def flux_image_ids(latent: tuple[int, int]) -> np.ndarray:
    """Flux.1's image position ids for latents of ``latent`` (diffusers' ``_prepare_latent_image_ids``): each
    packed token's (0, row, column)."""
    h, w = latent[0] // 2, latent[1] // 2
    ids = np.zeros((h, w, 3), np.float32)
    ids[..., 1] = np.arange(h, dtype=np.float32)[:, None]
    ids[..., 2] = np.arange(w, dtype=np.float32)[None, :]
    return ids.reshape(h * w, 3)


def _transformer(at: _At) -> Signature:
    c = at.config
    return Signature((
        TensorSpec("hidden_states", (at.batch, c["in_channels"], *at.latent), F32),
        TensorSpec("timestep", (at.batch,), F32),
        TensorSpec("encoder_hidden_states", (at.batch, SEQ_LEN + T5_SEQ_LEN, c["joint_attention_dim"]), F32),
        TensorSpec("pooled_projections", (at.batch, c["pooled_projection_dim"]), F32),
    ), ("out_sample",))


def _unet(at: _At) -> Signature:
    c = at.config
    inputs = [
        TensorSpec("sample", (at.batch, c["in_channels"], *at.latent), F32),
        TensorSpec("timestep", (), F32),
        TensorSpec("encoder_hidden_states", (at.batch, SEQ_LEN, c["cross_attention_dim"]), F32),
    ]
    if unet_text_time(c):
        n_time = 6  # original size (2), crop top-left (2), target size (2)
        text_dim = c["projection_class_embeddings_input_dim"] - n_time * c["addition_time_embed_dim"]
        inputs += [TensorSpec("text_embeds", (at.batch, text_dim), F32),
                   TensorSpec("time_ids", (at.batch, n_time), F32)]
    elif c.get("addition_embed_type") is not None or c.get("class_embed_type") is not None:
        raise SdnpuError(
            f"UNet with addition_embed_type={c.get('addition_embed_type')!r} / "
            f"class_embed_type={c.get('class_embed_type')!r} is not supported",
            hint="sdnpu exports SD 1.x/2.x UNets (no added conditioning) and SDXL's text_time UNet",
        )
    return Signature(tuple(inputs), ("out_sample",))


def _unet_residuals(at: _At) -> Signature:
    """The UNet, and the residuals a ControlNet adds to it."""
    base = _unet(at)
    shapes = residual_shapes(at.config, *at.latent, batch=at.batch)
    names = [residual_input(n) for n in controlnet_outputs(at.config)]
    return Signature((*base.inputs, *(TensorSpec(n, s, F32) for n, s in zip(names, shapes, strict=True))),
                     base.outputs)


def _controlnet(at: _At) -> Signature:
    """The UNet's inputs, the control image and its scale (an input: no recompile)."""
    image = (at.batch, at.config.get("conditioning_channels", 3), at.size.height, at.size.width)
    inputs = [*_unet(at).inputs, TensorSpec("controlnet_cond", image, F32), TensorSpec("conditioning_scale", (), F32)]
    return Signature(tuple(inputs), controlnet_outputs(at.config))


def _vae_encoder(at: _At) -> Signature:
    return Signature((TensorSpec("sample", (1, at.config["in_channels"], at.size.height, at.size.width), F32),),
                     ("latent_parameters",))


def _vae_decoder(at: _At) -> Signature:
    return Signature((TensorSpec("latent_sample", (1, at.config["latent_channels"], *at.latent), F32),), ("sample",))


_BY_WRAPPER: dict[str, Callable[[_At], Signature]] = {
    "TextEncoder": _text_encoder, "T5Encoder": _t5_encoder, "Transformer": _transformer,
    "FluxTransformer": _flux_transformer, "UNet": _unet,
    "UNetResiduals": _unet_residuals, "ControlNet": _controlnet, "VaeEncoder": _vae_encoder,
    "VaeDecoder": _vae_decoder, "QwenTextEncoder": _qwen_text_encoder, "QwenImageTransformer": _qwen_transformer,
    "QwenImageVaeEncoder": _qwen_vae_encoder, "QwenImageVaeDecoder": _qwen_vae_decoder,
}


def batched(component: str) -> bool:  # the row's wrapper: a Flux transformer is batched as SD3's
    """Whether ``component``'s graph takes the denoiser's batch (the UNets, a ControlNet, SD3's transformer): 2
    for classifier-free guidance's two halves, 1 for a guidance-free model, or that times the images per call."""
    return component in components.COMPONENTS and components.row(component).wrapper in _BATCHED


def check_batch(batch: int) -> int:
    """``batch`` as a denoiser's batch, or an error naming the fix."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise SdnpuError(f"batch {batch!r} is not a positive whole number",
                         hint=f"BATCH is the denoiser's batch: {CFG_BATCH} for guidance (both halves in one "
                         "call), 1 guidance-free, or that times the images each call draws")
    return batch


def signature(component: str, config: dict[str, Any], res: int | Size, vae_factor: int = 8,
              batch: int | None = None, text_len: int | None = None) -> Signature:
    """The static ONNX signature of ``component`` at image size ``res`` for a module ``config``; ``batch``: the
    denoiser's (``batched`` components; None: ``CFG_BATCH``), ignored by the others; ``text_len``: T5's
    tokens where the pipeline sets them (None: the family's default)."""
    size = Size.of(res)
    at = _At(component, config, size, (size.height // vae_factor, size.width // vae_factor),
             check_batch(batch) if batch is not None else CFG_BATCH, text_len)
    return _BY_WRAPPER[components.wrapper_of(component, config)](at)


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


def residual_shapes(config: dict[str, Any], lh: int, lw: int, batch: int = CFG_BATCH) -> list[tuple[int, ...]]:
    """The shapes of a ControlNet's residuals (``controlnet_outputs``' order) for latents of lh x lw at
    ``batch``: each down block's resnets at its resolution and channels, its downsampler at half, the mid
    block's at the last."""
    channels = list(config["block_out_channels"])
    n_blocks = len(config["down_block_types"])
    layers = config["layers_per_block"]
    per_block = list(layers) if isinstance(layers, (list, tuple)) else [layers] * n_blocks
    shapes = [(batch, channels[0], lh, lw)]
    h, w = lh, lw
    for i in range(n_blocks):
        shapes += [(batch, channels[i], h, w)] * per_block[i]
        if i < n_blocks - 1:
            h, w = -(-h // 2), -(-w // 2)
            shapes.append((batch, channels[i], h, w))
    return [*shapes, (batch, channels[-1], h, w)]


def _token_ids(spec: TensorSpec, config: dict[str, Any], rng: np.random.Generator) -> np.ndarray:
    """A seeded token sequence: T5's (tokens, ``</s>`` (1), ``<pad>`` (0)), Qwen2.5-VL's (tokens all through: its
    attention is causal, so the padding after a prompt changes none of the prompt's states) or CLIP's (BOS,
    tokens, EOS, padding)."""
    n = 12
    if config.get("model_type") == "qwen2_5_vl":
        vocab = (config.get("text_config") or config)["vocab_size"]
        return rng.integers(0, vocab, size=spec.shape).astype(np.int64)
    if config.get("model_type") == "t5":
        ids = np.zeros(spec.shape, dtype=np.int64)
        ids[:, :n] = rng.integers(3, min(32_000, config["vocab_size"]), size=(spec.shape[0], n))
        ids[:, n] = 1
        return ids
    vocab = config["vocab_size"]
    bos, eos = vocab - 2, vocab - 1
    ids = np.full(spec.shape, eos, dtype=np.int64)
    ids[:, 0] = bos
    ids[:, 1 : n + 1] = rng.integers(0, vocab - 2, size=(spec.shape[0], n))
    return ids


def sample_inputs(sig: Signature, config: dict[str, Any], res: int | Size, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded, realistic inputs: Gaussian latents and embeddings, a mid-schedule timestep, SDXL's
    time_ids for an uncropped image of size ``res`` (original and target (height, width), crop (0, 0), as
    diffusers writes them), and a CLIP token sequence (BOS, tokens, EOS, padding)."""
    h, w = Size.of(res)
    rng = np.random.default_rng(seed)
    family = families.of_class(config.get("_class_name"))
    divisor = family.timestep_divisor if family is not None else 1
    feeds: dict[str, np.ndarray] = {}
    for spec in sig.inputs:
        if spec.name == "input_ids":
            feeds[spec.name] = _token_ids(spec, config, rng)
        elif spec.name == "timestep":  # mid-schedule, as the denoiser takes it (Flux.1: diffusers' / 1000)
            feeds[spec.name] = np.full(spec.shape, 500.0 / divisor, dtype=np.float32)
        elif spec.name == "guidance":
            feeds[spec.name] = np.full(spec.shape, 3.5, dtype=np.float32)  # FluxPipeline's default
        elif spec.name == "img_ids":
            scale = (h * w / spec.shape[0]) ** 0.5  # pixels per token side: 2 f
            feeds[spec.name] = flux_image_ids((2 * round(h / scale), 2 * round(w / scale)))
        elif spec.name == "encoder_hidden_states_mask":  # the prompt's tokens, then a quarter of padding
            mask = np.ones(spec.shape, np.int64)
            mask[:, spec.shape[1] - spec.shape[1] // 4:] = 0
            feeds[spec.name] = mask
        elif spec.name == "txt_ids":
            feeds[spec.name] = np.zeros(spec.shape, np.float32)
        elif spec.name == "time_ids":
            feeds[spec.name] = np.tile(np.array([h, w, 0, 0, h, w], np.float32), (spec.shape[0], 1))
        elif spec.name == "sample" and len(spec.shape) >= 4 and spec.shape[1] == 3:  # an image in [-1, 1]
            feeds[spec.name] = rng.uniform(-1, 1, size=spec.shape).astype(np.float32)
        elif spec.name == "controlnet_cond":  # a control image in [0, 1], as diffusers prepares it
            feeds[spec.name] = rng.uniform(0, 1, size=spec.shape).astype(np.float32)
        elif spec.name == "conditioning_scale":
            feeds[spec.name] = np.array(0.8, dtype=np.float32)
        else:
            feeds[spec.name] = rng.standard_normal(spec.shape, dtype=np.float32)
    return feeds
