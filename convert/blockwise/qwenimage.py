"""Qwen-Image's transformer in pieces (``sdnpu.convert.blockwise``): 60 dual-stream blocks 3072 wide, 20.4 B
parameters, 81.7 GB in fp32, far more than this machine holds, so it is converted one block at a time as
Flux.1's is.

The pieces, as ``QwenImageTransformer2DModel.forward`` runs them: (the embeddings and block 0), each other
block, (the last block, the output norm and projection). The first piece computes what every block reads from
the module's inputs, once: the timestep embedding ``temb`` and the caption's mask as the blocks take it
(``text_mask``: ``compute_text_seq_len_from_mask``'s bool mask, from which each block's attention builds its
joint mask); the blocks pass the image and text streams on (``hidden_states.next``,
``encoder_hidden_states.next``). Each piece holds its submodules under the whole module's names
(``transformer_blocks.3.attn.to_q``), so its parameter records are the whole module's and LoRAs reach them.

The rotary tables depend on the image's size and the caption's length alone, not on the module's inputs: each
piece holds ``QwenEmbedRope`` (no weights; its complex tables built from the config) and calls it as the module
does, so that every piece's export computes the same tables as constants in real arithmetic, as the whole
export computes them (``sdnpu.convert.realrope``: each block's rotation ``x * cos + rot(x) * sin`` with
constant ``cos`` and ``sin``), and the stitch keeps the repeats once (``sdnpu.convert.stitch``). That is T5's
shared position bias again (``t5``), and unlike Flux.1's tables (computed from its position-id inputs, handed on
by its first piece): handed on as values, each block's rotation would read a graph input where the whole graph
multiplies by constants, and compile to other nodes than the whole graph's.

Weights: a folder's come tensor by tensor from its safetensors files; a preset draws each part from its own seed
(``PRESET_SEED`` for the embeddings, ``img_in``, ``txt_norm``, ``txt_in``, ``time_text_embed`` in turn, and
again for the output layers, ``norm_out`` then ``proj_out``; ``PRESET_SEED + 1 + i`` for block ``i``) with
PyTorch's default initialization, so a piece's weights do not depend on the others (a whole preset module draws
from one stream: the two are different seeded weights of one architecture).

Declined (an SdnpuError naming the option): the edit models' ``zero_cond_t`` (a doubled timestep batch and a
per-token modulation index from the images' shapes), ``use_additional_t_cond`` (an input the pipeline's
transformer signature does not have) and the layered model's ``use_layer3d_rope``; the whole conversion takes
none of them either.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from typing import Any

import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers import transformer_qwenimage as tq

from sdnpu.convert.blockwise.piece import Load, Piece, Weights, holding, transformer_pieces, whole_from_pieces
from sdnpu.convert.sources import Source
from sdnpu.errors import SdnpuError
from sdnpu.signatures import Signature

SHARED = ("temb", "text_mask")  # what the first piece computes from the inputs for every block
STREAMS = ("hidden_states", "encoder_hidden_states")
# the submodules around the blocks: the first piece's, drawn in this order from PRESET_SEED, then the last's
EDGES = ("img_in", "txt_norm", "txt_in", "time_text_embed", "norm_out", "proj_out")
FIRST, LAST = EDGES[:4], EDGES[4:]
# config switches of the edit and layered models that the pieces (and the whole conversion's wrapper) decline
_DECLINED = ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")


def _config(src: Source, key: str) -> dict[str, Any]:
    return json.loads((src.modules[key] / "config.json").read_text())


def _sizes(config: dict[str, Any]) -> tuple[int, int, int]:
    heads, head_dim = int(config.get("num_attention_heads", 24)), int(config.get("attention_head_dim", 128))
    return heads, head_dim, heads * head_dim


def _part(name: str, config: dict[str, Any]) -> Any:
    """The submodule ``name`` of a QwenImageTransformer2DModel of ``config`` (its own weights, PyTorch's default
    initialization), built as the model's ``__init__`` builds it."""
    heads, head_dim, inner = _sizes(config)
    in_channels = int(config.get("in_channels", 64))
    out_channels = int(config.get("out_channels") or in_channels)
    joint = int(config.get("joint_attention_dim", 3584))
    if name.startswith("transformer_blocks."):
        return tq.QwenImageTransformerBlock(dim=inner, num_attention_heads=heads, attention_head_dim=head_dim)
    if name == "time_text_embed":
        return tq.QwenTimestepProjEmbeddings(embedding_dim=inner)
    if name == "txt_norm":
        return tq.RMSNorm(joint, eps=1e-6)
    if name == "img_in":
        return torch.nn.Linear(in_channels, inner)
    if name == "txt_in":
        return torch.nn.Linear(joint, inner)
    if name == "norm_out":
        return tq.AdaLayerNormContinuous(inner, inner, elementwise_affine=False, eps=1e-6)
    if name == "proj_out":
        patch = int(config.get("patch_size", 2))
        return torch.nn.Linear(inner, patch * patch * out_channels, bias=True)
    raise ValueError(name)


