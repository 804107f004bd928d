"""Tiny seeded public diffusion architectures sdnpu's zoo has not seen, exported to ONNX and compiled with
`sdnpu compile --target qnn-htp`, the way a new user would.

    python bench/bench_qnn_unseen.py NAME [NAME ...]   # export + compile (SDNPU_UNSEEN_OUT: the work folder,
                                                        # default /tmp/sdnpu-unseen)
    python bench/bench_qnn_unseen.py --list
    python bench/bench_qnn_unseen.py --target=amd-xdna2 NAME ...   # compile for another target (out/NAME/<target>)

The results are out/../results/NAME.json; bench/results.md has the table of a run of every entry.

Each entry: build (torch.manual_seed(0), small config, every constant parameter perturbed as sdnpu's zoo does so
no path is trivially exact), export with dynamo (opset 20); on failure TorchScript (opset 17); on failure through
sdnpu's own export path (`sdnpu-dynamo`, `sdnpu-torchscript`: `sdnpu.convert.export.export_module`, which exports
complex rotary tables in real arithmetic and a module class its exporter cannot trace in its export form, as
`sdnpu convert` does); check against PyTorch with onnxruntime CPU; write out/NAME/test_data_set_0/input_N.pb (the
graph's inputs in its order); run `sdnpu compile out/NAME/model.onnx --target qnn-htp --out out/NAME/qnn`; record
results/NAME.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sdnpu import families  # noqa: E402 -- Qwen-Image's transformer class: the family table's
from tests.zoo import seeded  # noqa: E402 -- the zoo's rule: every constant parameter drawn, so no path is exact

HERE = Path(os.environ.get("SDNPU_UNSEEN_OUT", "/tmp/sdnpu-unseen"))
OUT = HERE / "out"
RESULTS = HERE / "results"
SDNPU = str(Path(sys.executable).parent / "sdnpu")  # the venv's console script beside its python

REGISTRY = {}


def entry(name, architecture):
    def reg(fn):
        REGISTRY[name] = (architecture, fn)
        return fn
    return reg


def randn(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def D(cls, **config):
    import diffusers
    return getattr(diffusers, cls).from_config(config)


# --- entries: each returns (module, call(m, *inputs) -> tensor, inputs, input names) -----------------------

@entry("svd-unet", "Stable Video Diffusion UNetSpatioTemporalConditionModel (2 frames, temporal attention/resnets)")
def svd():
    m = D("UNetSpatioTemporalConditionModel", sample_size=16, in_channels=8, out_channels=4,
          down_block_types=["CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"],
          up_block_types=["UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"],
          block_out_channels=[32, 64], addition_time_embed_dim=8, projection_class_embeddings_input_dim=24,
          layers_per_block=1, cross_attention_dim=32, num_attention_heads=[2, 4], num_frames=2)
    # SVD's pipeline: c_noise = 0.25 log(sigma) as timestep, added_time_ids = [fps-1, motion bucket, noise aug]
    return (m, lambda m, s, t, e, ids: m(s, t, e, ids).sample,
            (randn(1, 2, 8, 16, 16), torch.tensor([0.7]), randn(1, 1, 32, seed=2),
             torch.tensor([[6.0, 127.0, 0.02]])),
            ("sample", "timestep", "encoder_hidden_states", "added_time_ids"))


@entry("lumina-next", "Lumina-Next DiT (LuminaNextDiT2DModel: complex 2-D RoPE, GQA, sandwich norms, tanh gates)")
def lumina_next():
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina
    m = D("LuminaNextDiT2DModel", sample_size=16, patch_size=2, in_channels=4, hidden_size=64, num_layers=2,
          num_attention_heads=4, num_kv_heads=2, multiple_of=16, cross_attention_dim=48, learn_sigma=True)
    freqs = get_2d_rotary_pos_embed_lumina(m.head_dim, 32, 32)  # complex64 table, as the pipeline's (384x384)
    m.unseen_freqs = freqs
    return (m, lambda m, h, t, e, mask: m(h, t, e, mask, m.unseen_freqs, cross_attention_kwargs={}).sample,
            (randn(1, 4, 16, 16), torch.tensor([0.5]), randn(1, 8, 48, seed=2), torch.ones(1, 8)),
            ("hidden_states", "timestep", "encoder_hidden_states", "encoder_mask"))


_WAN_MEAN = [0.0] * 4


@entry("qwenimage-vae-decoder", "AutoencoderKLQwenImage decoder (Wan 2.1-style causal 3-D convs, RMS norms, one frame)")
def qwen_vae():
    m = D("AutoencoderKLQwenImage", base_dim=16, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[],
          temperal_downsample=[False], latents_mean=_WAN_MEAN, latents_std=[1.0] * 4)
    return (m, lambda m, z: m.decode(z).sample, (randn(1, 4, 1, 16, 16),), ("latent_sample",))


@entry("wan22-vae-decoder", "AutoencoderKLWan decoder, Wan 2.2 TI2V style (residual up-blocks, 2x2 patchify, one frame)")
def wan22_vae():
    m = D("AutoencoderKLWan", base_dim=16, decoder_base_dim=16, z_dim=8, dim_mult=[1, 2, 2], num_res_blocks=1,
          attn_scales=[], temperal_downsample=[False, False], is_residual=True, in_channels=12, out_channels=12,
          patch_size=2, latents_mean=[0.0] * 8, latents_std=[1.0] * 8)
    return (m, lambda m, z: m.decode(z).sample, (randn(1, 8, 1, 8, 8),), ("latent_sample",))


@entry("cogvideox-vae-decoder", "AutoencoderKLCogVideoX decoder (causal 3-D convs, spatial norm, 2 latent frames)")
def cogvideox_vae():
    m = D("AutoencoderKLCogVideoX", in_channels=3, out_channels=3,
          down_block_types=["CogVideoXDownBlock3D"] * 2, up_block_types=["CogVideoXUpBlock3D"] * 2,
          block_out_channels=[16, 32], latent_channels=4, layers_per_block=1, norm_num_groups=8,
          temporal_compression_ratio=2, sample_height=64, sample_width=64)
    return (m, lambda m, z: m.decode(z).sample, (randn(1, 4, 2, 8, 8),), ("latent_sample",))


@entry("stable-cascade-prior", "Stable Cascade stage C prior (StableCascadeUNet: ResBlock/TimestepBlock/AttnBlock, CLIP conds)")
def stable_cascade():
    m = D("StableCascadeUNet", in_channels=16, out_channels=16, timestep_ratio_embedding_dim=64, patch_size=1,
          conditioning_dim=64, block_out_channels=[64, 64], num_attention_heads=[2, 2],
          down_num_layers_per_block=[1, 1], up_num_layers_per_block=[1, 1], down_blocks_repeat_mappers=[1, 1],
          up_blocks_repeat_mappers=[1, 1],
          block_types_per_layer=[["SDCascadeResBlock", "SDCascadeTimestepBlock", "SDCascadeAttnBlock"]] * 2,
          clip_text_in_channels=32, clip_text_pooled_in_channels=32, clip_image_in_channels=32, clip_seq=4,
          kernel_size=3, dropout=[0.0, 0.0], self_attn=True, timestep_conditioning_type=["sca", "crp"],
          switch_level=[False])
    return (m, lambda m, s, r, p, t, i: m(s, r, p, clip_text=t, clip_img=i).sample,
            (randn(1, 16, 12, 12), torch.tensor([0.6]), randn(1, 1, 32, seed=2), randn(1, 8, 32, seed=3),
             randn(1, 1, 32, seed=4)),
            ("sample", "timestep_ratio", "clip_text_pooled", "clip_text", "clip_img"))


@entry("kandinsky3-unet", "Kandinsky 3 UNet (Kandinsky3UNet: conditional group norms, attention pooling, text mask)")
def kandinsky3():
    m = D("Kandinsky3UNet", in_channels=4, time_embedding_dim=64, groups=8, attention_head_dim=16,
          layers_per_block=2, block_out_channels=[32, 64], cross_attention_dim=64, encoder_hid_dim=48)
    mask = torch.ones(1, 8)
    mask[:, 6:] = 0  # padded caption tokens
    return (m, lambda m, s, t, e, mk: m(s, t, e, mk).sample,
            (randn(1, 4, 16, 16), torch.tensor([500.0]), randn(1, 8, 48, seed=2), mask),
            ("sample", "timestep", "encoder_hidden_states", "encoder_attention_mask"))


@entry("hunyuan-dit", "HunyuanDiT v1.1 (HunyuanDiT2DModel: long skips, CLIP+T5 text, 2-D RoPE, style/size meta)")
def hunyuan():
    from diffusers.models.embeddings import get_2d_rotary_pos_embed
    from diffusers.pipelines.hunyuandit.pipeline_hunyuandit import get_resize_crop_region_for_grid
    m = D("HunyuanDiT2DModel", num_attention_heads=2, attention_head_dim=32, in_channels=4, patch_size=2,
          sample_size=16, hidden_size=64, num_layers=4, mlp_ratio=2.0, learn_sigma=True, cross_attention_dim=48,
          cross_attention_dim_t5=56, pooled_projection_dim=32, text_len=8, text_len_t5=8,
          use_style_cond_and_image_meta_size=True)
    grid = 8
    crops = get_resize_crop_region_for_grid((grid, grid), 512 // 8 // 2)
    rope = get_2d_rotary_pos_embed(32, crops, (grid, grid), output_type="pt")
    m._unseen_rope = rope
    return (m, lambda m, h, t, e, em, e5, em5, meta, st: m(h, t, encoder_hidden_states=e, text_embedding_mask=em,
                                                           encoder_hidden_states_t5=e5, text_embedding_mask_t5=em5,
                                                           image_meta_size=meta, style=st,
                                                           image_rotary_emb=m._unseen_rope).sample,
            (randn(1, 4, 16, 16), torch.tensor([500.0]), randn(1, 8, 48, seed=2), torch.ones(1, 8),
             randn(1, 8, 56, seed=3), torch.ones(1, 8), torch.tensor([[128.0, 128.0, 128.0, 128.0, 0.0, 0.0]]),
             torch.zeros(1, dtype=torch.long)),
            ("hidden_states", "timestep", "encoder_hidden_states", "text_embedding_mask", "encoder_hidden_states_t5",
             "text_embedding_mask_t5", "image_meta_size", "style"))


@entry("allegro", "Allegro video DiT (AllegroTransformer3DModel: 3-D RoPE by position ids, AdaLN-single, 2 frames)")
def allegro():
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro
    m = D("AllegroTransformer3DModel", patch_size=2, patch_size_t=1, num_attention_heads=2, attention_head_dim=48,
          in_channels=4, out_channels=4, num_layers=1, cross_attention_dim=96, sample_height=16, sample_width=16,
          sample_frames=2, caption_channels=48)
    gh = gw = 8
    ft, fh, fw, gt, gh_, gw_ = get_3d_rotary_pos_embed_allegro(48, ((0, 0), (gh, gw)), (gh, gw), 2,
                                                               interpolation_scale=(2.2, 2.0, 2.0))
    pos = torch.cartesian_prod(gt.long(), gh_.long(), gw_.long()).reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1)
    m._unseen_rope = ((ft, fh, fw), tuple(pos.contiguous()))
    return (m, lambda m, h, e, t: m(h, e, t, image_rotary_emb=m._unseen_rope).sample,
            (randn(1, 4, 2, 16, 16), randn(1, 8, 48, seed=2), torch.tensor([500.0])),
            ("hidden_states", "encoder_hidden_states", "timestep"))


@entry("ltx-video", "LTX-Video transformer (LTXVideoTransformer3DModel: 3-D RoPE, RMS q/k norm across heads)")
def ltx():
    m = D("LTXVideoTransformer3DModel", in_channels=8, out_channels=8, patch_size=1, patch_size_t=1,
          num_attention_heads=2, attention_head_dim=32, cross_attention_dim=64, num_layers=1, caption_channels=48)
    return (m, lambda m, h, e, t, mk: m(h, e, t, mk, num_frames=2, height=8, width=8,
                                        rope_interpolation_scale=(20 / 25, 32, 32)).sample,
            (randn(1, 2 * 8 * 8, 8), randn(1, 8, 48, seed=2), torch.tensor([500.0]), torch.ones(1, 8)),
            ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"))


@entry("amused-uvit", "aMUSEd UVit2DModel (masked-token transformer: token embedding, micro-conditioning, logits)")
def uvit():
    m = D("UVit2DModel", hidden_size=64, use_bias=False, cond_embed_dim=32, micro_cond_encode_dim=8,
          micro_cond_embed_dim=40, encoder_hidden_size=32, vocab_size=80, codebook_size=64, in_channels=32,
          block_out_channels=64, num_res_blocks=1, downsample=False, upsample=False, block_num_heads=2,
          num_hidden_layers=1, num_attention_heads=2, intermediate_size=128, sample_size=8)
    ids = torch.randint(0, 80, (1, 8, 8), generator=torch.Generator().manual_seed(4))
    return (m, lambda m, i, e, p, mc: m(i, e, p, mc),
            (ids, randn(1, 8, 32, seed=2), randn(1, 32, seed=3), torch.tensor([[512.0, 512.0, 0.0, 0.0, 6.0]])),
            ("input_ids", "encoder_hidden_states", "pooled_text_emb", "micro_conds"))


@entry("hidream", "HiDream-I1 (HiDreamImageTransformer2DModel: MoE feed-forward, T5 + Llama per-layer text, 2-D RoPE)")
def hidream():
    m = D("HiDreamImageTransformer2DModel", patch_size=2, in_channels=4, out_channels=4, num_layers=1,
          num_single_layers=1, attention_head_dim=32, num_attention_heads=2, caption_channels=[48, 40],
          text_emb_dim=32, num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[8, 12, 12],
          max_resolution=[64, 64], llama_layers=[0, 1])
    return (m, lambda m, h, t, e5, el, p: m(h, t, e5, el, p).sample,
            (randn(1, 4, 16, 16), torch.tensor([500.0]), randn(1, 8, 48, seed=2), randn(2, 1, 8, 40, seed=3),
             randn(1, 32, seed=4)),
            ("hidden_states", "timesteps", "encoder_hidden_states_t5", "encoder_hidden_states_llama3",
             "pooled_embeds"))


@entry("qwenimage-transformer", "Qwen-Image MMDiT (its transformer: complex 3-axis RoPE, text mask)")
def qwenimage():
    m = D(families.QWEN_IMAGE.denoiser_class, patch_size=2, in_channels=16, out_channels=4, num_layers=1,
          attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48, axes_dims_rope=[8, 12, 12])
    return (m, lambda m, h, e, mk, t: m(h, e, mk, t, img_shapes=[[(1, 8, 8)]]).sample,
            (randn(1, 64, 16), randn(1, 8, 48, seed=2), torch.ones(1, 8, dtype=torch.long), torch.tensor([0.5])),
            ("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"))


def _tf(cls, **config):
    import transformers
    c = getattr(transformers, cls)
    return c(c.config_class(**config)).float()


@entry("qwen2-text", "Qwen2 decoder as a text encoder (Qwen-Image's Qwen2.5-VL text stack: GQA, RoPE, SwiGLU, causal)")
def qwen2():
    m = _tf("Qwen2Model", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager")
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(4))
    return (m, lambda m, i, a: m(input_ids=i, attention_mask=a).last_hidden_state, (ids, torch.ones(1, 32, dtype=torch.long)),
            ("input_ids", "attention_mask"))


@entry("llama-text", "Llama 3 decoder as a text encoder (HiDream's: GQA, RoPE llama3 scaling, RMSNorm)")
def llama():
    m = _tf("LlamaModel", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, attn_implementation="eager",
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64}, rope_theta=500000.0)
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(4))
    return (m, lambda m, i: m(input_ids=i).last_hidden_state, (ids,), ("input_ids",))


@entry("qwen3-text", "Qwen3 decoder as a text encoder (Z-Image's: GQA, RoPE, RMS q/k norm per head, SwiGLU, causal)")
def qwen3():
    m = _tf("Qwen3Model", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            attn_implementation="eager")
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(4))
    return (m, lambda m, i, a: m(input_ids=i, attention_mask=a).last_hidden_state, (ids, torch.ones(1, 32, dtype=torch.long)),
            ("input_ids", "attention_mask"))


@entry("umt5", "UMT5 encoder (Wan's text encoder: per-layer relative-position bias, gated GELU, RMSNorm)")
def umt5():
    m = _tf("UMT5EncoderModel", vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, feed_forward_proj="gated-gelu")
    ids = torch.randint(0, 512, (1, 32), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(1, 32, dtype=torch.long)
    mask[:, 24:] = 0
    return (m, lambda m, i, a: m(input_ids=i, attention_mask=a).last_hidden_state, (ids, mask),
            ("input_ids", "attention_mask"))


@entry("dc-ae-encoder", "AutoencoderDC encoder (DC-AE: pixel unshuffle, ReLU linear attention)")
def dc_enc():
    m = D("AutoencoderDC", in_channels=3, latent_channels=8, attention_head_dim=8,
          encoder_block_types=["ResBlock", "EfficientViTBlock"], decoder_block_types=["ResBlock", "EfficientViTBlock"],
          encoder_block_out_channels=[16, 32], decoder_block_out_channels=[16, 32],
          encoder_layers_per_block=[1, 1], decoder_layers_per_block=[1, 1],
          encoder_qkv_multiscales=[[], [5]], decoder_qkv_multiscales=[[], [5]],
          decoder_norm_types=["batch_norm", "rms_norm"], decoder_act_fns=["silu", "silu"])
    return (m, lambda m, x: m.encode(x).latent, (randn(1, 3, 64, 64),), ("sample",))


@entry("wan-transformer", "Wan 2.1 video DiT (WanTransformer3DModel: 3-D RoPE, cross-attention, 2 frames)")
def wan_t():
    m = D("WanTransformer3DModel", patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=24,
          in_channels=4, out_channels=4, text_dim=48, freq_dim=32, ffn_dim=96, num_layers=1,
          rope_max_seq_len=64)
    return (m, lambda m, h, t, e: m(h, t, e).sample,
            (randn(1, 4, 2, 16, 16), torch.tensor([500.0]), randn(1, 8, 48, seed=2)),
            ("hidden_states", "timestep", "encoder_hidden_states"))


def _padded_mask(n=8, keep=6, dtype=torch.float32):
    mask = torch.ones(1, n, dtype=dtype)
    mask[:, keep:] = 0  # padded caption tokens
    return mask


@entry("cogvideox-transformer", "CogVideoX-5B video DiT (CogVideoXTransformer3DModel: joint text+video attention, 3-D RoPE table, 2 frames)")
def cogvideox_t():
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid
    m = D("CogVideoXTransformer3DModel", num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
          time_embed_dim=32, text_embed_dim=48, num_layers=1, sample_width=16, sample_height=16, sample_frames=5,
          patch_size=2, max_text_seq_length=8, use_rotary_positional_embeddings=True)
    grid = 8  # the pipeline's CogVideoX 1.0 table: crop region of the 8x8 grid, 2 latent frames
    crops = get_resize_crop_region_for_grid((grid, grid), 16 // 2, 16 // 2)
    m._unseen_rope = get_3d_rotary_pos_embed(32, crops, (grid, grid), 2)
    return (m, lambda m, h, e, t: m(h, e, t, image_rotary_emb=m._unseen_rope).sample,
            (randn(1, 2, 4, 16, 16), randn(1, 8, 48, seed=2), torch.tensor([500])),
            ("hidden_states", "encoder_hidden_states", "timestep"))


@entry("mochi-transformer", "Mochi 1 video DiT (MochiTransformer3DModel: asymmetric joint attention, learned 3-D RoPE, bool text mask)")
def mochi_t():
    m = D("MochiTransformer3DModel", patch_size=2, num_attention_heads=2, attention_head_dim=32, num_layers=1,
          pooled_projection_dim=32, in_channels=4, text_embed_dim=48, time_embed_dim=32, max_sequence_length=8)
    return (m, lambda m, h, e, t, mk: m(h, e, t, mk).sample,
            (randn(1, 4, 2, 16, 16), randn(1, 8, 48, seed=2), torch.tensor([700.0]), _padded_mask(dtype=torch.bool)),
            ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"))


@entry("hunyuanvideo-transformer", "HunyuanVideo DiT (HunyuanVideoTransformer3DModel: token refiner, dual+single stream, 3-D RoPE, guidance embed)")
def hunyuanvideo_t():
    m = D("HunyuanVideoTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32,
          num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=48,
          pooled_projection_dim=32, rope_axes_dim=(8, 12, 12), guidance_embeds=True)
    return (m, lambda m, h, t, e, mk, p, g: m(h, t, e, mk, p, g).sample,
            (randn(1, 4, 2, 16, 16), torch.tensor([700.0]), randn(1, 8, 48, seed=2), _padded_mask(),
             randn(1, 32, seed=3), torch.tensor([6000.0])),
            ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "pooled_projections",
             "guidance"))


@entry("latte", "Latte video DiT (LatteTransformer3DModel: alternating spatial/temporal blocks, AdaLN-single, 2 frames)")
def latte():
    m = D("LatteTransformer3DModel", num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=8,
          num_layers=1, sample_size=16, patch_size=2, norm_type="ada_norm_single", num_embeds_ada_norm=1000,
          activation_fn="gelu-approximate", caption_channels=48, cross_attention_dim=64, video_length=2,
          attention_bias=True, norm_elementwise_affine=False, norm_eps=1e-6)
    return (m, lambda m, h, t, e: m(h, t, e).sample,
            (randn(1, 4, 2, 16, 16), torch.tensor([500]), randn(1, 8, 48, seed=2)),
            ("hidden_states", "timestep", "encoder_hidden_states"))


@entry("easyanimate", "EasyAnimate V5.1 DiT (EasyAnimateTransformer3DModel: MMDiT-style joint blocks, 3-D RoPE, 2 frames)")
def easyanimate():
    m = D("EasyAnimateTransformer3DModel", num_attention_heads=2, attention_head_dim=32, in_channels=4, out_channels=4,
          patch_size=2, sample_width=16, sample_height=16, num_layers=1, mmdit_layers=1, time_embed_dim=32,
          text_embed_dim=48, add_norm_text_encoder=True, after_norm=False)
    return (m, lambda m, h, t, e: m(h, t, encoder_hidden_states=e).sample,
            (randn(1, 4, 2, 16, 16), torch.tensor([500.0]), randn(1, 8, 48, seed=2)),
            ("hidden_states", "timestep", "encoder_hidden_states"))


@entry("cosmos-transformer", "Cosmos-1.0 video DiT (CosmosTransformer3DModel: AdaLN-LoRA, 3-D RoPE by fps, learnable pos, padding mask)")
def cosmos_t():
    import types
    import diffusers.models.transformers.transformer_cosmos as tc
    if not hasattr(tc, "transforms"):  # torchvision is not installed: its tensor NEAREST resize is interpolate's
        tc.transforms = types.SimpleNamespace(
            InterpolationMode=types.SimpleNamespace(NEAREST="nearest"),
            functional=types.SimpleNamespace(resize=lambda x, size, interpolation: torch.nn.functional.interpolate(
                x, size=size, mode=interpolation)))
    m = D("CosmosTransformer3DModel", in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=32,
          num_layers=1, mlp_ratio=2.0, text_embed_dim=48, adaln_lora_dim=16, max_size=(8, 32, 32),
          patch_size=(1, 2, 2), rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=True,
          extra_pos_embed_type="learnable")
    # EDM preconditioning: timestep = 0.25 log(sigma); the pipeline's padding mask is zeros at pixel size
    return (m, lambda m, h, t, e, pm: m(h, t, e, fps=30, padding_mask=pm).sample,
            (randn(1, 4, 2, 16, 16), torch.tensor([0.7]), randn(1, 8, 48, seed=2), torch.zeros(1, 1, 128, 128)),
            ("hidden_states", "timestep", "encoder_hidden_states", "padding_mask"))


@entry("unet3d", "ModelScope text-to-video UNet3DConditionModel (temporal convs + temporal transformers, 2 frames)")
def unet3d():
    m = D("UNet3DConditionModel", sample_size=16, in_channels=4, out_channels=4,
          down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"), up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"),
          block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, cross_attention_dim=48,
          attention_head_dim=8)
    return (m, lambda m, s, t, e: m(s, t, e).sample,
            (randn(1, 4, 2, 16, 16), torch.tensor([500]), randn(1, 8, 48, seed=2)),
            ("sample", "timestep", "encoder_hidden_states"))


@entry("animatediff-unet", "AnimateDiff UNetMotionModel (SD UNet + motion modules: temporal attention with sinusoidal pos, 2 frames)")
def unet_motion():
    m = D("UNetMotionModel", sample_size=16, in_channels=4, out_channels=4,
          down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
          up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"), block_out_channels=(32, 64), layers_per_block=1,
          norm_num_groups=8, cross_attention_dim=48, num_attention_heads=2, motion_num_attention_heads=2,
          motion_max_seq_length=32, use_motion_mid_block=True)
    # AnimateDiff's pipeline repeats the prompt embeddings per frame
    return (m, lambda m, s, t, e: m(s, t, e).sample,
            (randn(1, 4, 2, 16, 16), torch.tensor([500]), randn(1, 8, 48, seed=2).repeat_interleave(2, dim=0)),
            ("sample", "timestep", "encoder_hidden_states"))


@entry("ltx-vae-decoder", "AutoencoderKLLTXVideo decoder, LTX-Video 0.9.1 style (timestep-conditioned causal 3-D convs, depth-to-space)")
def ltx_vae():
    m = D("AutoencoderKLLTXVideo", in_channels=3, out_channels=3, latent_channels=8, block_out_channels=(16, 32),
          decoder_block_out_channels=(32, 32), down_block_types=("LTXVideoDownBlock3D",) * 2,
          layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1), spatio_temporal_scaling=(True, False),
          decoder_spatio_temporal_scaling=(True, False), decoder_inject_noise=(False, False, False),
          downsample_type=("conv", "conv"), upsample_residual=(False, False), upsample_factor=(1, 1),
          timestep_conditioning=True, patch_size=4, patch_size_t=1)
    # equal decoder widths: diffusers 0.39 passes the raw timestep to an up block's channel-changing conv_in
    # resnet when timestep-conditioned (IndexError in unflatten). LTX 0.9.1's pipeline decodes at timestep 0.05
    return (m, lambda m, z, t: m.decode(z, t).sample, (randn(1, 8, 2, 8, 8), torch.tensor([0.05])),
            ("latent_sample", "timestep"))


@entry("hunyuanimage-transformer", "HunyuanImage 2.1 DiT (HunyuanImageTransformer2DModel: token refiner, byT5 glyph text, 2-D RoPE)")
def hunyuanimage_t():
    m = D("HunyuanImageTransformer2DModel", in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=32,
          num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=48,
          text_embed_2_dim=40, rope_axes_dim=(16, 16), guidance_embeds=False)
    return (m, lambda m, h, t, e, mk, e2, mk2: m(h, t, e, mk, encoder_hidden_states_2=e2,
                                                 encoder_attention_mask_2=mk2).sample,
            (randn(1, 8, 8, 8), torch.tensor([700.0]), randn(1, 8, 48, seed=2), _padded_mask(dtype=torch.long),
             randn(1, 8, 40, seed=3), _padded_mask(keep=5, dtype=torch.long)),
            ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
             "encoder_hidden_states_2", "encoder_attention_mask_2"))


# --- machinery -----------------------------------------------------------------------------------------------

class Wrapper(torch.nn.Module):
    def __init__(self, m, call):
        super().__init__()
        self.m, self.call = m, call

    def forward(self, *args):
        out = self.call(self.m, *args)
        return out[0] if isinstance(out, tuple) else out


def one_line(e):
    """The exception's first line, and its root cause's (torch.onnx's dynamo errors wrap the real one)."""
    def first(x):
        s = f"{type(x).__name__}: {x}".strip().splitlines()
        return (s[0] if s else type(x).__name__).replace("\x1b[96m", "").replace("\x1b[0m", "")[:300]
    root = e
    while root.__cause__ is not None:
        root = root.__cause__
    return first(e) if root is e else f"{first(e)} [cause: {first(root)}]"


def export(wrapper, inputs, names, path, exporter):
    import warnings
    warnings.filterwarnings("ignore")
    if exporter.startswith("sdnpu-"):  # sdnpu's own export path (real rotary, the classes' export forms)
        from sdnpu.convert.export import Exporter, export_module
        name = exporter.removeprefix("sdnpu-")
        return export_module(wrapper, inputs, list(names), ["out"], path,
                             Exporter(name, 17 if name == "torchscript" else 20))
    if exporter == "dynamo":
        with np.errstate(all="ignore"):
            prog = torch.onnx.export(wrapper, inputs, dynamo=True, input_names=list(names), output_names=["out"],
                                     opset_version=20, optimize=True, verbose=False, report=False)
        prog.save(str(path))
    else:
        torch.onnx.export(wrapper, inputs, str(path), dynamo=False, input_names=list(names), output_names=["out"],
                          opset_version=17, do_constant_folding=True)


EXPORTERS = ("dynamo", "torchscript", "sdnpu-dynamo", "sdnpu-torchscript")


def run(name, exporters=EXPORTERS, target="qnn-htp"):
    import onnx
    import onnxruntime as ort
    from onnx import numpy_helper

    arch, build = REGISTRY[name]
    rec = {"name": name, "architecture": arch, "export_errors": {}}
    folder = OUT / name
    if folder.exists():
        subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    m, call, inputs, names = build()
    seeded(m)
    rec["params_M"] = round(sum(p.numel() for p in m.parameters()) / 1e6, 3)
    wrapper = Wrapper(m, call).eval()
    with torch.no_grad():
        ref = wrapper(*inputs).float().numpy().copy()
    rec["out_shape"] = list(ref.shape)
    path = folder / "model.onnx"
    by_name = dict(zip(names, inputs))
    chosen = None  # (exporter, feeds, graph_inputs, model)
    first_exported = None
    for exporter in exporters:
        t0 = time.time()
        try:
            with torch.no_grad():
                export(wrapper, inputs, names, path, exporter)
        except Exception as e:  # noqa: BLE001
            rec["export_errors"][exporter] = one_line(e)
            (folder / f"export_{exporter}.err").write_text(traceback.format_exc())
            for f in folder.glob("model.onnx*"):
                f.unlink()
            continue
        label = exporter + (" (opset 17)" if exporter.endswith("torchscript") else " (opset 20)")
        model = onnx.load(str(path), load_external_data=False)
        inits = {i.name for i in model.graph.initializer}
        graph_inputs = [vi.name for vi in model.graph.input if vi.name not in inits]
        missing = [g for g in graph_inputs if g not in by_name]
        if missing:
            rec["export_errors"][exporter] = f"graph inputs {missing} are not the example inputs"
            continue
        feeds = {g: by_name[g].numpy() for g in graph_inputs}
        check = {"exporter": label, "export_s": round(time.time() - t0, 1), "nodes": len(model.graph.node)}
        try:
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            got = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
            check["ort_vs_torch_max_abs"] = float(np.abs(got - ref).max())
            check["ort_finite"] = bool(np.all(np.isfinite(got)))
            check["ort_ok"] = bool(got.shape == ref.shape and check["ort_finite"] and
                                   check["ort_vs_torch_max_abs"] <= 1e-3 * max(1.0, float(np.abs(ref).max())))
        except Exception as e:  # noqa: BLE001
            check["ort_ok"] = False
            check["ort_error"] = one_line(e)
        rec.setdefault("ort_checks", []).append(check)
        if check["ort_ok"]:
            chosen = (check, feeds, graph_inputs, model)
            break
        # keep the first export that onnxruntime could not match, try the next exporter
        keep = folder / f"bad_{exporter}"
        keep.mkdir()
        for f in folder.glob("model.onnx*"):
            f.rename(keep / f.name)
        if first_exported is None:
            first_exported = (check, feeds, graph_inputs, model, keep)
    if chosen is None and first_exported is not None:  # none agrees: compile the first, as sdnpu would be given it
        check, feeds, graph_inputs, model, keep = first_exported
        for f in keep.glob("model.onnx*"):
            f.rename(folder / f.name)
        chosen = (check, feeds, graph_inputs, model)
    if chosen is None:
        rec["status"] = "export failed"
        return rec
    check, feeds, graph_inputs, model = chosen
    rec.update(check)
    rec["op_types"] = sorted({n.op_type for n in model.graph.node})
    rec["graph_inputs"] = graph_inputs
    td = folder / "test_data_set_0"
    td.mkdir()
    for i, gi in enumerate(graph_inputs):
        (td / f"input_{i}.pb").write_bytes(numpy_helper.from_array(feeds[gi], gi).SerializeToString())
    (td / "output_0.pb").write_bytes(numpy_helper.from_array(ref, model.graph.output[0].name).SerializeToString())
    out = folder / ("qnn" if target == "qnn-htp" else target)
    cmd = [SDNPU, "compile", str(path), "--target", target, "--out", str(out)]
    rec["command"] = " ".join(cmd)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rec["compile_s"] = round(time.time() - t0, 1)
    rec["compile_rc"] = p.returncode
    (folder / "compile.stdout").write_text(p.stdout)
    (folder / "compile.stderr").write_text(p.stderr)
    if p.returncode != 0:
        tail = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
        errs = [ln for ln in tail if ln.startswith("sdnpu: error")]
        rec["compile_error"] = errs[-1] if errs else (tail[-1] if tail else "(no stderr)")
        rec["traceback"] = "Traceback" in p.stderr
    rep = out / "report.json"
    if rep.exists():
        rec["report"] = json.loads(rep.read_text())
    rec["status"] = "ok" if p.returncode == 0 else "compile failed"
    return rec


def main(argv):
    if argv[:1] == ["--list"]:
        for n, (a, _) in REGISTRY.items():
            print(f"{n:24s} {a}")
        return 0
    exporters = EXPORTERS
    target = "qnn-htp"
    while argv and argv[0].startswith("--"):
        key, _, value = argv[0].partition("=")
        if key == "--exporters":
            exporters = tuple(value.split(","))
        elif key == "--target":
            target = value
        else:
            print(f"unknown option {argv[0]} (--exporters=A,B, --target=T)", file=sys.stderr)
            return 2
        argv = argv[1:]
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in argv:
        t0 = time.time()
        try:
            rec = run(name, exporters, target)
        except Exception as e:  # noqa: BLE001
            rec = {"name": name, "status": "build failed", "error": one_line(e), "traceback_text": traceback.format_exc()}
        rec["wall_s"] = round(time.time() - t0, 1)
        (RESULTS / f"{name}.json").write_text(json.dumps(rec, indent=1, default=str))
        short = {k: v for k, v in rec.items() if k not in ("report", "op_types", "traceback_text")}
        print(json.dumps(short, default=str)[:2000], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
