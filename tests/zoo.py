"""The zoo: small seeded modules with the public architectures of diffusers' and transformers' model classes,
one entry each, exported with torch's own exporters at static shapes and compiled with ``sdnpu compile``.

It is what a user of a conversion tool meets first: a model sdnpu has no preset for. Each entry follows the
architecture of a public model (its block types, norms, attention, embeddings, activations), scaled down to
seconds; the weights are drawn from a fixed seed (diffusers' and transformers' own initialization, with every
tensor they leave constant, the zero-initialized output layers and the ones of norms, drawn too, so that no
path is trivially exact). ``bench/bench_zoo.py`` writes the table of every entry; ``tests/test_zoo.py`` holds
each to the floor recorded in ``tests/zoo_floors.json``.

    python -m tests.zoo flux-dev dynamo /tmp/zoo      # export one entry and compile it, print its summary
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PRESETS = ROOT / "convert" / "presets"
SEED = 0
EXPORTERS = ("dynamo", "torchscript")


@dataclass(frozen=True)
class Built:
    """A module, the call that runs it on positional tensors (returning a tensor or a tuple of them), the
    example inputs and their names."""

    module: Any
    call: Callable[..., Any]
    inputs: tuple[Any, ...]
    names: tuple[str, ...]
    outputs: tuple[str, ...] = ("out",)


@dataclass(frozen=True)
class Member:
    name: str
    kind: str  # "unet", "transformer", "vae", "text"
    architecture: str  # the public model it follows
    build: Callable[[], Built]
    exporters: tuple[str, ...] = EXPORTERS
    why_not: dict[str, str] = field(default_factory=dict)  # exporter -> why it is not in the zoo


MEMBERS: dict[str, Member] = {}


def member(name: str, kind: str, architecture: str, exporters: tuple[str, ...] = EXPORTERS,
           why_not: dict[str, str] | None = None) -> Callable[[Callable[[], Built]], Callable[[], Built]]:
    def register(fn: Callable[[], Built]) -> Callable[[], Built]:
        MEMBERS[name] = Member(name, kind, architecture, fn, exporters, why_not or {})
        return fn

    return register


def _randn(*shape: int, seed: int = 1) -> Any:
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _preset_config(preset: str, module: str) -> dict[str, Any]:
    return json.loads((PRESETS / preset / module / "config.json").read_text())


def _diffusers(cls_name: str, **config: Any) -> Any:
    import diffusers

    return getattr(diffusers, cls_name).from_config(config)


# --- UNets ------------------------------------------------------------------------------------------------

def _unet(config: dict[str, Any], latent: int = 16, text: int = 8, channels: int | None = None,
          added: str | None = None) -> Built:
    """A UNet2DConditionModel at batch 2 (classifier-free guidance), with SDXL's added conditioning where its
    config has it (``added``: "text_time") or Kandinsky's image embedding ("image")."""
    import torch

    unet = _diffusers("UNet2DConditionModel", **config)
    c = channels or config["in_channels"]
    sample, t = _randn(2, c, latent, latent), torch.tensor(500.0)
    ctx = _randn(2, text, config["cross_attention_dim"] if added != "image" else config["encoder_hid_dim"], seed=2)
    if added == "text_time":
        pooled = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        time_ids = torch.tensor([[latent * 8.0, latent * 8.0, 0.0, 0.0, latent * 8.0, latent * 8.0]] * 2)
        return Built(unet, lambda m, s, t, e, p, ids: m(s, t, e, added_cond_kwargs={
            "text_embeds": p, "time_ids": ids}).sample, (sample, t, ctx, _randn(2, pooled, seed=3), time_ids),
            ("sample", "timestep", "encoder_hidden_states", "text_embeds", "time_ids"))
    if added == "image":
        image = _randn(2, config["encoder_hid_dim"], seed=3)
        return Built(unet, lambda m, s, t, e, i: m(s, t, e, added_cond_kwargs={"image_embeds": i}).sample,
                     (sample, t, ctx, image), ("sample", "timestep", "encoder_hidden_states", "image_embeds"))
    return Built(unet, lambda m, s, t, e: m(s, t, e).sample, (sample, t, ctx),
                 ("sample", "timestep", "encoder_hidden_states"))


@member("sd15-unet", "unet", "SD 1.5 UNet (conv proj_in, 8 heads)")
def _sd15() -> Built:
    return _unet(_preset_config("tiny-sd15", "unet"))


@member("sd2-unet", "unet", "SD 2.x UNet (v-prediction, upcast attention, linear proj_in, scale-shift resnets)")
def _sd2() -> Built:
    config = _preset_config("tiny-sd21", "unet")
    return _unet({**config, "upcast_attention": True, "use_linear_projection": True,
                  "resnet_time_scale_shift": "scale_shift"})


