"""T5's encoder (SD3's ``text_encoder_3``, Flux.1's ``text_encoder_2``) in pieces (``sdnpu.convert.blockwise``):
T5-XXL's 19 GB of fp32 weights do not fit this machine's memory whole.

T5's encoder is an embedding, blocks that each read the previous block's hidden states and one shared position
bias, and a final RMSNorm. The position bias depends on the sequence length and block 0's bucket table only, so it
is computed once here (``compute_bias``: [1, heads, S, S]) and each piece holds it as a constant, as a
whole-graph export folds it. The pieces: (embedding + block 0), blocks 1 .. n-2, (block n-1 + final norm).

A preset draws each piece from its own seed (``PRESET_SEED + 1 + i`` for block ``i``, ``PRESET_SEED`` for the
token table) with transformers' T5 initialization, so a piece's weights do not depend on the others (a whole
preset module draws from one stream: the two are different seeded weights of the same architecture).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from transformers import T5Config, T5EncoderModel
from transformers.models.t5.modeling_t5 import T5Block, T5LayerNorm, T5PreTrainedModel

from sdnpu.convert.blockwise.piece import Piece, Weights
from sdnpu.convert.sources import PRESET_SEED, Source
from sdnpu.signatures import Signature


def _config(src: Source, key: str) -> Any:
    config = json.loads((src.modules[key] / "config.json").read_text())
    return T5Config(**{k: v for k, v in config.items() if k != "architectures"})


def _init(config: Any, module: Any) -> None:
    holder = SimpleNamespace(config=config)
    for m in module.modules():
        T5PreTrainedModel._init_weights(holder, m)  # uses self.config alone


def _block(config: Any, weights: Weights, i: int) -> Any:
    if weights.preset:
        torch.manual_seed(PRESET_SEED + 1 + i)
        block = T5Block(config, has_relative_attention_bias=i == 0, layer_idx=i)
        _init(config, block)
        return block.float().eval()
    return weights.load(lambda: T5Block(config, has_relative_attention_bias=i == 0, layer_idx=i),
                        f"encoder.block.{i}.", f"block {i}")


def _embedding(config: Any, weights: Weights) -> Any:
    emb = torch.nn.Embedding(config.vocab_size, config.d_model)
    if weights.preset:
        torch.manual_seed(PRESET_SEED)
        with torch.no_grad():
            emb.weight.normal_(mean=0.0, std=config.initializer_factor * 1.0)
    else:
        with torch.no_grad():
            emb.weight.copy_(weights.tensor("shared.weight", "encoder.embed_tokens.weight"))
    return emb.eval()


def _final_norm(config: Any, weights: Weights) -> Any:
    norm = T5LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
    with torch.no_grad():
        if weights.preset:
            norm.weight.fill_(config.initializer_factor * 1.0)
        else:
            norm.weight.copy_(weights.tensor("encoder.final_layer_norm.weight"))
    return norm.eval()


class T5Piece(torch.nn.Module):
    """Block ``i`` of T5's encoder with the shared position bias as a constant; the embedding before the first,
    the final norm after the last."""

    def __init__(self, block: Any, bias: Any, embed: Any = None, norm: Any = None) -> None:
        super().__init__()
        self.block, self.embed, self.norm = block, embed, norm
        self.register_buffer("position_bias", bias)

    def forward(self, x: Any) -> Any:
        h = self.embed(x) if self.embed is not None else x
        h = self.block(h, position_bias=self.position_bias)[0]
        return self.norm(h) if self.norm is not None else h


def _whole(i: int, param: str) -> str:
    """A T5 piece's parameter as the whole T5EncoderModel names it (``map_parameters`` strips the piece's
    first child, ``block``)."""
    if param.startswith("embed."):
        return "shared." + param[len("embed."):]
    if param.startswith("norm."):
        return "encoder.final_layer_norm." + param[len("norm."):]
    if param == "position_bias":
        return "position_bias (computed from encoder.block.0's relative_attention_bias)"
    return f"encoder.block.{i}.{param}"


def pieces(src: Source, key: str, sig: Signature, weights: Weights, start: int = 0,
           latent: tuple[int, int] | None = None) -> Iterator[Piece]:
    """T5's pieces in order for the encoder's signature ``sig``, each built when asked for; from piece ``start``
    on (block 0 is built all the same: its bucket table makes the position bias). ``latent``: the image size,
    which a text encoder does not depend on."""
    seq_len, in_name, out_name = int(sig.inputs[0].shape[1]), sig.inputs[0].name, sig.outputs[0]
    config = _config(src, key)
    n = config.num_layers
    first = _block(config, weights, 0)
    with torch.no_grad():  # block 0's bucket table makes every block's position bias
        bias = first.layer[0].SelfAttention.compute_bias(seq_len, seq_len).detach().clone()
    for i in range(start, n):
        block, first = first if i == 0 else _block(config, weights, i), None
        embed = _embedding(config, weights) if i == 0 else None
        norm = _final_norm(config, weights) if i == n - 1 else None
        yield Piece(i, n, T5Piece(block, bias, embed, norm).eval(), (in_name if i == 0 else "hidden_states",),
                    (out_name if i == n - 1 else "block_output",), whole=_whole)


def whole_module(src: Source, key: str, weights: Weights) -> Any:
    """The T5EncoderModel whose weights the pieces hold (small modules only: tests compare against it)."""
    config = _config(src, key)
    model = T5EncoderModel(config).eval()
    with torch.no_grad():
        model.shared.weight.copy_(_embedding(config, weights).weight)
        for i in range(config.num_layers):
            model.encoder.block[i].load_state_dict(_block(config, weights, i).state_dict())
        model.encoder.final_layer_norm.weight.copy_(_final_norm(config, weights).weight)
    return model