def _loader(config: dict[str, Any], weights: Weights) -> Load:
    return lambda name, seed: weights.part(lambda: _part(name, config), name, seed)


def _blocks(config: dict[str, Any]) -> list[str]:
    declined = [k for k in _DECLINED if config.get(k)]
    if declined:
        raise SdnpuError(f"this Qwen-Image transformer sets {', '.join(declined)}: sdnpu converts the text-to-image "
                         "model's transformer (whole or block by block), not the edit or layered models'",
                         hint="convert a QwenImagePipeline's transformer")
    blocks = [f"transformer_blocks.{i}" for i in range(int(config.get("num_layers", 60)))]
    if len(blocks) < 2:
        raise SdnpuError(f"a Qwen-Image transformer of {len(blocks)} block converts whole, not block by block",
                         hint="drop --blockwise")
    return blocks


class QwenImagePiece(torch.nn.Module):
    """Some consecutive blocks of Qwen-Image's transformer, for images of ``latent`` (H/f, W/f) latents; the
    embeddings before the first (then it computes ``temb`` and the text mask), the output layers after the last.
    ``whole`` holds the submodules under the whole module's names (``map_parameters`` strips this one child);
    ``pos_embed`` (no weights) makes the rotary tables, constants of the piece's graph."""

    def __init__(self, parts: dict[str, Any], config: dict[str, Any], latent: tuple[int, int], first: bool,
                 last: bool) -> None:
        super().__init__()
        self.whole = holding(parts)
        self.first, self.last = first, last
        self.pos_embed = tq.QwenEmbedRope(theta=10000, axes_dim=list(config.get("axes_dims_rope", (16, 56, 56))),
                                          scale_rope=True)
        self.shape = (1, latent[0] // 2, latent[1] // 2)  # one frame of 2 x 2 patches: QwenImageTransformer's
        self.blocks = list(getattr(self.whole, "transformer_blocks", {}))

    def forward(self, *args: Any) -> Any:
        w = self.whole
        if self.first:  # as QwenImageTransformer2DModel.forward begins (no guidance, no additional condition)
            hidden, timestep, context, mask = args
            hidden = w.img_in(hidden)
            timestep = timestep.to(hidden.dtype)
            context = w.txt_in(w.txt_norm(context))
            _, _, mask = tq.compute_text_seq_len_from_mask(context, mask)
            temb = w.time_text_embed(timestep, hidden, None)
        else:
            hidden, context, temb, mask = args
        rotary = self.pos_embed([[self.shape]] * hidden.shape[0], max_txt_seq_len=context.shape[1],
                                device=hidden.device)
        for k in self.blocks:
            context, hidden = w.transformer_blocks[k](hidden_states=hidden, encoder_hidden_states=context,
                                                      encoder_hidden_states_mask=mask, temb=temb,
                                                      image_rotary_emb=rotary)
        if self.last:
            return w.proj_out(w.norm_out(hidden, temb))
        if self.first:
            return hidden, context, temb, mask
        return hidden, context


def pieces(src: Source, key: str, sig: Signature, weights: Weights, only: Collection[int] | None = None,
           start: int = 0, latent: tuple[int, int] | None = None) -> Iterator[Piece]:
    """Qwen-Image's pieces in order (``blockwise.Piece``) for the transformer's signature ``sig`` at ``latent``
    (H/f, W/f: the rotary tables' image size), each built when asked for; ``only``: these pieces alone, the
    others not built; ``start``: the pieces from it on."""
    if latent is None:
        raise SdnpuError("Qwen-Image's transformer is converted for one image size: give its latent size",
                         hint="pieces(..., latent=(height // f, width // f))")
    config = _config(src, key)
    yield from transformer_pieces(_blocks(config), FIRST, LAST, _loader(config, weights),
                                  lambda parts, first, last: QwenImagePiece(parts, config, latent, first, last),
                                  tuple(s.name for s in sig.inputs), tuple(sig.outputs), SHARED, STREAMS, only, start)


def whole_module(src: Source, key: str, weights: Weights) -> Any:
    """The QwenImageTransformer2DModel whose weights the pieces hold (small modules only: tests compare against
    it)."""
    config = _config(src, key)
    blocks = _blocks(config)
    return whole_from_pieces(QwenImageTransformer2DModel.from_config(config), blocks, FIRST, LAST,
                             _loader(config, weights))