@member("sdxl-unet", "unet", "SDXL base UNet (text_time added conditioning)")
def _sdxl() -> Built:
    return _unet(_preset_config("tiny-sdxl", "unet"), added="text_time")


@member("ssd1b-unet", "unet", "SSD-1B / Segmind Vega UNet (uneven transformer depths, mid block without attention)")
def _ssd1b() -> Built:
    config = _preset_config("tiny-sdxl", "unet")
    return _unet({**config, "transformer_layers_per_block": [1, 1, 3],
                  "reverse_transformer_layers_per_block": [[3, 2, 1], [1, 1, 1], [1, 1, 1]],
                  "mid_block_type": "UNetMidBlock2D"}, added="text_time")


@member("sdxl-inpaint-unet", "unet", "SDXL inpainting UNet (9 input channels: latents, mask, masked-image latents)")
def _sdxl_inpaint() -> Built:
    config = _preset_config("tiny-sdxl", "unet")
    return _unet({**config, "in_channels": 9}, added="text_time")


@member("kandinsky22-unet", "unet", "Kandinsky 2.2 decoder UNet (image embedding conditioning, added-KV attention, "
        "scale-shift resnets)")
def _kandinsky() -> Built:
    config = {"in_channels": 4, "out_channels": 8, "block_out_channels": [32, 64], "layers_per_block": 1,
              "down_block_types": ["ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"],
              "up_block_types": ["SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"],
              "mid_block_type": "UNetMidBlock2DSimpleCrossAttn", "attention_head_dim": 16,
              "cross_attention_dim": 64, "encoder_hid_dim": 48, "encoder_hid_dim_type": "image_proj",
              "addition_embed_type": "image", "resnet_time_scale_shift": "scale_shift", "norm_num_groups": 16,
              "class_embed_type": None, "only_cross_attention": False, "sample_size": 16}
    return _unet(config, added="image")


@member("svd-unet", "unet", "Stable Video Diffusion UNetSpatioTemporalConditionModel (2 frames: temporal resnets and "
        "attention over frames, added time ids)")
def _svd() -> Built:
    import torch

    m = _diffusers("UNetSpatioTemporalConditionModel", sample_size=16, in_channels=8, out_channels=4,
                   down_block_types=["CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"],
                   up_block_types=["UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"],
                   block_out_channels=[32, 64], addition_time_embed_dim=8, projection_class_embeddings_input_dim=24,
                   layers_per_block=1, cross_attention_dim=32, num_attention_heads=[2, 4], num_frames=2)
    # SVD's pipeline: latents and the image latents in channels, c_noise = 0.25 log(sigma) as the timestep, the
    # image's CLIP embedding as one token, added_time_ids = [fps - 1, motion bucket, noise augmentation]
    return Built(m, lambda m, s, t, e, ids: m(s, t, e, ids).sample,
                 (_randn(1, 2, 8, 16, 16), torch.tensor([0.7]), _randn(1, 1, 32, seed=2),
                  torch.tensor([[6.0, 127.0, 0.02]])),
                 ("sample", "timestep", "encoder_hidden_states", "added_time_ids"))


@member("modelscope-unet", "unet", "ModelScope text-to-video UNet3DConditionModel (2 frames: temporal convs and "
        "temporal transformers over [B, C, F, H, W])")
def _modelscope() -> Built:
    import torch

    m = _diffusers("UNet3DConditionModel", sample_size=16, in_channels=4, out_channels=4,
                   down_block_types=["CrossAttnDownBlock3D", "DownBlock3D"],
                   up_block_types=["UpBlock3D", "CrossAttnUpBlock3D"], block_out_channels=[32, 64],
                   layers_per_block=1, norm_num_groups=8, cross_attention_dim=48, attention_head_dim=8)
    return Built(m, lambda m, s, t, e: m(s, t, e).sample,
                 (_randn(1, 4, 2, 16, 16), torch.tensor([500]), _randn(1, 8, 48, seed=2)),
                 ("sample", "timestep", "encoder_hidden_states"))


@member("animatediff-unet", "unet", "AnimateDiff UNetMotionModel (2 frames: an SD UNet with motion modules, "
        "attention over frames with a sinusoidal position embedding)")
def _animatediff() -> Built:
    import torch

    m = _diffusers("UNetMotionModel", sample_size=16, in_channels=4, out_channels=4,
                   down_block_types=["CrossAttnDownBlockMotion", "DownBlockMotion"],
                   up_block_types=["UpBlockMotion", "CrossAttnUpBlockMotion"], block_out_channels=[32, 64],
                   layers_per_block=1, norm_num_groups=8, cross_attention_dim=48, num_attention_heads=2,
                   motion_num_attention_heads=2, motion_max_seq_length=32, use_motion_mid_block=True)
    # AnimateDiff's pipeline repeats the prompt's embeddings for every frame
    return Built(m, lambda m, s, t, e: m(s, t, e).sample,
                 (_randn(1, 4, 2, 16, 16), torch.tensor([500]), _randn(1, 8, 48, seed=2).repeat_interleave(2, dim=0)),
                 ("sample", "timestep", "encoder_hidden_states"))


