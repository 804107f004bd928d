"""diffusers modules written back in their models' original layouts: single-file checkpoints for the tests.

diffusers ships only the way in (original layout -> diffusers, ``diffusers.loaders.single_file_utils``); the way
back is written here, one function per layout of a module, from the key facts of diffusers' public conversion
scripts (``scripts/convert_diffusers_to_original_sdxl.py``, ``..._stable_diffusion.py``) and of the original
code's names, and held to diffusers' way in by ``tests/test_singlefile.py`` (each module written here and read
by sdnpu's reader gives back every tensor, bit for bit).

``single_file(preset, layout, path)`` writes a tiny preset's seeded modules as one ``.safetensors`` in the
layout of ``FILES[layout]``: the module keys it holds and the prefix of each.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_UNET_EDGES = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
               "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
               "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


class _Writer:
    """An original-layout state dict being written: plain renames, and the tensors that are several of
    diffusers' joined along dim 0 (a fused qkv), in their order."""

    def __init__(self) -> None:
        self.out: dict[str, torch.Tensor] = {}
        self.joined: dict[str, dict[int, torch.Tensor]] = {}

    def put(self, key: str, t: torch.Tensor) -> None:
        assert key not in self.out, key
        self.out[key] = t

    def join(self, key: str, i: int, t: torch.Tensor) -> None:
        self.joined.setdefault(key, {})[i] = t

    def done(self) -> dict[str, torch.Tensor]:
        for key, parts in self.joined.items():
            self.put(key, torch.cat([parts[i] for i in sorted(parts)], dim=0))
        return {k: v.contiguous() for k, v in self.out.items()}


