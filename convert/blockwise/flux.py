"""Flux.1's transformer in pieces (``sdnpu.convert.blockwise``): 11.9 B parameters, 47.6 GB in fp32, more
than this machine holds, so it is converted one block at a time as T5 is.

The pieces, as ``FluxTransformer2DModel.forward`` runs them: (the embeddings and the first double-stream block),
each other double-stream block, each single-stream block, (the last single-stream block, the output norm and
projection). The first piece computes what every block reads, once: the timestep (and guidance) embedding
``temb`` and the rotary tables ``rope_cos`` / ``rope_sin`` of the ids; the blocks pass the image and text
streams on (``hidden_states.next``, ``encoder_hidden_states.next``). Each piece holds its submodules under the
whole module's names (``transformer_blocks.3.attn.to_q``), so its parameter records are the whole module's and
LoRAs reach them.

Weights: a folder's come tensor by tensor from its safetensors files; a preset draws each part from its own seed
(``PRESET_SEED`` for the embeddings, in turn, and again for the output layers; ``PRESET_SEED + 1 + i`` for block
``i``, counting the double-stream blocks first) with PyTorch's default initialization, so a piece's weights do
not depend on the others (a whole preset module draws from one stream: the two are different seeded weights of
one architecture).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from typing import Any

import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers import transformer_flux as tf

from sdnpu.convert.blockwise.piece import Load, Piece, Weights, holding, transformer_pieces, whole_from_pieces
from sdnpu.convert.sources import Source
from sdnpu.errors import SdnpuError
from sdnpu.signatures import Signature

SHARED = ("temb", "rope_cos", "rope_sin")  # what the first piece computes for every block
STREAMS = ("hidden_states", "encoder_hidden_states")
# the submodules around the blocks: the first piece's, drawn in this order from PRESET_SEED, then the last's
EDGES = ("x_embedder", "time_text_embed", "context_embedder", "norm_out", "proj_out")


def _config(src: Source, key: str) -> dict[str, Any]:
    return json.loads((src.modules[key] / "config.json").read_text())


def _part(name: str, config: dict[str, Any]) -> Any:
    """The submodule ``name`` of a FluxTransformer2DModel of ``config`` (its own weights, PyTorch's default
    initialization), built as the model's ``__init__`` builds it."""
    heads, head_dim = int(config.get("num_attention_heads", 24)), int(config.get("attention_head_dim", 128))
    inner = heads * head_dim
    in_channels = int(config.get("in_channels", 64))
    out_channels = int(config.get("out_channels") or in_channels)
    if name.startswith("transformer_blocks."):
        return tf.FluxTransformerBlock(dim=inner, num_attention_heads=heads, attention_head_dim=head_dim)
    if name.startswith("single_transformer_blocks."):
        return tf.FluxSingleTransformerBlock(dim=inner, num_attention_heads=heads, attention_head_dim=head_dim)
    if name == "time_text_embed":
        cls = (tf.CombinedTimestepGuidanceTextProjEmbeddings if config.get("guidance_embeds")
               else tf.CombinedTimestepTextProjEmbeddings)
        return cls(embedding_dim=inner, pooled_projection_dim=int(config.get("pooled_projection_dim", 768)))
    if name == "context_embedder":
        return torch.nn.Linear(int(config.get("joint_attention_dim", 4096)), inner)
    if name == "x_embedder":
        return torch.nn.Linear(in_channels, inner)
    if name == "norm_out":
        return tf.AdaLayerNormContinuous(inner, inner, elementwise_affine=False, eps=1e-6)
    if name == "proj_out":
        patch = int(config.get("patch_size", 1))
        return torch.nn.Linear(inner, patch * patch * out_channels, bias=True)
    raise ValueError(name)


def _loader(config: dict[str, Any], weights: Weights) -> Load:
    return lambda name, seed: weights.part(lambda: _part(name, config), name, seed)


def _blocks(config: dict[str, Any]) -> list[str]:
    blocks = [f"transformer_blocks.{i}" for i in range(int(config.get("num_layers", 19)))]
    return blocks + [f"single_transformer_blocks.{i}" for i in range(int(config.get("num_single_layers", 38)))]


class FluxPiece(torch.nn.Module):
    """Some consecutive blocks of Flux.1's transformer; the embeddings before the first (then it computes
    ``temb`` and the rotary tables), the output layers after the last. ``whole`` holds the submodules
    under the whole module's names (``map_parameters`` strips this one child)."""

    def __init__(self, parts: dict[str, Any], config: dict[str, Any], first: bool, last: bool) -> None:
        super().__init__()
        self.whole = holding(parts)
        self.first, self.last = first, last
        self.guidance = bool(config.get("guidance_embeds"))
        self.pos_embed = tf.FluxPosEmbed(theta=10000, axes_dim=tuple(config.get("axes_dims_rope", (16, 56, 56))))
        self.double = [k for k in getattr(self.whole, "transformer_blocks", {})]
        self.single = [k for k in getattr(self.whole, "single_transformer_blocks", {})]

    def forward(self, *args: Any) -> Any:
        w = self.whole
        if self.first:  # as FluxTransformer2DModel.forward begins
            hidden, timestep, context, pooled, img_ids, txt_ids = args[:6]
            guidance = args[6] if self.guidance else None
            hidden = w.x_embedder(hidden)
            timestep = timestep.to(hidden.dtype) * 1000
            if guidance is None:
                temb = w.time_text_embed(timestep, pooled)
            else:
                temb = w.time_text_embed(timestep, guidance.to(hidden.dtype) * 1000, pooled)
            context = w.context_embedder(context)
            cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        else:
            hidden, context, temb, cos, sin = args
        for k in self.double:
            context, hidden = w.transformer_blocks[k](hidden_states=hidden, encoder_hidden_states=context,
                                                      temb=temb, image_rotary_emb=(cos, sin))
        for k in self.single:
            context, hidden = w.single_transformer_blocks[k](hidden_states=hidden, encoder_hidden_states=context,
                                                             temb=temb, image_rotary_emb=(cos, sin))
        if self.last:
            return w.proj_out(w.norm_out(hidden, temb))
        if self.first:
            return hidden, context, temb, cos, sin
        return hidden, context


def pieces(src: Source, key: str, sig: Signature, weights: Weights, only: Collection[int] | None = None,
           start: int = 0, latent: tuple[int, int] | None = None) -> Iterator[Piece]:
    """Flux.1's pieces in order (``blockwise.Piece``) for the transformer's signature ``sig``, each built when
    asked for; ``only``: these pieces alone, the others not built (``bench/bench_flux_pieces.py``); ``start``:
    the pieces from it on; ``latent``: the image size, which the pieces take from the position ids instead."""
    config = _config(src, key)
    blocks = _blocks(config)
    if len(blocks) < 2:
        raise SdnpuError(f"a Flux transformer of {len(blocks)} block converts whole, not block by block",
                         hint="drop --blockwise")
    yield from transformer_pieces(blocks, EDGES[:3], EDGES[3:], _loader(config, weights),
                                  lambda parts, first, last: FluxPiece(parts, config, first, last),
                                  tuple(s.name for s in sig.inputs), tuple(sig.outputs), SHARED, STREAMS, only, start)


def whole_module(src: Source, key: str, weights: Weights) -> Any:
    """The FluxTransformer2DModel whose weights the pieces hold (small modules only: tests compare against
    it)."""
    config = _config(src, key)
    return whole_from_pieces(FluxTransformer2DModel.from_config(config), _blocks(config), EDGES[:3], EDGES[3:],
                             _loader(config, weights))