@member("stable-cascade-prior", "unet", "Stable Cascade stage C prior (StableCascadeUNet: ResBlock / TimestepBlock / "
        "AttnBlock, CLIP text and image conditions)")
def _stable_cascade() -> Built:
    import torch

    m = _diffusers("StableCascadeUNet", in_channels=16, out_channels=16, timestep_ratio_embedding_dim=64,
                   patch_size=1, conditioning_dim=64, block_out_channels=[64, 64], num_attention_heads=[2, 2],
                   down_num_layers_per_block=[1, 1], up_num_layers_per_block=[1, 1],
                   down_blocks_repeat_mappers=[1, 1], up_blocks_repeat_mappers=[1, 1],
                   block_types_per_layer=[["SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"]] * 2,
                   clip_text_in_channels=32, clip_text_pooled_in_channels=32, clip_image_in_channels=32, clip_seq=4,
                   kernel_size=3, dropout=[0.0, 0.0], self_attn=True, timestep_conditioning_type=["sca", "crp"],
                   switch_level=[False])
    return Built(m, lambda m, s, r, p, t, i: m(s, r, p, clip_text=t, clip_img=i).sample,
                 (_randn(1, 16, 12, 12), torch.tensor([0.6]), _randn(1, 1, 32, seed=2), _randn(1, 8, 32, seed=3),
                  _randn(1, 1, 32, seed=4)),
                 ("sample", "timestep_ratio", "clip_text_pooled", "clip_text", "clip_img"))


@member("kandinsky3-unet", "unet", "Kandinsky 3 UNet (Kandinsky3UNet: conditional group norms, attention pooling, "
        "caption mask)")
def _kandinsky3() -> Built:
    import torch

    m = _diffusers("Kandinsky3UNet", in_channels=4, time_embedding_dim=64, groups=8, attention_head_dim=16,
                   layers_per_block=2, block_out_channels=[32, 64], cross_attention_dim=64, encoder_hid_dim=48)
    mask = torch.ones(1, 8)
    mask[:, 6:] = 0  # padded caption tokens
    return Built(m, lambda m, s, t, e, mk: m(s, t, e, mk).sample,
                 (_randn(1, 4, 16, 16), torch.tensor([500.0]), _randn(1, 8, 48, seed=2), mask),
                 ("sample", "timestep", "encoder_hidden_states", "encoder_attention_mask"))


# --- transformers -----------------------------------------------------------------------------------------

def _flux_ids(h: int, w: int, text: int, axes: int = 3) -> tuple[Any, Any]:
    import torch

    img = torch.zeros(h * w, axes)
    img[:, 1] = torch.arange(h).repeat_interleave(w).float()
    img[:, 2] = torch.arange(w).repeat(h).float()
    return img, torch.zeros(text, axes)