def ldm_unet(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A UNet2DConditionModel in the LDM layout (``input_blocks``, ``middle_block``, ``output_blocks``)."""
    per = config["layers_per_block"] + 1
    attn_up = {b for b, t in enumerate(config["up_block_types"]) if "CrossAttn" in t}
    w = _Writer()
    for name, t in sd.items():
        p = name.split(".")
        leaf = p[-1]
        edge = ".".join(p[:-1])
        if edge in _UNET_EDGES:
            w.put(f"{_UNET_EDGES[edge]}.{leaf}", t)
        elif p[0] == "down_blocks":
            b, kind, j = int(p[1]), p[2], int(p[3])
            if kind == "resnets":
                w.put(f"input_blocks.{1 + b * per + j}.0.{_RESNET[p[4]]}.{leaf}", t)
            elif kind == "attentions":
                w.put(f"input_blocks.{1 + b * per + j}.1.{'.'.join(p[4:])}", t)
            else:  # downsamplers.0.conv.<leaf>
                w.put(f"input_blocks.{1 + b * per + per - 1}.0.op.{leaf}", t)
        elif p[0] == "mid_block":
            j = int(p[2])
            if p[1] == "resnets":
                w.put(f"middle_block.{2 * j}.{_RESNET[p[3]]}.{leaf}", t)
            else:
                w.put(f"middle_block.1.{'.'.join(p[3:])}", t)
        elif p[0] == "up_blocks":
            b, kind, j = int(p[1]), p[2], int(p[3])
            if kind == "resnets":
                w.put(f"output_blocks.{b * per + j}.0.{_RESNET[p[4]]}.{leaf}", t)
            elif kind == "attentions":
                w.put(f"output_blocks.{b * per + j}.1.{'.'.join(p[4:])}", t)
            else:  # upsamplers.0.conv.<leaf>: after the attention where the block has one
                w.put(f"output_blocks.{b * per + per - 1}.{2 if b in attn_up else 1}.conv.{leaf}", t)
        else:
            raise KeyError(f"no LDM name for {name}")
    return w.done()


_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out": "proj_out"}


def ldm_vae(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """An AutoencoderKL in the LDM layout (``encoder.down.N.block``, ``decoder.up`` counted from the bottom,
    the mid attention's projections as 1x1 convolutions)."""
    n = len(config["up_block_types"])
    w = _Writer()
    for name, t in sd.items():
        p = name.split(".")
        side, leaf = p[0], p[-1]
        if p[1] in ("down_blocks", "up_blocks"):
            i, kind = int(p[2]), p[3]
            where = f"down.{i}" if p[1] == "down_blocks" else f"up.{n - 1 - i}"
            if kind == "resnets":
                sub = p[5].replace("conv_shortcut", "nin_shortcut")
                w.put(f"{side}.{where}.block.{p[4]}.{sub}.{leaf}", t)
            else:  # downsamplers / upsamplers .0.conv.<leaf>
                w.put(f"{side}.{where}.{'downsample' if kind == 'downsamplers' else 'upsample'}.conv.{leaf}", t)
        elif p[1] == "mid_block":
            if p[2] == "resnets":
                w.put(f"{side}.mid.block_{int(p[3]) + 1}.{p[4]}.{leaf}", t)
            else:
                conv = t[:, :, None, None] if t.ndim == 2 else t
                w.put(f"{side}.mid.attn_1.{_VAE_ATTN[p[4]]}.{leaf}", conv)
        elif p[1] == "conv_norm_out":
            w.put(f"{side}.norm_out.{leaf}", t)
        else:  # conv_in, conv_out, quant_conv, post_quant_conv
            w.put(name, t)
    return w.done()


def hf_clip(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A CLIP text model as transformers names it (SD 1.x's, SDXL's CLIP-L, SD3's): the names unchanged."""
    return {k: v.contiguous() for k, v in sd.items()}


def hf_clip_unprojected(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """SD3's and Flux.1's CLIP-L as their files hold it: no projection."""
    return {k: v.contiguous() for k, v in sd.items() if not k.startswith("text_projection.")}


_OPEN_CLIP = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp": "mlp", "self_attn": "attn"}


def open_clip(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """OpenCLIP's text tower (SDXL's bigG, SD 2.x's): one ``in_proj`` for q, k, v, its projection transposed."""
    fixed = {"text_model.embeddings.token_embedding.weight": "token_embedding.weight",
             "text_model.embeddings.position_embedding.weight": "positional_embedding",
             "text_model.final_layer_norm.weight": "ln_final.weight",
             "text_model.final_layer_norm.bias": "ln_final.bias"}
    w = _Writer()
    for name, t in sd.items():
        if name in fixed:
            w.put(fixed[name], t)
        elif name == "text_projection.weight":
            w.put("text_projection", t.T)
        else:  # text_model.encoder.layers.N.<sub>...
            p = name.split(".")
            n, sub, rest = p[3], p[4], p[5:]
            block = f"transformer.resblocks.{n}"
            if sub == "self_attn" and rest[0] in ("q_proj", "k_proj", "v_proj"):
                w.join(f"{block}.attn.in_proj_{rest[1]}", "qkv".index(rest[0][0]), t)
            elif sub == "mlp":
                w.put(f"{block}.mlp.{'c_fc' if rest[0] == 'fc1' else 'c_proj'}.{rest[1]}", t)
            else:
                w.put(f"{block}.{_OPEN_CLIP[sub]}.{'.'.join(rest)}", t)
    return w.done()


def hf_t5(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """T5's encoder as transformers names it, its tied embedding once (``shared``)."""
    return {k: v.contiguous() for k, v in sd.items() if k != "encoder.embed_tokens.weight"}


def mmdit(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """SD3's transformer in Stability's MMDiT layout (``joint_blocks.N.x_block`` / ``context_block``, fused qkv,
    the output norms' halves in (shift, scale) order)."""
    last = config["num_layers"] - 1
    edges = {"pos_embed.proj": "x_embedder.proj", "context_embedder": "context_embedder",
             "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
             "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
             "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
             "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2", "proj_out": "final_layer.linear"}
    block = {"attn.norm_q": "x_block.attn.ln_q", "attn.norm_k": "x_block.attn.ln_k",
             "attn.norm_added_q": "context_block.attn.ln_q", "attn.norm_added_k": "context_block.attn.ln_k",
             "attn.to_out.0": "x_block.attn.proj", "attn.to_add_out": "context_block.attn.proj",
             "attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k",
             "attn2.to_out.0": "x_block.attn2.proj", "norm1.linear": "x_block.adaLN_modulation.1",
             "norm1_context.linear": "context_block.adaLN_modulation.1",
             "ff.net.0.proj": "x_block.mlp.fc1", "ff.net.2": "x_block.mlp.fc2",
             "ff_context.net.0.proj": "context_block.mlp.fc1", "ff_context.net.2": "context_block.mlp.fc2"}
    qkv = {"attn.to_q": ("x_block.attn.qkv", 0), "attn.to_k": ("x_block.attn.qkv", 1),
           "attn.to_v": ("x_block.attn.qkv", 2), "attn.add_q_proj": ("context_block.attn.qkv", 0),
           "attn.add_k_proj": ("context_block.attn.qkv", 1), "attn.add_v_proj": ("context_block.attn.qkv", 2),
           "attn2.to_q": ("x_block.attn2.qkv", 0), "attn2.to_k": ("x_block.attn2.qkv", 1),
           "attn2.to_v": ("x_block.attn2.qkv", 2)}
    w = _Writer()
    for name, t in sd.items():
        stem, leaf = name.rsplit(".", 1)
        if name == "pos_embed.pos_embed":
            w.put("pos_embed", t)
        elif stem in edges:
            w.put(f"{edges[stem]}.{leaf}", t)
        elif stem == "norm_out.linear":
            w.put(f"final_layer.adaLN_modulation.1.{leaf}", _swap_halves(t))
        else:  # transformer_blocks.N.<sub>
            _, n, sub = stem.split(".", 2)
            i = int(n)
            if sub in qkv:
                fused, pos = qkv[sub]
                w.join(f"joint_blocks.{i}.{fused}.{leaf}", pos, t)
            elif sub == "norm1_context.linear" and i == last:  # the last block's context norm: diffusers' own
                w.put(f"joint_blocks.{i}.{block[sub]}.{leaf}", _swap_halves(t))
            else:
                w.put(f"joint_blocks.{i}.{block[sub]}.{leaf}", t)
    return w.done()


def bfl_flux(sd: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Flux.1's transformer in Black Forest Labs' layout (``double_blocks``, ``single_blocks`` with one fused
    ``linear1`` for q, k, v and the MLP's input)."""
    edges = {"time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
             "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
             "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
             "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
             "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
             "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
             "context_embedder": "txt_in", "x_embedder": "img_in", "proj_out": "final_layer.linear"}
    double = {"norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
              "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
              "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
              "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2", "ff_context.net.0.proj": "txt_mlp.0",
              "ff_context.net.2": "txt_mlp.2", "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj"}
    double_qkv = {"attn.to_q": ("img_attn.qkv", 0), "attn.to_k": ("img_attn.qkv", 1),
                  "attn.to_v": ("img_attn.qkv", 2), "attn.add_q_proj": ("txt_attn.qkv", 0),
                  "attn.add_k_proj": ("txt_attn.qkv", 1), "attn.add_v_proj": ("txt_attn.qkv", 2)}
    single = {"norm.linear": "modulation.lin", "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
              "proj_out": "linear2"}
    single_fused = {"attn.to_q": 0, "attn.to_k": 1, "attn.to_v": 2, "proj_mlp": 3}
    w = _Writer()
    for name, t in sd.items():
        stem, leaf = name.rsplit(".", 1)
        if stem in edges:
            w.put(f"{edges[stem]}.{leaf}", t)
        elif stem == "norm_out.linear":
            w.put(f"final_layer.adaLN_modulation.1.{leaf}", _swap_halves(t))
        else:
            blocks, n, sub = stem.split(".", 2)
            if blocks == "transformer_blocks":
                if sub in double_qkv:
                    fused, pos = double_qkv[sub]
                    w.join(f"double_blocks.{n}.{fused}.{leaf}", pos, t)
                else:
                    norm = sub.startswith("attn.norm")
                    w.put(f"double_blocks.{n}.{double[sub]}.{'scale' if norm else leaf}", t)
            elif sub in single_fused:
                w.join(f"single_blocks.{n}.linear1.{leaf}", single_fused[sub], t)
            else:
                w.put(f"single_blocks.{n}.{single[sub]}.{'scale' if sub.startswith('attn.norm') else leaf}", t)
    return w.done()


Writer = Callable[[dict[str, torch.Tensor], dict[str, Any]], dict[str, torch.Tensor]]

# layout -> module key -> (its prefix in the file, the function that writes it): the layouts people share
FILES: dict[str, dict[str, tuple[str, Writer]]] = {
    "sdxl": {"unet": ("model.diffusion_model.", ldm_unet), "vae": ("first_stage_model.", ldm_vae),
             "text_encoder": ("conditioner.embedders.0.transformer.", hf_clip),
             "text_encoder_2": ("conditioner.embedders.1.model.", open_clip)},
    "sd1": {"unet": ("model.diffusion_model.", ldm_unet), "vae": ("first_stage_model.", ldm_vae),
            "text_encoder": ("cond_stage_model.transformer.", hf_clip)},
    "sd2": {"unet": ("model.diffusion_model.", ldm_unet), "vae": ("first_stage_model.", ldm_vae),
            "text_encoder": ("cond_stage_model.model.", open_clip)},
    # ComfyUI's whole SD3 checkpoint (sd3.5_medium_incl_clips_t5xxlfp16.safetensors's layout)
    "sd3": {"transformer": ("model.diffusion_model.", mmdit), "vae": ("first_stage_model.", ldm_vae),
            "text_encoder": ("text_encoders.clip_l.transformer.", hf_clip_unprojected),
            "text_encoder_2": ("text_encoders.clip_g.transformer.", hf_clip),
            "text_encoder_3": ("text_encoders.t5xxl.transformer.", hf_t5)},
    # Black Forest Labs' release: the transformer alone, its keys bare
    "flux": {"transformer": ("", bfl_flux)},
    # ComfyUI's whole Flux.1 checkpoint
    "flux-comfy": {"transformer": ("model.diffusion_model.", bfl_flux), "vae": ("vae.", ldm_vae),
                   "text_encoder": ("text_encoders.clip_l.transformer.", hf_clip_unprojected),
                   "text_encoder_2": ("text_encoders.t5xxl.transformer.", hf_t5)},
}


def original(preset: str, layout: str, modules: list[str] | None = None, meta: bool = False
             ) -> dict[str, torch.Tensor]:
    """Preset ``preset``'s seeded modules (``modules``: these alone) as one state dict in ``layout``; ``meta``:
    its modules built on the meta device (the shapes alone, of any size)."""
    from sdnpu.convert import resolve_source

    src = resolve_source(preset)
    out: dict[str, torch.Tensor] = {}
    for key, (prefix, write) in FILES[layout].items():
        if modules is not None and key not in modules:
            continue
        if meta:
            with torch.device("meta"):
                module = src.build(key)
        else:
            module = src.load_module(key)
        state = {k: v.detach() for k, v in module.state_dict().items()}
        for k, v in write(state, src.module_config(_component(key))).items():
            out[prefix + k] = v
    return out


def shapes(preset: str, layout: str, modules: list[str] | None = None) -> dict[str, tuple[int, ...]]:
    """The shapes of ``original(...)``, for a preset of any size (built on the meta device)."""
    return {k: tuple(v.shape) for k, v in original(preset, layout, modules, meta=True).items()}


def single_file(preset: str, layout: str, path: Path, modules: list[str] | None = None) -> Path:
    """``original(...)`` written to ``path`` (a ``.safetensors``); returns ``path``."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(original(preset, layout, modules), str(path))
    return path


def _component(key: str) -> str:
    from sdnpu.components import COMPONENTS, module_of

    return next(c for c in COMPONENTS if module_of(c) == key)
