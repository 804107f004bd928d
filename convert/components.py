"""The five exportable components: their ONNX signatures (optimum's names, static shapes) and the
thin torch wrappers that give each module a positional, tuple-returning ``forward`` to export.

Shapes, for a resolution ``R`` (pixels) and a VAE that downsamples by ``f`` (8 for SD/SDXL):

=============== ================================================= =====================================
component       inputs                                            outputs
=============== ================================================= =====================================
text_encoder    input_ids [1, 77] int64                           last_hidden_state [1, 77, D],
                                                                  pooler_output [1, D], hidden_states.N
text_encoder_2  input_ids [1, 77] int64                           text_embeds [1, P], last_hidden_state,
                                                                  hidden_states.N
unet            sample [2, 4, R/f, R/f], timestep [] f32,          out_sample [2, 4, R/f, R/f]
                encoder_hidden_states [2, 77, X],
                text_embeds [2, P], time_ids [2, 6] (SDXL only)
vae_encoder     sample [1, 3, R, R]                                latent_parameters [1, 8, R/f, R/f]
vae_decoder     latent_sample [1, 4, R/f, R/f]                     sample [1, 3, R, R]
=============== ================================================= =====================================

The UNet runs at batch 2 (classifier-free guidance: unconditional and conditional in one call).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from sdnpu.errors import SdnpuError

UNET_BATCH = 2  # classifier-free guidance runs both halves in one UNet call
SEQ_LEN = 77  # CLIP's context length


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
    return 2 ** (len(vae_config["block_out_channels"]) - 1)


def _unet_text_time(config: dict[str, Any]) -> bool:
    return config.get("addition_embed_type") == "text_time"


def signature(component: str, config: dict[str, Any], res: int, vae_factor: int = 8) -> Signature:
    """The static ONNX signature of ``component`` at resolution ``res`` for a module ``config``."""
    latent = res // vae_factor
    f32, i64 = "float32", "int64"
    if component in ("text_encoder", "text_encoder_2"):
        n_hidden = config["num_hidden_layers"] + 1
        hidden = tuple(f"hidden_states.{i}" for i in range(n_hidden))
        first = ("text_embeds", "last_hidden_state") if component == "text_encoder_2" else (
            "last_hidden_state", "pooler_output")
        return Signature((TensorSpec("input_ids", (1, SEQ_LEN), i64),), first + hidden)
    if component == "unet":
        inputs = [
            TensorSpec("sample", (UNET_BATCH, config["in_channels"], latent, latent), f32),
            TensorSpec("timestep", (), f32),
            TensorSpec("encoder_hidden_states", (UNET_BATCH, SEQ_LEN, config["cross_attention_dim"]), f32),
        ]
        if _unet_text_time(config):
            n_time = 6  # original size (2), crop top-left (2), target size (2)
            text_dim = config["projection_class_embeddings_input_dim"] - n_time * config["addition_time_embed_dim"]
            inputs += [TensorSpec("text_embeds", (UNET_BATCH, text_dim), f32),
                       TensorSpec("time_ids", (UNET_BATCH, n_time), f32)]
        elif config.get("addition_embed_type") is not None or config.get("class_embed_type") is not None:
            raise SdnpuError(
                f"UNet with addition_embed_type={config.get('addition_embed_type')!r} / "
                f"class_embed_type={config.get('class_embed_type')!r} is not supported",
                hint="sdnpu exports SD 1.x/2.x UNets (no added conditioning) and SDXL's text_time UNet",
            )
        return Signature(tuple(inputs), ("out_sample",))
    if component == "vae_encoder":
        return Signature((TensorSpec("sample", (1, config["in_channels"], res, res), f32),),
                         ("latent_parameters",))
    if component == "vae_decoder":
        return Signature((TensorSpec("latent_sample", (1, config["latent_channels"], latent, latent), f32),),
                         ("sample",))
    raise KeyError(component)


def resolution_step(component: str, config: dict[str, Any], vae_factor: int) -> int:
    """The resolution must be a multiple of this (each down block halves the latent, and the UNet's
    skip connections need the halves to line up again)."""
    if component == "unet":
        return vae_factor * 2 ** (len(config["block_out_channels"]) - 1)
    return vae_factor


def sample_inputs(sig: Signature, config: dict[str, Any], res: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded, realistic inputs: Gaussian latents and embeddings, a mid-schedule timestep, SDXL's
    time_ids for an uncropped ``res`` image, and a CLIP token sequence (BOS, tokens, EOS, padding)."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for spec in sig.inputs:
        if spec.name == "input_ids":
            vocab = config["vocab_size"]
            bos, eos = vocab - 2, vocab - 1
            ids = np.full(spec.shape, eos, dtype=np.int64)
            n = 12
            ids[:, 0] = bos
            ids[:, 1 : n + 1] = rng.integers(0, vocab - 2, size=(spec.shape[0], n))
            feeds[spec.name] = ids
        elif spec.name == "timestep":
            feeds[spec.name] = np.array(500.0, dtype=np.float32)
        elif spec.name == "time_ids":
            feeds[spec.name] = np.tile(np.array([res, res, 0, 0, res, res], np.float32), (spec.shape[0], 1))
        elif spec.name == "sample" and len(spec.shape) == 4 and spec.shape[1] == 3:  # an image in [-1, 1]
            feeds[spec.name] = rng.uniform(-1, 1, size=spec.shape).astype(np.float32)
        else:
            feeds[spec.name] = rng.standard_normal(spec.shape, dtype=np.float32)
    return feeds


@lru_cache(maxsize=1)
def _wrapper_classes() -> dict[str, Any]:
    """The wrapper classes, made once. They take the module as an argument and close over nothing: a
    class that captured the module would keep its weights alive as long as anything (torch's export
    caches) holds the class."""
    import torch

    class TextEncoder(torch.nn.Module):
        def __init__(self, model: Any, projection: bool) -> None:
            super().__init__()
            self.model = model
            self.projection = projection

        def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
            out = self.model(input_ids=input_ids, output_hidden_states=True, return_dict=True)
            first = (out.text_embeds, out.last_hidden_state) if self.projection else (
                out.last_hidden_state, out.pooler_output)
            return first + tuple(out.hidden_states)

    class UNet(torch.nn.Module):
        def __init__(self, unet: Any) -> None:
            super().__init__()
            self.unet = unet

        def forward(self, sample: torch.Tensor, timestep: torch.Tensor,
                    encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.unet(sample, timestep, encoder_hidden_states, return_dict=False)[0],)

    class UNetTextTime(UNet):
        def forward(self, sample: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    text_embeds: torch.Tensor, time_ids: torch.Tensor) -> tuple[torch.Tensor]:
            added = {"text_embeds": text_embeds, "time_ids": time_ids}
            return (self.unet(sample, timestep, encoder_hidden_states, added_cond_kwargs=added,
                              return_dict=False)[0],)

    class VaeEncoder(torch.nn.Module):
        def __init__(self, vae: Any) -> None:
            super().__init__()
            self.vae = vae

        def forward(self, sample: torch.Tensor) -> tuple[torch.Tensor]:
            return (self.vae.encode(sample, return_dict=False)[0].parameters,)

    class VaeDecoder(VaeEncoder):
        def forward(self, latent_sample: torch.Tensor) -> tuple[torch.Tensor]:  # type: ignore[override]
            return (self.vae.decode(latent_sample, return_dict=False)[0],)

    return {"TextEncoder": TextEncoder, "UNet": UNet, "UNetTextTime": UNetTextTime, "VaeEncoder": VaeEncoder,
            "VaeDecoder": VaeDecoder}


def build_wrapper(component: str, module: Any, config: dict[str, Any]) -> Any:
    """A torch module whose forward takes the signature's inputs in order and returns a tuple."""
    classes = _wrapper_classes()
    if component in ("text_encoder", "text_encoder_2"):
        wrapper = classes["TextEncoder"](module, projection=component == "text_encoder_2")
    elif component == "unet":
        wrapper = classes["UNetTextTime" if _unet_text_time(config) else "UNet"](module)
    elif component == "vae_encoder":
        wrapper = classes["VaeEncoder"](module)
    elif component == "vae_decoder":
        wrapper = classes["VaeDecoder"](module)
    else:
        raise KeyError(component)
    return wrapper.eval()