@member("sd3-transformer", "transformer", "SD 3.5 Medium MMDiT-X (dual attention, per-head RMSNorm)")
def _sd3() -> Built:
    import torch

    config = _preset_config("tiny-sd3", "transformer")
    m = _diffusers("SD3Transformer2DModel", **config)
    return Built(m, lambda m, h, e, p, t: m(h, encoder_hidden_states=e, pooled_projections=p, timestep=t).sample,
                 (_randn(2, 16, 16, 16), _randn(2, 16, config["joint_attention_dim"], seed=2),
                  _randn(2, config["pooled_projection_dim"], seed=3), torch.tensor([500.0, 500.0])),
                 ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"))


def _flux(guidance: bool) -> Built:
    import torch

    m = _diffusers("FluxTransformer2DModel", patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                   attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48, pooled_projection_dim=32,
                   guidance_embeds=guidance, axes_dims_rope=[8, 12, 12])
    img_ids, txt_ids = _flux_ids(8, 8, 8)
    args = [_randn(1, 64, 16), _randn(1, 8, 48, seed=2), _randn(1, 32, seed=3), torch.tensor([0.5]), img_ids, txt_ids]
    names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids"]
    if guidance:
        return Built(m, lambda m, h, e, p, t, i, x, g: m(h, encoder_hidden_states=e, pooled_projections=p,
                     timestep=t, img_ids=i, txt_ids=x, guidance=g).sample,
                     (*args, torch.tensor([3.5])), (*names, "guidance"))
    return Built(m, lambda m, h, e, p, t, i, x: m(h, encoder_hidden_states=e, pooled_projections=p, timestep=t,
                 img_ids=i, txt_ids=x).sample, tuple(args), tuple(names))


@member("flux-dev", "transformer", "Flux.1 dev (double + single stream, RoPE, guidance embedding)")
def _flux_dev() -> Built:
    return _flux(True)


@member("flux-schnell", "transformer", "Flux.1 schnell (no guidance embedding)")
def _flux_schnell() -> Built:
    return _flux(False)


@member("chroma", "transformer", "Chroma (Flux without the pooled projection: a modulation approximator)")
def _chroma() -> Built:
    import torch

    m = _diffusers("ChromaTransformer2DModel", patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                   attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=[8, 12, 12],
                   approximator_num_channels=16, approximator_hidden_dim=64, approximator_layers=2)
    img_ids, txt_ids = _flux_ids(8, 8, 8)
    return Built(m, lambda m, h, e, t, i, x: m(h, encoder_hidden_states=e, timestep=t, img_ids=i, txt_ids=x).sample,
                 (_randn(1, 64, 16), _randn(1, 8, 48, seed=2), torch.tensor([0.5]), img_ids, txt_ids),
                 ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids"))


@member("flux2", "transformer", "Flux.2 (shared modulations, 4-axis RoPE, SwiGLU)")
def _flux2() -> Built:
    import torch

    m = _diffusers("Flux2Transformer2DModel", patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
                   attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
                   timestep_guidance_channels=32, axes_dims_rope=[8, 8, 8, 8], guidance_embeds=True)
    img_ids, txt_ids = _flux_ids(8, 8, 8, axes=4)
    return Built(m, lambda m, h, e, t, i, x, g: m(h, encoder_hidden_states=e, timestep=t, img_ids=i, txt_ids=x,
                                                  guidance=g).sample,
                 (_randn(1, 64, 16), _randn(1, 8, 48, seed=2), torch.tensor([0.5]), img_ids, txt_ids,
                  torch.tensor([3.5])),
                 ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids", "guidance"))


@member("pixart-sigma", "transformer", "PixArt-Sigma (AdaLN-single, cross-attention, affine-free LayerNorm)")
def _pixart() -> Built:
    import torch

    m = _diffusers("PixArtTransformer2DModel", num_attention_heads=2, attention_head_dim=32, in_channels=4,
                   out_channels=8, num_layers=2, cross_attention_dim=64, sample_size=16, patch_size=2,
                   caption_channels=48, norm_num_groups=8, interpolation_scale=1)
    return Built(m, lambda m, h, e, t: m(h, encoder_hidden_states=e, timestep=t,
                                         added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample,
                 (_randn(2, 4, 32, 32), _randn(2, 8, 48, seed=2), torch.tensor([500.0, 500.0])),
                 ("hidden_states", "encoder_hidden_states", "timestep"))


@member("sana", "transformer", "Sana (linear attention, GLU MBConv feed-forward)")
def _sana() -> Built:
    import torch

    m = _diffusers("SanaTransformer2DModel", in_channels=8, out_channels=8, num_attention_heads=2,
                   attention_head_dim=32, num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=32,
                   cross_attention_dim=64, caption_channels=48, sample_size=16, patch_size=1)
    return Built(m, lambda m, h, e, t: m(h, e, t).sample,
                 (_randn(2, 8, 16, 16), _randn(2, 8, 48, seed=2), torch.tensor([500.0, 500.0])),
                 ("hidden_states", "encoder_hidden_states", "timestep"))


@member("auraflow", "transformer", "AuraFlow (MMDiT and single DiT layers, learned positions, SwiGLU)")
def _auraflow() -> Built:
    import torch

    m = _diffusers("AuraFlowTransformer2DModel", sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=1,
                   num_single_dit_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
                   caption_projection_dim=64, out_channels=4, pos_embed_max_size=64)
    return Built(m, lambda m, h, e, t: m(h, encoder_hidden_states=e, timestep=t).sample,
                 (_randn(2, 4, 16, 16), _randn(2, 8, 48, seed=2), torch.tensor([500.0, 500.0])),
                 ("hidden_states", "encoder_hidden_states", "timestep"))


# Lumina 2, Z-Image and Qwen-Image keep their rotary tables complex; they export inside sdnpu's real_rotary context
# (convert/realrope.py), each with the exporter that takes the rest of its forward. Every member exports with the
# export forms of its classes (convert/exportforms.py: HiDream's MoE), as sdnpu's own export does.
_LUMINA_WHY = {"dynamo": "its forward turns the caption mask into Python sequence lengths (len(set(seq_lengths))): "
                         "torch.export cannot hash a symbolic size"}
_Z_IMAGE_WHY = {"torchscript": "TorchScript cannot export aten::pad_sequence (Z-Image pads its token lists)"}


@member("lumina2", "transformer", "Lumina Image 2.0 (grouped-query attention, 3-axis RoPE, refiner layers)",
        exporters=("torchscript",), why_not=_LUMINA_WHY)
def _lumina2() -> Built:
    import torch

    m = _diffusers("Lumina2Transformer2DModel", sample_size=16, patch_size=2, in_channels=4, hidden_size=64,
                   num_layers=1, num_refiner_layers=2, num_attention_heads=4, num_kv_heads=2, multiple_of=16,
                   axes_dim_rope=[4, 6, 6], axes_lens=[64, 32, 32], cap_feat_dim=48)
    mask = torch.ones(2, 8, dtype=torch.bool)
    return Built(m, lambda m, h, t, e, mk: m(h, t, e, mk).sample,
                 (_randn(2, 4, 16, 16), torch.tensor([0.5, 0.5]), _randn(2, 8, 48, seed=2), mask),
                 ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"))


@member("cogview4", "transformer", "CogView4 (2-axis RoPE, text and image streams, AdaLN)")
def _cogview4() -> Built:
    import torch

    m = _diffusers("CogView4Transformer2DModel", patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                   attention_head_dim=32, num_attention_heads=2, text_embed_dim=48, time_embed_dim=32,
                   condition_dim=16, pos_embed_max_size=32, sample_size=16, rope_axes_dim=[16, 16])
    # the original and target sizes as two tensors: one tensor passed twice is one graph input to torch.export
    size = torch.tensor([[128.0, 128.0]] * 2)
    return Built(m, lambda m, h, e, t, o, ts, c: m(h, e, t, o, ts, c).sample,
                 (_randn(2, 4, 16, 16), _randn(2, 8, 48, seed=2), torch.tensor([500.0, 500.0]), size,
                  size.clone(), torch.zeros(2, 2)),
                 ("hidden_states", "encoder_hidden_states", "timestep", "original_size", "target_size",
                  "crop_coords"))


@member("z-image", "transformer", "Z-Image (single-stream DiT over text and image tokens, 3-axis RoPE)",
        exporters=("dynamo",), why_not=_Z_IMAGE_WHY)
def _z_image() -> Built:
    import torch

    m = _diffusers("ZImageTransformer2DModel", in_channels=4, dim=64, n_layers=1, n_refiner_layers=1, n_heads=2,
                   n_kv_heads=2, cap_feat_dim=48, axes_dims=[8, 12, 12], axes_lens=[64, 32, 32])
    # diffusers' forward takes a list of images (each [C, F, H, W]) and of captions: one of each here
    return Built(m, lambda m, x, t, c: m([x], t, [c]).sample[0],
                 (_randn(4, 1, 16, 16), torch.tensor([0.5]), _randn(8, 48, seed=2)),
                 ("hidden_states", "timestep", "encoder_hidden_states"))


@member("qwen-image", "transformer", "Qwen-Image (MMDiT over text and image streams, complex 3-axis RoPE cut per "
        "image size, caption mask)")
def _qwen_image() -> Built:
    import torch

    m = _diffusers("QwenImageTransformer2DModel", **_preset_config("tiny-qwen-image", "transformer"))
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[:, 6:] = 0  # padded caption tokens
    # QwenImagePipeline's call: packed latents (an 8 x 8 grid of 2 x 2 patches), the caption's mask, img_shapes
    return Built(m, lambda m, h, e, mk, t: m(h, e, mk, t, img_shapes=[[(1, 8, 8)]]).sample,
                 (_randn(1, 64, 16), _randn(1, 8, 48, seed=2), mask, torch.tensor([0.5])),
                 ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"))


@member("hidream", "transformer", "HiDream-I1 (MoE feed-forward routed densely, T5 + Llama per-layer text, 2-D RoPE)")
def _hidream() -> Built:
    import torch

    m = _diffusers("HiDreamImageTransformer2DModel", patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                   num_single_layers=1, attention_head_dim=32, num_attention_heads=2, caption_channels=[48, 40],
                   text_emb_dim=32, num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[8, 12, 12],
                   max_resolution=[64, 64], llama_layers=[0, 1])
    return Built(m, lambda m, h, t, e5, el, p: m(h, t, e5, el, p).sample,
                 (_randn(1, 4, 16, 16), torch.tensor([500.0]), _randn(1, 8, 48, seed=2), _randn(2, 1, 8, 40, seed=3),
                  _randn(1, 32, seed=4)),
                 ("hidden_states", "timesteps", "encoder_hidden_states_t5", "encoder_hidden_states_llama3",
                  "pooled_embeds"))


# --- VAEs -------------------------------------------------------------------------------------------------

def _vae_decoder(m: Any, latent: int, channels: int) -> Built:
    return Built(m, lambda m, z: m.decode(z).sample, (_randn(1, channels, latent, latent),), ("latent_sample",),
                 ("sample",))


def _vae_encoder(m: Any, size: int, moments: bool = True) -> Built:
    if moments:
        return Built(m, lambda m, x: m.encode(x).latent_dist.parameters, (_randn(1, 3, size, size),), ("sample",),
                     ("latent_parameters",))
    return Built(m, lambda m, x: m.encode(x).latents, (_randn(1, 3, size, size),), ("sample",), ("latents",))


@member("sdxl-vae-decoder", "vae", "AutoencoderKL decoder (4 latent channels: SD, SDXL)")
def _kl4_dec() -> Built:
    return _vae_decoder(_diffusers("AutoencoderKL", **_preset_config("tiny-sdxl", "vae")), 16, 4)


@member("sdxl-vae-encoder", "vae", "AutoencoderKL encoder (4 latent channels)")
def _kl4_enc() -> Built:
    return _vae_encoder(_diffusers("AutoencoderKL", **_preset_config("tiny-sdxl", "vae")), 128)


@member("sd3-vae-decoder", "vae", "AutoencoderKL decoder (16 latent channels: SD3, Flux.1)")
def _kl16_dec() -> Built:
    return _vae_decoder(_diffusers("AutoencoderKL", **_preset_config("tiny-sd3", "vae")), 16, 16)


_TAESD = {"encoder_block_out_channels": [16, 16, 16, 16], "decoder_block_out_channels": [16, 16, 16, 16],
          "num_encoder_blocks": [1, 1, 1, 1], "num_decoder_blocks": [1, 1, 1, 1]}


@member("taesd-decoder", "vae", "AutoencoderTiny decoder (TAESD: ReLU convolutions, tanh clamp)")
def _taesd_dec() -> Built:
    return _vae_decoder(_diffusers("AutoencoderTiny", **_TAESD), 16, 4)


@member("taesd-encoder", "vae", "AutoencoderTiny encoder (TAESD)")
def _taesd_enc() -> Built:
    return _vae_encoder(_diffusers("AutoencoderTiny", **_TAESD), 128, moments=False)


_DC = {"in_channels": 3, "latent_channels": 8, "attention_head_dim": 8,
       "encoder_block_types": ["ResBlock", "EfficientViTBlock"], "decoder_block_types": ["ResBlock", "EfficientViTBlock"],
       "encoder_block_out_channels": [16, 32], "decoder_block_out_channels": [16, 32],
       "encoder_layers_per_block": [1, 1], "decoder_layers_per_block": [1, 1],
       "encoder_qkv_multiscales": [[], [5]], "decoder_qkv_multiscales": [[], [5]],
       "decoder_norm_types": ["batch_norm", "rms_norm"], "decoder_act_fns": ["silu", "silu"]}


@member("dc-ae-decoder", "vae", "AutoencoderDC decoder (Sana's DC-AE: pixel shuffle, ReLU linear attention)")
def _dc_dec() -> Built:
    m = _diffusers("AutoencoderDC", **_DC)
    return Built(m, lambda m, z: m.decode(z).sample, (_randn(1, 8, 16, 16),), ("latent_sample",), ("sample",))


@member("qwen-image-vae-decoder", "vae", "AutoencoderKLQwenImage decoder (Wan 2.1-style causal 3-D convs, RMS "
        "norms; one frame)", exporters=("dynamo",),
        why_not={"torchscript": "TorchScript cannot export aten::_upsample_nearest_exact2d (its nearest-exact "
                                "upsampling)"})
def _qwen_image_vae_dec() -> Built:
    m = _diffusers("AutoencoderKLQwenImage", **_preset_config("tiny-qwen-image", "vae"))
    return Built(m, lambda m, z: m.decode(z).sample, (_randn(1, 4, 1, 16, 16),), ("latent_sample",), ("sample",))


@member("flux2-vae-decoder", "vae", "AutoencoderKLFlux2 decoder (Flux.2's 32-channel VAE)")
def _flux2_vae_dec() -> Built:
    m = _diffusers("AutoencoderKLFlux2", block_out_channels=[16, 32], decoder_block_out_channels=[16, 32],
                   down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                   layers_per_block=1, latent_channels=8, norm_num_groups=8)
    return _vae_decoder(m, 16, 8)


_WAN22_WHY = {"torchscript": "TorchScript cannot export aten::_upsample_nearest_exact2d (its upsamplers' nearest-exact "
                           "upsampling)"}


@member("wan22-vae-decoder", "vae", "AutoencoderKLWan decoder, Wan 2.2 TI2V style (residual up-blocks with DupUp3D, "
        "2x2 patchify, causal 3-D convs; one frame)", exporters=("dynamo",), why_not=_WAN22_WHY)
def _wan22_vae_dec() -> Built:
    m = _diffusers("AutoencoderKLWan", base_dim=16, decoder_base_dim=16, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1,
                   attn_scales=[], temperal_downsample=[False, False], is_residual=True, in_channels=12,
                   out_channels=12, patch_size=2, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return Built(m, lambda m, z: m.decode(z).sample, (_randn(1, 8, 1, 8, 8),), ("latent_sample",), ("sample",))


@member("cogvideox-vae-decoder", "vae", "AutoencoderKLCogVideoX decoder (causal 3-D convs, spatial norm on the "
        "latent; 2 latent frames)")
def _cogvideox_vae_dec() -> Built:
    m = _diffusers("AutoencoderKLCogVideoX", in_channels=3, out_channels=3,
                   down_block_types=["CogVideoXDownBlock3D"] * 2, up_block_types=["CogVideoXUpBlock3D"] * 2,
                   block_out_channels=[16, 32], latent_channels=4, layers_per_block=1, norm_num_groups=8,
                   temporal_compression_ratio=2, sample_height=64, sample_width=64)
    return Built(m, lambda m, z: m.decode(z).sample, (_randn(1, 4, 2, 8, 8),), ("latent_sample",), ("sample",))


# --- text encoders ----------------------------------------------------------------------------------------

def _transformers(cls_name: str, config: dict[str, Any]) -> Any:
    import transformers

    cls = getattr(transformers, cls_name)
    skip = ("architectures", "_name_or_path", "torch_dtype")  # a config's dtype (SDXL's encoders say float16)
    return cls(cls.config_class(**{k: v for k, v in config.items() if k not in skip})).float()


def _text(m: Any, vocab: int, length: int = 77, outputs: tuple[str, ...] = ("last_hidden_state",),
          call: Callable[..., Any] | None = None) -> Built:
    import torch

    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(4))
    return Built(m, call or (lambda m, i: m(i).last_hidden_state), (ids,), ("input_ids",), outputs)


@member("clip-l", "text", "CLIP ViT-L text encoder (causal attention, quick_gelu)")
def _clip_l() -> Built:
    config = _preset_config("tiny-sdxl", "text_encoder")
    return _text(_transformers("CLIPTextModel", config), config["vocab_size"])


@member("clip-bigg", "text", "OpenCLIP bigG text encoder with projection (GELU)")
def _clip_g() -> Built:
    config = _preset_config("tiny-sdxl", "text_encoder_2")
    return _text(_transformers("CLIPTextModelWithProjection", config), config["vocab_size"], outputs=("text_embeds",),
                 call=lambda m, i: m(i).text_embeds)


@member("t5", "text", "T5 v1.1 encoder (relative-position bias, gated tanh-GELU, RMSNorm)")
def _t5() -> Built:
    config = _preset_config("tiny-sd3", "text_encoder_3")
    return _text(_transformers("T5EncoderModel", config), config["vocab_size"])


@member("gemma2", "text", "Gemma 2 decoder as a text encoder (Sana's: grouped-query attention, RoPE, soft-capping)",
        exporters=("dynamo",), why_not={"torchscript": "transformers' Gemma 2 mask code does not trace"})
def _gemma2() -> Built:
    config = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 64,
              "max_position_embeddings": 256, "attn_implementation": "eager"}
    return _text(_transformers("Gemma2Model", config), 512, length=32)


# The decoder-only text encoders of Qwen-Image (Qwen2.5-VL's text stack), HiDream (Llama 3) and Z-Image (Qwen3), as
# their pipelines call them: Qwen2's and Qwen3's with the caption's attention_mask (padded tokens), Llama's without.
_DECODER = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
            "attn_implementation": "eager"}


def _decoder_text(m: Any, mask: bool) -> Built:
    import torch

    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(4))
    if not mask:
        return Built(m, lambda m, i: m(input_ids=i).last_hidden_state, (ids,), ("input_ids",), ("last_hidden_state",))
    attention = torch.ones(1, 32, dtype=torch.long)
    attention[:, 28:] = 0  # padded caption tokens
    return Built(m, lambda m, i, a: m(input_ids=i, attention_mask=a).last_hidden_state, (ids, attention),
                 ("input_ids", "attention_mask"), ("last_hidden_state",))


_QWEN_TS_WHY = {"torchscript": "with the attention_mask, TorchScript fails in transformers' mask code "
                             "(RuntimeError: unordered_map::at)"}


@member("qwen2", "text", "Qwen2 decoder as a text encoder (Qwen-Image's Qwen2.5-VL text stack: grouped-query "
        "attention, RoPE, SwiGLU, causal and padding mask)", exporters=("dynamo",), why_not=_QWEN_TS_WHY)
def _qwen2() -> Built:
    return _decoder_text(_transformers("Qwen2Model", _DECODER), mask=True)


@member("llama3", "text", "Llama 3 decoder as a text encoder (HiDream's: grouped-query attention, llama3 RoPE "
        "scaling, RMSNorm, SwiGLU)")
def _llama3() -> Built:
    config = {**_DECODER, "rope_theta": 500000.0,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 64}}
    return _decoder_text(_transformers("LlamaModel", config), mask=False)


@member("qwen3", "text", "Qwen3 decoder as a text encoder (Z-Image's: grouped-query attention, RoPE, per-head RMS "
        "q / k norms, SwiGLU, causal and padding mask)", exporters=("dynamo",), why_not=_QWEN_TS_WHY)
def _qwen3() -> Built:
    return _decoder_text(_transformers("Qwen3Model", {**_DECODER, "head_dim": 16}), mask=True)


# --- export and compile -----------------------------------------------------------------------------------

def seeded(module: Any) -> Any:
    """The module with every constant parameter drawn (diffusers zero-initializes output layers and gates,
    norms start at one): a zero tensor becomes N(0, 0.02), a constant one c + N(0, 0.1 |c|)."""
    import torch

    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in module.parameters():
            if p.numel() > 1 and bool(torch.all(p == p.reshape(-1)[0])):
                c = float(p.reshape(-1)[0])
                p.add_(torch.randn(p.shape, generator=g) * (0.02 if c == 0 else 0.1 * abs(c)))
    return module.eval()


class _Wrapper:
    """A torch module around ``Built.call`` (made lazily: torch is imported only to export)."""

    @staticmethod
    def make(built: Built) -> Any:
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.m = built.module

            def forward(self, *args: Any) -> Any:
                out = built.call(self.m, *args)
                return out if isinstance(out, tuple) else (out,)

        return Wrapper().eval()


def build(name: str) -> tuple[Any, Built]:
    """The seeded wrapper module of entry ``name`` and what it was built from."""
    import torch

    torch.manual_seed(SEED)
    built = MEMBERS[name].build()
    seeded(built.module)
    return _Wrapper.make(built), built


def export(name: str, exporter: str, folder: Path) -> tuple[Path, dict[str, np.ndarray], list[np.ndarray]]:
    """Export entry ``name`` to ``folder/model.onnx``; returns the path, the example inputs and PyTorch's
    outputs on them."""
    import torch

    from sdnpu.convert.exportforms import export_forms
    from sdnpu.convert.realrope import real_rotary

    wrapper, built = build(name)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    with torch.no_grad():
        reference = [o.numpy().copy() for o in wrapper(*built.inputs)]  # also makes tables made on first use
    with torch.no_grad(), real_rotary(wrapper), export_forms(wrapper, exporter):
        if exporter == "dynamo":
            with np.errstate(all="ignore"):
                program = torch.onnx.export(wrapper, built.inputs, dynamo=True, input_names=list(built.names),
                                            output_names=list(built.outputs), opset_version=20, optimize=True,
                                            verbose=False, report=False)
            program.save(str(path))
        else:
            torch.onnx.export(wrapper, built.inputs, str(path), dynamo=False, input_names=list(built.names),
                              output_names=list(built.outputs), opset_version=20, do_constant_folding=True)
    feeds = {n: v.numpy() for n, v in zip(built.names, built.inputs, strict=True)}
    return path, feeds, reference


def agrees_with_pytorch(path: Path, feeds: dict[str, np.ndarray], reference: list[np.ndarray]) -> bool:
    """Whether onnxruntime runs the export to PyTorch's outputs (within 1e-3 of their scale): torch's exporters
    sometimes write a graph that computes something else (AutoencoderDC's linear attention loses its epsilon
    under dynamo: 0/0 where PyTorch divides by 1e-15)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    try:
        got = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feeds)
    except Exception:  # onnxruntime refuses the graph: the compile says so in its own words
        return False
    return all(a.shape == b.shape and bool(np.all(np.isfinite(a))) and float(np.abs(a - b).max())
               <= 1e-3 * max(1.0, float(np.abs(b).max())) for a, b in zip(got, reference, strict=True))


def main(argv: list[str]) -> int:
    import logging

    from sdnpu.convert.compile import compile_file

    logging.basicConfig(level=logging.WARNING)
    name, exporter, out = argv[0], argv[1], Path(argv[2])
    path, _, _ = export(name, exporter, out / name / exporter)
    s = compile_file(path, path.parent / "dd")["summary"]
    print(f"{name} {exporter}: {100 * s['offload_rate']:.2f}% ({s['offloaded_nodes']} dispatch ops, "
          f"{s['cpu_nodes']} CPU nodes, {s['npu_regions']} NPU regions)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
